"""Result document: built from synthetic traces through the runner's own record code,
then validated, written (JSON, Markdown, PNG) and read back."""

import json

import pytest

from dflash_mlx.bench import metrics, report, runner
from dflash_mlx.bench.metrics import Trace
from dflash_mlx.bench.environment import environment

BLOCKS = [4, 8]


def _doc(mismatch=False):
    eos = {0}
    rows = []
    for i, suite in enumerate(["gsm8k", "gsm8k", "mtbench"]):
        base = Trace(tokens=[5, 6, 7, 8, 9, 0], prompt_tokens=20, first_tokens=1,
                     prefill_s=0.2, generation_s=0.4)
        base.tokens = metrics.strip_stop(base.tokens, eos)
        dflash = {}
        for b in BLOCKS:
            toks = [5, 6, 7, 8, 9] if not (mismatch and i == 1) else [5, 6, 1, 8, 9]
            timed = Trace(tokens=toks, prompt_tokens=20, first_tokens=1, prefill_s=0.25,
                          generation_s=0.2, accept_lengths=[1, 1])
            prof = Trace(tokens=toks, prompt_tokens=20, first_tokens=1, prefill_s=0.3,
                         generation_s=0.3, accept_lengths=[1, 1], profiled_cycles=2,
                         cycle_times={"draft": 0.02, "verify": 0.2, "rollback": 0.01,
                                      "other": 0.03})
            dflash[str(b)] = runner._dflash_record(timed, base, b, 0.6, True, eos, prof)
        rows.append({"suite": suite, "id": f"{suite}/{i}", "prompt_tokens": 20,
                     "baseline": {"generated": base.generated, "prefill_s": 0.2,
                                  "prefill_tps": 100.0, "generation_s": 0.4,
                                  "tps": metrics.generation_tps(base), "finish_reason": "stop",
                                  "tokens": base.tokens},
                     "dflash": dflash})
    cfg = runner.BenchConfig(suites=["gsm8k", "mtbench"], limit=2, max_tokens=16,
                             model="tiny", draft="tiny-draft")
    from dataclasses import asdict
    return {
        "schema": runner.SCHEMA,
        "environment": environment(None),
        "config": {**asdict(cfg), "block_sizes": BLOCKS, "greedy": True},
        "forward_times_s": {"1": 0.01, "4": 0.015, "8": 0.02},
        "forward_context_tokens": 20,
        "prompts": rows,
        "summary": runner.summarize(rows, BLOCKS),
    }


def test_record_arithmetic_from_traces():
    rec = _doc()["prompts"][0]["dflash"]["4"]
    assert rec["generated"] == 4 and rec["tps"] == pytest.approx(20.0)
    assert rec["tau"] == pytest.approx(2.0)
    assert rec["speedup"] == pytest.approx(20.0 / 10.0)
    assert rec["efficiency"] == pytest.approx(1.0)
    assert rec["limit"] == pytest.approx(1.2)
    assert rec["accept_hist"] == [0, 2, 0, 0]
    assert rec["cycle_split_s"]["verify"] == pytest.approx(0.1)
    assert rec["tokens_match"] is True and rec["profiled_tokens_match"] is True


def test_schema_valid_and_survives_json(tmp_path):
    doc = _doc()
    assert report.validate(doc) == []
    env = doc["environment"]
    assert env["mlx_version"] and env["backend"] in ("cpu", "gpu") and env["cpu"]
    report.write_json(doc, tmp_path / "r.json")
    back = json.loads((tmp_path / "r.json").read_text())
    assert report.validate(back) == []
    assert set(back["summary"]) == {"4", "8"}
    assert set(back["summary"]["4"]) == {"gsm8k", "mtbench", "all"}
    assert back["summary"]["4"]["all"]["prompts"] == 3


def test_validate_reports_missing_and_mistyped_fields():
    doc = _doc()
    del doc["prompts"][0]["dflash"]["8"]["tau"]
    doc["summary"]["4"]["all"]["speedup"] = "fast"
    doc["prompts"][1]["dflash"]["4"]["accept_hist"] = [1, 1]
    errors = report.validate(doc)
    assert any("dflash[8]: missing 'tau'" in e for e in errors)
    assert any("summary[4][all].speedup" in e for e in errors)
    assert any("accept_hist: length != block size" in e for e in errors)
    assert report.validate({"schema": "x"})  # top level incomplete


def test_files_from_before_auto_block_sizes_still_validate():
    doc = _doc()
    for row in doc["prompts"]:
        for rec in row["dflash"].values():
            del rec["max_block_size"]
    assert report.validate(doc) == []


def test_mismatch_is_flagged_in_summary_and_markdown():
    doc = _doc(mismatch=True)
    assert doc["summary"]["4"]["gsm8k"]["mismatches"] == 1
    assert doc["summary"]["4"]["mtbench"]["mismatches"] == 0
    rec = doc["prompts"][1]["dflash"]["4"]
    assert rec["tokens_match"] is False and rec["first_mismatch"] == 2
    md = report.markdown(doc)
    assert "**MISMATCH**" in md and "gsm8k/1, block 4: first differing token at index 2" in md
    assert "identical to the baseline" in report.markdown(_doc())


def test_write_all_writes_markdown_and_plots(tmp_path):
    paths = report.write_all(_doc(), tmp_path)
    names = {p.name for p in paths}
    assert {"results.json", "results.md", "speedup_per_suite.png", "accept_hist.png",
            "time_split.png", "block_sweep.png"} <= names
    for p in paths:
        assert p.stat().st_size > 0
    assert (tmp_path / "speedup_per_suite.png").read_bytes()[:4] == b"\x89PNG"
    md = (tmp_path / "results.md").read_text()
    assert "## Block-size sweep" in md and "| **all** | 3 |" in md
