"""Long texts already on the machine, for measuring and training drafts deep into a context.

Two disjoint sets, fixed here once so that nothing trained on is ever measured on:

- `EVAL_DOCUMENTS`: the depth benchmark's documents (licence texts from the system's
  `common-licenses`, one standard-library module's source);
- `TRAIN_DOCUMENTS`: other licences and other standard-library modules, for depth
  training data.

Near-duplicates of an evaluation text (GFDL-1.2 of GFDL-1.3, LGPL-3's own text inside
GPL-3 builds) are in neither set. Nothing is downloaded; a text that is not on this
machine is skipped, and `read_documents` says which.
"""

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import List, Sequence, Tuple

LICENSES = Path("/usr/share/common-licenses")


def _stdlib(name: str) -> Path:
    return Path(sysconfig.get_paths()["stdlib"]) / name


@dataclass(frozen=True)
class DocumentSpec:
    name: str
    kind: str  # "licence" | "code": picks the question asked after it
    parts: Tuple[str, ...]  # files concatenated (a licence alone is shorter than the window)

    def paths(self) -> List[Path]:
        return [LICENSES / p[len("licence:"):] if p.startswith("licence:") else _stdlib(p[len("python:"):])
                for p in self.parts]


EVAL_DOCUMENTS = (
    DocumentSpec("gpl3+lgpl3", "licence", ("licence:GPL-3", "licence:LGPL-3")),
    DocumentSpec("gfdl13+mpl2+apache2", "licence", ("licence:GFDL-1.3", "licence:MPL-2.0", "licence:Apache-2.0")),
    DocumentSpec("difflib.py", "code", ("python:difflib.py",)),
)

TRAIN_DOCUMENTS = (
    DocumentSpec("gpl2+lgpl21", "licence", ("licence:GPL-2", "licence:LGPL-2.1")),
    DocumentSpec("mpl11+artistic+cc0", "licence", ("licence:MPL-1.1", "licence:Artistic", "licence:CC0-1.0")),
    DocumentSpec("argparse.py", "code", ("python:argparse.py",)),
    DocumentSpec("textwrap+shlex+fractions.py", "code",
                 ("python:textwrap.py", "python:shlex.py", "python:fractions.py")),
    DocumentSpec("json+csv.py", "code", ("python:json/decoder.py", "python:json/encoder.py", "python:csv.py")),
    DocumentSpec("statistics.py", "code", ("python:statistics.py",)),
    DocumentSpec("configparser.py", "code", ("python:configparser.py",)),
    DocumentSpec("pathlib.py", "code", ("python:pathlib.py",)),
    DocumentSpec("functools.py", "code", ("python:functools.py",)),
    DocumentSpec("random.py", "code", ("python:random.py",)),
)

# What is asked after a document (the benchmark asks the first; training data may ask any).
QUESTIONS = {
    "licence": ("Summarize the text above in three sentences.",
                "What does the text above allow and forbid? Answer in a short list.",
                "Explain the text above to someone who has never read a licence."),
    "code": ("Explain what the code above does, function by function.",
             "Write a short usage example of the code above.",
             "What could go wrong in the code above? List three risks."),
}


@dataclass
class Document:
    name: str
    kind: str
    text: str

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.text.encode()).hexdigest()[:16]


def document_prompt_parts(tokenizer, doc: Document, length: int, question: int = 0):
    """(head, document, tail) token ids, `length` in all: the chat template before the
    document, the document's first tokens, then `QUESTIONS[doc.kind][question]` and the
    template up to the answer. Prompts of one document share `head + document` prefixes."""
    from dflash_mlx.models.loading import apply_chat_template

    marker = "\x00DOC\x00"
    text = apply_chat_template(tokenizer, [{"role": "user", "content": marker + "\n\n"
                                            + QUESTIONS[doc.kind][question]}])
    head, tail = text.split(marker)
    head_ids = tokenizer.encode(head, add_special_tokens=False)
    tail_ids = tokenizer.encode(tail, add_special_tokens=False)
    room = length - len(head_ids) - len(tail_ids)
    doc_ids = tokenizer.encode(doc.text, add_special_tokens=False)
    if room < 1 or room > len(doc_ids):
        raise ValueError(f"document {doc.name} ({len(doc_ids)} tokens) cannot fill a {length}-token prompt")
    return head_ids, doc_ids[:room], tail_ids


def document_prompt(tokenizer, doc: Document, length: int, question: int = 0) -> List[int]:
    """Exactly `length` token ids: the document's first tokens and a question, as the user's turn."""
    head, body, tail = document_prompt_parts(tokenizer, doc, length, question)
    return head + body + tail


def read_documents(specs: Sequence[DocumentSpec]) -> Tuple[List[Document], List[str]]:
    """(documents found, names of those missing here with the file that is missing)."""
    found, missing = [], []
    for spec in specs:
        paths = spec.paths()
        absent = [str(p) for p in paths if not p.is_file()]
        if absent:
            missing.append(f"{spec.name} ({absent[0]} not found)")
            continue
        text = "\n\n".join(p.read_text(encoding="utf-8", errors="replace").strip() for p in paths)
        found.append(Document(spec.name, spec.kind, text))
    return found, missing
