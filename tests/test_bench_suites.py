"""Suite loaders: every suite loads from the vendored files, subsets are fixed, only test splits."""

import hashlib
import json
from pathlib import Path

import pytest

from dflash_mlx.bench import suites

DATA = Path(__file__).resolve().parents[1] / "benchmarks" / "data"

# Record counts of the evaluation splits (MBPP: sanitized test task ids only).
SIZES = {"copy": 12, "gsm8k": 1319, "math500": 500, "humaneval": 164, "mbpp": 257, "mtbench": 80, "aime25": 30}


def test_vendored_files_are_intact_and_found_first():
    assert suites.data_dir() == DATA
    for line in (DATA / "SHA256SUMS").read_text().splitlines():
        digest, name = line.split()
        assert hashlib.sha256((DATA / name).read_bytes()).hexdigest() == digest, name


@pytest.mark.parametrize("name", list(suites.SUITES))
def test_suite_loads_every_record_with_a_user_prompt(name):
    if name == "copy":
        from dflash_mlx.bench.documents import EVAL_DOCUMENTS, read_documents

        if read_documents(EVAL_DOCUMENTS)[1]:
            pytest.skip("the copy suite's documents (system licence texts, difflib.py) are not all here")
    prompts = suites.load_suite(name, root=str(DATA))
    assert len(prompts) == SIZES[name]
    assert len({p.id for p in prompts}) == len(prompts)
    for p in prompts:
        assert p.suite == name
        assert p.messages[-1]["role"] == "user" and len(p.text) > 20


@pytest.mark.parametrize("name", list(suites.SUITES))
def test_subsets_are_seeded_deterministic_and_nested(name):
    a = [p.id for p in suites.load_suite(name, 5, seed=0)]
    assert a == [p.id for p in suites.load_suite(name, 5, seed=0)]
    assert a == [p.id for p in suites.load_suite(name, 12, seed=0)][:5]
    assert a != [p.id for p in suites.load_suite(name, 5, seed=1)]
    # a shuffled subset, not just the head of the file
    assert a != [p.id for p in suites.SUITES[name](DATA)][:5]


def test_no_training_split_is_vendored_or_loaded():
    assert not any("train" in f.name for f in DATA.iterdir())
    mbpp = suites.load_suite("mbpp")
    ids = {int(p.id.split("/")[1]) for p in mbpp}
    assert ids and all(11 <= i <= 510 for i in ids)  # MBPP's test task ids
    raw = json.loads((DATA / "sanitized-mbpp.json").read_text())
    assert any(r["task_id"] > 510 for r in raw)  # the file does hold other splits
    train = Path("/work/shared/data/gsm8k_train.jsonl")
    if train.exists():  # GSM8K's train questions never appear in the gsm8k suite
        train_q = {json.loads(l)["question"] for l in train.open()}
        test_q = {json.loads(l)["question"] for l in (DATA / "gsm8k_test.jsonl").open()}
        assert not train_q & test_q


def test_prompt_contents_come_from_the_right_fields():
    mt = {p.id: p for p in suites.load_suite("mtbench")}
    assert mt["mtbench/81"].text.startswith("Compose an engaging travel blog post")
    assert "Start every sentence" not in mt["mtbench/81"].text  # first turn only
    he = {p.id: p for p in suites.load_suite("humaneval")}
    assert "def has_close_elements" in he["HumanEval/0"].text
    gsm = suites.load_suite("gsm8k")
    assert gsm[0].meta["answer"] and "####" not in gsm[0].meta["answer"]


def test_parse_suites():
    assert suites.parse_suites("gsm8k, mbpp") == ["gsm8k", "mbpp"]
    assert suites.parse_suites("all") == list(suites.SUITES)
    with pytest.raises(ValueError):
        suites.parse_suites("gsm8k,nope")


class _Tok:
    chat_template = "x"

    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        assert not tokenize and add_generation_prompt
        return "<user>" + messages[-1]["content"] + "<assistant>"


def test_format_prompt_uses_the_chat_template():
    p = suites.load_suite("gsm8k", 1)[0]
    out = suites.format_prompt(_Tok(), p)
    assert out.startswith("<user>") and p.text in out and out.endswith("<assistant>")
