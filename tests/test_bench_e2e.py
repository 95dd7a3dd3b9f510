"""The benchmark harness end to end on tiny random models (seconds on CPU).

Drafts are `dflash_mlx.testing.targets.ScriptedDraft`s that propose the target's own greedy
continuation with a known number of correct tokens per block, so tau and the
accept-length histogram have exact expected values.
"""

import json

import pytest

pytest.importorskip("dflash_mlx.testing.targets")

from dflash_mlx import stream_generate  # noqa: E402
from dflash_mlx.testing import targets  # noqa: E402
from dflash_mlx.bench import cli, report, runner  # noqa: E402
from dflash_mlx.bench.suites import load_suite  # noqa: E402
from dflash_mlx.models.target.adapter import Target  # noqa: E402
from dflash_mlx.options import GenerationOptions  # noqa: E402

MAX_TOKENS = 13  # 1 prefill token + 12: divisible into 3-token and 8+4-token cycles


@pytest.fixture(scope="module")
def tiny():
    return targets.tiny_target("qwen3", seed=0)


def _prompts():
    # Real suite prompts, cut short: the byte tokenizer makes one token per byte.
    ps = load_suite("gsm8k", 1) + load_suite("mtbench", 1)
    for p in ps:
        p.messages = [{"role": "user", "content": p.text[:60]}]
    return ps


def scripted(correct_per_block, made=None):
    """dflash_fn whose draft gets exactly `correct_per_block` leading tokens right."""

    def fn(model, draft, tokenizer, ids, max_tokens, block, temperature, seed, profile):
        ref = list(ids) + targets.greedy_reference(model, ids, max_tokens)
        d = targets.ScriptedDraft(Target(model), ref, lambda c: correct_per_block,
                                  block_size=block)
        if made is not None:
            made.append(d)
        return stream_generate(model, d, tokenizer, ids, max_tokens=max_tokens,
                               block_size=block, temperature=temperature, seed=seed,
                               profile=profile)

    return fn


def _cfg(blocks, **kw):
    return runner.BenchConfig(suites=["gsm8k", "mtbench"], limit=1, max_tokens=MAX_TOKENS,
                              block_sizes=blocks, forward_reps=2, model="tiny-qwen3",
                              draft="scripted", **kw)


def test_run_measures_exact_tau_and_matches_baseline(tiny, tmp_path):
    model, tok = tiny
    lines = []
    doc = runner.run(model, None, tok, _cfg([4]), prompts=_prompts(),
                     dflash_fn=scripted(2), log=lines.append)
    assert report.validate(doc) == []
    progress = [m for m in lines if "ETA" in m]
    assert len(progress) == 2 and progress[0].startswith("[  1/2] gsm8k/")
    assert set(doc["forward_times_s"]) == {"1", "4"}
    assert all(t > 0 for t in doc["forward_times_s"].values())
    # forward_reps up front, then one more sample after each of the 2 prompts
    assert all(len(ts) == 2 + 2 for ts in doc["forward_time_samples_s"].values())
    for row in doc["prompts"]:
        assert row["baseline"]["generated"] == MAX_TOKENS - 1
        rec = row["dflash"]["4"]
        # 12 tokens after the prefill token, 2 drafted + 1 bonus per cycle
        assert rec["accept_lengths"] == [2, 2, 2, 2]
        assert rec["tau"] == pytest.approx(3.0)
        assert rec["accept_hist"] == [0, 0, 4, 0]
        assert rec["tokens_match"] is True and rec["profiled_tokens_match"] is True
        assert rec["generated"] == MAX_TOKENS - 1
        assert rec["speedup"] > 0 and rec["tps"] > 0
        assert rec["efficiency"] == pytest.approx(rec["speedup"] / 3.0)
        assert rec["limit"] == pytest.approx(3.0 * rec["forward_ratio"])
        split = rec["cycle_split_s"]
        assert set(split) == {"draft", "verify", "rollback", "other"}
        assert split["verify"] > 0
    s = doc["summary"]["4"]
    assert set(s) == {"gsm8k", "mtbench", "all"}
    assert s["all"]["prompts"] == 2 and s["all"]["cycles"] == 8 and s["all"]["mismatches"] == 0
    paths = report.write_all(doc, tmp_path, with_plots=False)
    assert "identical to the baseline" in (tmp_path / "results.md").read_text()
    assert len(paths) == 2


