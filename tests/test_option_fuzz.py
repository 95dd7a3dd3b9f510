"""A few cases of the option fuzz (`dflash_mlx.testing.option_fuzz`; thousands run in
benchmarks/option_fuzz.py): random widths, prefill chunks, stops, logprobs, copies, trees, split
heads, deterministic mode, second turns, bfloat16 and 4- and 8-bit weights on random
architectures, alone and in the batch engine, each exact against mlx-lm's greedy decode or
refused in one line."""

import pytest

from dflash_mlx.testing import option_fuzz

# (the full runs in benchmarks/results/*-option-fuzz start at seed 1000); batch seeds 0-11 include
# rows joining a lone row after its rollbacks past a window, which raised until 2026-12-05
STREAM_SEEDS = range(0, 30)
BATCH_SEEDS = range(0, 12)


def _ok(row):
    assert row["status"] in ("exact", "refused", "no batch", "not run"), row
    if row["status"] == "refused":
        assert "\n" not in row["reason"]
    if row["status"] == "not run":  # mlx-lm cannot quantize the tiny config, or run it in bfloat16 here
        assert row["reason"].startswith("mlx-lm: ")


@pytest.mark.parametrize("start", range(0, len(STREAM_SEEDS), 10))
def test_stream_cases_are_exact_or_refused(start):
    for seed in STREAM_SEEDS[start : start + 10]:
        _ok(option_fuzz.stream_case(seed))


def test_guess_cases_are_exact_or_refused():
    """Drafted chains' successors queued before their read on the guess that they are accepted whole
    (forced on), most guesses right, the rest rolled back whole."""
    for seed in range(10):
        _ok(option_fuzz.stream_case(seed, guess=True))


def test_batch_guess_cases_are_exact_or_refused():
    """The same while a batch engine's row decodes alone, rows joining and leaving around it."""
    for seed in range(8):
        _ok(option_fuzz.batch_case(seed, guess=True))


def test_the_fuzz_sees_a_wrong_guess_kept(monkeypatch):
    """Negative control: with a wrong guess's cycle kept (never discarded), guess cases mismatch."""
    import dflash_mlx.engine.cycle as cycle_mod

    monkeypatch.setattr(cycle_mod, "discard", lambda target, state: None)
    rows = [option_fuzz.stream_case(seed, guess=True) for seed in range(10)]
    assert any(r["status"] == "mismatch" for r in rows), rows


@pytest.mark.parametrize("start", range(0, len(BATCH_SEEDS), 4))
def test_batch_cases_are_exact_or_refused(start):
    for seed in BATCH_SEEDS[start : start + 4]:
        _ok(option_fuzz.batch_case(seed))


def test_the_fuzz_sees_a_rollback_that_does_nothing(monkeypatch):
    """Negative control: with rollbacks turned into no-ops, scripted drafts' rejected tokens stay
    in the caches, and the cases that roll back must mismatch."""
    from dflash_mlx.models.target.adapter import Target

    monkeypatch.setattr(Target, "rollback", lambda self, *args, **kwargs: None)
    rows = [option_fuzz.stream_case(seed) for seed in STREAM_SEEDS[:15] if not option_fuzz._long_prompt(seed)]
    scripted = [r for r in rows if r["draft"] == "scripted" and r["max_tokens"] >= 12]
    assert scripted and any(r["status"] == "mismatch" for r in scripted), rows
