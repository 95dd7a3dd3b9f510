"""Benchmark suites: evaluation prompts read from the vendored test splits.

Each loader returns every usable record of a suite in file order; `load_suite`
then takes a fixed, seeded subset. The subset for `limit=n` is a prefix of the
subset for `limit=m > n` (one seeded shuffle, then a cut), so short runs are
comparable with long ones.
"""

import gzip
import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

from dflash_mlx.models.loading import apply_chat_template

# benchmarks/data in a source checkout (the CLI is meant to run from a clone);
# the shared project copy is a fallback for developer machines.
DATA_DIRS = (
    Path(__file__).resolve().parents[2] / "benchmarks" / "data",
    Path("/work/shared/data"),
)


@dataclass
class Prompt:
    suite: str
    id: str
    messages: List[Dict[str, str]]  # chat messages; the user turn to answer is last
    meta: Dict[str, str] = field(default_factory=dict)

    @property
    def text(self) -> str:
        return self.messages[-1]["content"]


def data_dir(override: Optional[str] = None) -> Path:
    candidates = [Path(override)] if override else list(DATA_DIRS)
    for d in candidates:
        if (d / "gsm8k_test.jsonl").exists():
            return d
    raise FileNotFoundError(
        "benchmark data not found in " + ", ".join(str(d) for d in candidates)
    )


def _jsonl(path: Path) -> List[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _user(text: str) -> List[Dict[str, str]]:
    return [{"role": "user", "content": text}]


# Prompt wording: short instructions that make an instruct model answer in the
# suite's usual shape (worked solution, code block). Acceptance depends on the
# output distribution, so the wording is fixed and recorded with the results.
_MATH_SUFFIX = "\n\nReason step by step, then give the final answer in \\boxed{}."


def load_gsm8k(root: Path) -> List[Prompt]:
    rows = _jsonl(root / "gsm8k_test.jsonl")
    return [
        Prompt(
            "gsm8k",
            f"gsm8k/{i}",
            _user(
                r["question"]
                + "\n\nReason step by step, then write the final answer after '####'."
            ),
            {"answer": r["answer"].split("####")[-1].strip()},
        )
        for i, r in enumerate(rows)
    ]


def load_math500(root: Path) -> List[Prompt]:
    rows = _jsonl(root / "math500_test.jsonl")
    return [
        Prompt("math500", r["unique_id"], _user(r["problem"] + _MATH_SUFFIX),
               {"answer": r["answer"]})
        for r in rows
    ]


def load_aime25(root: Path) -> List[Prompt]:
    prompts = []
    for part in ("I", "II"):
        for i, r in enumerate(_jsonl(root / f"aime2025-{part}.jsonl")):
            prompts.append(
                Prompt("aime25", f"aime2025-{part}/{i + 1}",
                       _user(r["question"] + _MATH_SUFFIX), {"answer": str(r["answer"])})
            )
    return prompts


def load_humaneval(root: Path) -> List[Prompt]:
    rows = _jsonl(root / "HumanEval.jsonl.gz")
    return [
        Prompt(
            "humaneval",
            r["task_id"],
            _user(
                "Complete the following Python function. Reply with the whole "
                "function in one Python code block.\n\n```python\n"
                + r["prompt"]
                + "```"
            ),
            {"entry_point": r["entry_point"]},
        )
        for r in rows
    ]


# MBPP's official split by task id: 1-10 prompt (few-shot), 11-510 test,
# 511-600 validation, 601-974 train. The sanitized file mixes all four.
MBPP_TEST_IDS = range(11, 511)


def load_mbpp(root: Path) -> List[Prompt]:
    with open(root / "sanitized-mbpp.json", encoding="utf-8") as f:
        rows = json.load(f)
    return [
        Prompt(
            "mbpp",
            f"mbpp/{r['task_id']}",
            _user(
                r["prompt"]
                + " Reply with the function in one Python code block. "
                "It must pass these tests:\n\n"
                + "\n".join(r["test_list"])
            ),
        )
        for r in rows
        if r["task_id"] in MBPP_TEST_IDS
    ]


def load_mtbench(root: Path) -> List[Prompt]:
    # First turn only: the second turn needs the model's own first answer,
    # which would make the prompt depend on the decoding being measured.
    rows = _jsonl(root / "mt_bench_question.jsonl")
    return [
        Prompt("mtbench", f"mtbench/{r['question_id']}", _user(r["turns"][0]),
               {"category": r["category"]})
        for r in rows
    ]


# -- copy-heavy tasks, from the depth benchmark's held-out documents -----------------------


def _paragraphs(text: str, lo: int = 300, hi: int = 700) -> List[str]:
    """Paragraphs of `lo`-`hi` characters (whitespace inside joined), in order."""
    out = []
    for block in text.split("\n\n"):
        para = " ".join(block.split())
        if lo <= len(para) <= hi:
            out.append(para)
    return out


def _functions(source: str, lo: int = 250, hi: int = 900) -> List[Tuple[str, str]]:
    """(name, source) of top-level or method `def`s of `lo`-`hi` characters."""
    import ast

    found = []
    lines = source.splitlines()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef) and not node.name.startswith("__"):
            body = "\n".join(lines[node.lineno - 1 : node.end_lineno])
            indent = len(body) - len(body.lstrip())
            body = "\n".join(line[indent:] for line in body.splitlines())
            if lo <= len(body) <= hi:
                found.append((node.name, body))
    return found