def test_block_size_sweep_records_every_block(tiny):
    model, tok = tiny
    doc = runner.run(model, None, tok, _cfg([4, 8], profile=False, warmup=False),
                     prompts=_prompts()[:1], dflash_fn=scripted(99), log=lambda m: None)
    assert report.validate(doc) == []
    rec4, rec8 = (doc["prompts"][0]["dflash"][b] for b in ("4", "8"))
    assert rec4["accept_lengths"] == [3, 3, 3]  # oracle: whole blocks accepted
    assert rec4["tau"] == pytest.approx(4.0)
    assert rec8["accept_lengths"] == [7, 3]  # the last block shrinks to the budget
    assert rec8["tau"] == pytest.approx(6.0)
    assert rec4["cycle_split_s"] is None  # no profiled pass asked for
    assert [int(b) for b in doc["summary"]] == [4, 8]


def test_mismatch_is_detected_and_reported(tiny):
    model, tok = tiny
    honest = scripted(2)

    def corrupt(*args):
        for i, r in enumerate(honest(*args)):
            if i == 2:  # second cycle: tokens 4..6 of the output
                r.tokens = [(r.tokens[0] + 1) % 256] + r.tokens[1:]
            yield r

    doc = runner.run(model, None, tok, _cfg([4], profile=False), prompts=_prompts()[:1],
                     dflash_fn=corrupt, log=lambda m: None)
    rec = doc["prompts"][0]["dflash"]["4"]
    assert rec["tokens_match"] is False and rec["first_mismatch"] == 4
    assert rec["tokens"][4] != doc["prompts"][0]["baseline"]["tokens"][4]
    assert doc["summary"]["4"]["all"]["mismatches"] == 1
    assert "**MISMATCH**" in report.markdown(doc)


def test_random_dflash_draft_is_lossless_through_the_harness(tiny):
    from dflash_mlx.models.draft.checkpoints import random_draft

    model, tok = tiny
    # the real engine and a real (untrained) DFlash draft, through the default dflash_fn
    draft = random_draft(model, seed=0, num_layers=1, block_size=4)
    doc = runner.run(model, draft, tok, _cfg(["draft", "auto"], warmup=False), prompts=_prompts(),
                     log=lambda m: None)
    assert report.validate(doc) == []
    assert doc["config"]["block_sizes"] == [4, "auto"]  # "draft" resolved to the draft's own
    assert set(doc["forward_times_s"]) == {"1", "4"}
    for row in doc["prompts"]:
        for b in ("4", "auto"):
            rec = row["dflash"][b]
            assert rec["tokens_match"] is True and rec["tau"] >= 1.0
            assert sum(rec["accept_hist"]) == rec["cycles"] > 0
            assert rec["max_block_size"] == 4 and len(rec["accept_hist"]) == 4
        assert row["dflash"]["auto"]["limit"] is None  # no single verify width
    assert "## Block size auto" in report.markdown(doc)


def test_cli_writes_results_and_plots(tiny, tmp_path, monkeypatch):
    import dflash_mlx

    model, tok = tiny
    monkeypatch.setattr(dflash_mlx, "load", lambda name, **kw: (model, tok))
    monkeypatch.setattr(dflash_mlx, "load_draft", lambda name, m, **kw: None)
    monkeypatch.setattr(runner, "dflash_stream", scripted(2))
    monkeypatch.setattr(runner, "format_prompt", lambda t, p: p.text[:40])
    out = tmp_path / "run"
    rc = cli.main(["--suite", "humaneval,mbpp", "--limit", "1", "--max-tokens", "7",
                   "--block-size", "4", "--forward-reps", "1", "--out", str(out)])
    assert rc == 0
    doc = json.loads((out / "results.json").read_text())
    assert report.validate(doc) == []
    assert doc["config"]["suites"] == ["humaneval", "mbpp"]
    assert doc["config"]["command"].endswith("dflash-mlx bench --suite humaneval,mbpp --limit 1 "
                                             f"--max-tokens 7 --block-size 4 --forward-reps 1 --out {out}")
    assert [r["suite"] for r in doc["prompts"]] == ["humaneval", "mbpp"]
    for name in ("results.md", "speedup_per_suite.png", "accept_hist.png", "time_split.png"):
        assert (out / name).stat().st_size > 0
    # --from-json re-renders the Markdown from the JSON alone
    (out / "results.md").unlink()
    assert cli.main(["--from-json", str(out / "results.json"), "--no-plots"]) == 0
    assert "| humaneval | 1 |" in (out / "results.md").read_text()
    (out / "bad.json").write_text("{}")
    assert cli.main(["--from-json", str(out / "bad.json")]) == 2