def load_copy(root: Path) -> List[Prompt]:
    """Tasks whose answers are mostly spans of the prompt: a text edit, a code edit (a
    rename), quoting, and repeating an earlier answer in a later turn. Built from the depth
    benchmark's evaluation documents (`documents.EVAL_DOCUMENTS`: licence texts and
    difflib.py), which no shipped draft was trained on; `root` is not used."""
    from dflash_mlx.bench.documents import EVAL_DOCUMENTS, read_documents

    docs, _ = read_documents(EVAL_DOCUMENTS)
    texts = [p for d in docs if d.kind == "licence" for p in _paragraphs(d.text)]
    code = [f for d in docs if d.kind == "code" for f in _functions(d.text)]
    prompts = []
    for i, para in enumerate(texts[:6:2]):
        prompts.append(Prompt("copy", f"copy/text-edit/{i}", _user(
            "Rewrite the text below with every occurrence of the word \"the\" in capitals (THE). "
            "Change nothing else and reply with the text only.\n\n" + para), {"task": "text edit"}))
    for i, (name, body) in enumerate(code[:3]):
        prompts.append(Prompt("copy", f"copy/code-edit/{i}", _user(
            f"Rename the function `{name}` to `{name}_v2` in the code below. Reply with the whole "
            "code in one Python code block and change nothing else.\n\n```python\n" + body + "\n```"),
            {"task": "code edit"}))
    for i, para in enumerate(texts[1:7:2]):
        prompts.append(Prompt("copy", f"copy/quote/{i}", _user(
            "Quote the text below word for word, in quotation marks, then name its subject in "
            "one sentence.\n\n" + para), {"task": "quote"}))
    for i, para in enumerate(texts[6:9]):
        prompts.append(Prompt("copy", f"copy/repeat/{i}", [
            {"role": "user", "content": "Write one paragraph of licence text."},
            {"role": "assistant", "content": para},
            {"role": "user", "content": "Repeat your previous answer word for word."},
        ], {"task": "multi-turn repeat"}))
    return prompts


SUITES: Dict[str, Callable[[Path], List[Prompt]]] = {
    "gsm8k": load_gsm8k,
    "math500": load_math500,
    "humaneval": load_humaneval,
    "mbpp": load_mbpp,
    "mtbench": load_mtbench,
    "aime25": load_aime25,
    "copy": load_copy,
}


def parse_suites(spec: str) -> List[str]:
    names = list(SUITES) if spec.strip() == "all" else [
        s.strip() for s in spec.split(",") if s.strip()
    ]
    unknown = [n for n in names if n not in SUITES]
    if unknown:
        raise ValueError(f"unknown suite(s) {unknown}; known: {', '.join(SUITES)}")
    return names


def load_suite(name: str, limit: Optional[int] = None, seed: int = 0,
               root: Optional[str] = None) -> List[Prompt]:
    prompts = SUITES[name](data_dir(root))
    order = list(range(len(prompts)))
    # The suite name is part of the seed so two suites of equal size do not
    # share the same index pattern.
    random.Random(f"{seed}:{name}").shuffle(order)
    if limit is not None:
        order = order[:limit]
    return [prompts[i] for i in order]


def format_prompt(tokenizer, prompt: Prompt) -> str:
    """The prompt as the model sees it: chat template when the tokenizer has one."""
    return apply_chat_template(tokenizer, prompt.messages)