def test_cli_arguments_and_dispatch():
    args = cli.build_parser().parse_args(["--block-sizes", "4,8,16", "--suite", "all"])
    assert args.block_sizes == [4, 8, 16] and args.model == "smollm2-135m"
    assert cli.build_parser().parse_args(["--block-sizes", "8,auto"]).block_sizes == [8, "auto"]
    assert cli.build_parser().parse_args(["--block-size", "auto"]).block_size == "auto"
    from dflash_mlx.cli.main import main as top_main
    from dflash_mlx.cli.common import CLIError

    with pytest.raises(CLIError, match=r"block size takes 'auto' \(default\), 'draft'"):
        cli.build_parser().parse_args(["--block-size", "wide"])
    with pytest.raises(CLIError, match="got '0'"):
        cli.build_parser().parse_args(["--block-sizes", "4,0"])
    # rejected before loading
    assert top_main(["bench", "--suite", "gsm8k,nope"]) == 2
    assert top_main(["bench", "--limit", "0"]) == 2
    assert top_main(["bench", "--temperature", "-1"]) == 2


def test_sampling_run_skips_the_identity_check(tiny):
    from dflash_mlx.models.draft.checkpoints import random_draft

    model, tok = tiny
    draft = random_draft(model, seed=0, num_layers=1, block_size=4)
    doc = runner.run(model, draft, tok, _cfg([4], temperature=0.8, profile=False, warmup=False),
                     prompts=_prompts()[:1], log=lambda m: None)
    assert report.validate(doc) == []
    rec = doc["prompts"][0]["dflash"]["4"]
    assert doc["config"]["greedy"] is False and rec["tokens_match"] is None
    assert rec["generated"] > 0 and doc["prompts"][0]["baseline"]["generated"] > 0
    assert "Not checked (temperature > 0)" in report.markdown(doc)


def test_sampling_filters_reach_both_engines(tiny, monkeypatch):
    from dflash_mlx.models.draft.checkpoints import random_draft

    model, tok = tiny
    seen = {"baseline": [], "dflash": []}
    real_base, real_dflash = runner.baseline_stream, runner.dflash_stream

    def base(*a, **kw):
        seen["baseline"].append(kw)
        return real_base(*a, **kw)

    def dflash(*a, **kw):
        seen["dflash"].append(kw)
        return real_dflash(*a, **kw)

    monkeypatch.setattr(runner, "baseline_stream", base)
    monkeypatch.setattr(runner, "dflash_stream", dflash)
    draft = random_draft(model, seed=0, num_layers=1, block_size=4)
    cfg = _cfg([4], temperature=0.8, top_p=0.9, top_k=5, profile=False, warmup=False)
    doc = runner.run(model, draft, tok, cfg, prompts=_prompts()[:1], log=lambda m: None)
    assert seen["baseline"] == [{"top_p": 0.9, "top_k": 5}]
    assert seen["dflash"] == [{"top_p": 0.9, "top_k": 5}]
    assert (doc["config"]["top_p"], doc["config"]["top_k"], doc["config"]["min_p"]) == (0.9, 5, 0.0)
    args = cli.build_parser().parse_args(["--top-p", "0.9", "--top-k", "5", "--min-p", "0.1"])
    assert (args.top_p, args.top_k, args.min_p, args.block_size, args.seed) == (0.9, 5, 0.1, "auto", 0)


def test_penalties_reach_both_engines_and_the_answers_agree(tiny):
    """`--repetition-penalty` and the others: mlx-lm's baseline decodes under them as DFlash does, so
    the harness's token-for-token check holds (and the answers differ from those without them)."""
    from dflash_mlx.models.draft.checkpoints import random_draft

    model, tok = tiny
    draft = random_draft(model, seed=0, num_layers=1, block_size=4)
    penalties = GenerationOptions(repetition_penalty=2.0, presence_penalty=20.0, logit_bias={7: 3.0}).penalties()
    docs = [runner.run(model, draft, tok, _cfg([4, "auto"], warmup=False, profile=False, penalties=p),
                       prompts=_prompts()[:2], log=lambda m: None) for p in ({}, penalties)]
    for doc in docs:
        assert all(row["dflash"][b]["tokens_match"] for row in doc["prompts"] for b in ("4", "auto"))
    assert docs[1]["config"]["penalties"]["repetition_penalty"] == 2.0
    answers = [[r["baseline"]["tokens"] for r in doc["prompts"]] for doc in docs]
    assert answers[0] != answers[1]
    args = cli.build_parser().parse_args(["--repetition-penalty", "1.2", "--frequency-penalty", "0.5"])
    assert GenerationOptions.from_args(args).penalties()["frequency_penalty"] == 0.5
