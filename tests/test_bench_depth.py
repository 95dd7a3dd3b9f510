"""The depth suite on a tiny random target: exact prompt lengths, identical tokens, summaries."""

import pytest

from dflash_mlx.bench import depth, depth_report, depth_summary
from dflash_mlx.bench.documents import EVAL_DOCUMENTS, TRAIN_DOCUMENTS, read_documents
from dflash_mlx.models.draft.checkpoints import random_draft
from dflash_mlx.testing.targets import tiny_target

docs, missing = read_documents(EVAL_DOCUMENTS)
needs_docs = pytest.mark.skipif(len(docs) < 2, reason=f"evaluation documents not on this machine: {missing}")


def test_evaluation_and_training_documents_are_disjoint():
    ev = {p for spec in EVAL_DOCUMENTS for p in spec.parts}
    tr = {p for spec in TRAIN_DOCUMENTS for p in spec.parts}
    assert not ev & tr
    assert not {s.name for s in EVAL_DOCUMENTS} & {s.name for s in TRAIN_DOCUMENTS}


def test_depths_resolve_to_the_window_less_the_answer():
    assert depth.resolve_depths([256, 0], 8192, 32) == [256, 8192 - 32 - 8]
    with pytest.raises(ValueError, match="leaves no room"):
        depth.resolve_depths([8190], 8192, 32)
    assert depth.settled_width([4, 4, 2, 2, 2, 8]) == 2
    assert depth_summary.geomean([1.0, 4.0]) == pytest.approx(2.0)


@needs_docs
def test_depth_run_is_lossless_and_summarised(tmp_path):
    model, tok = tiny_target("qwen3", seed=3)
    draft = random_draft(model, block_size=4)
    other = random_draft(model, block_size=4, seed=1)
    cfg = depth.DepthConfig(depths=[110], documents=2, max_tokens=6, widths=[2, 3], warmup=False,
                            model="tiny", draft="random")
    doc = depth.run(model, draft, tok, cfg, others={"other": other})
    assert [r["prompt_tokens"] for r in doc["records"]] == [110, 110]
    assert depth_summary.mismatches(doc) == 0
    s = doc["summary"]["110"]
    assert s["documents"] == 2 and s["speedup"] > 0 and s["tau"] >= 1.0
    assert set(s["fixed_speedup"]) == {"2", "3"} and s["best_fixed_width"] in (2, 3)
    assert s["others"]["other"]["tau"] >= 1.0
    paths = depth_report.write_all(doc, tmp_path, with_plot=False)  # the plot costs matplotlib's import
    text = (tmp_path / "README.md").read_text()
    assert "| 110 | 2 |" in text and "other" in text and len(paths) == 2


def test_cli_depth_suite_runs_alone():
    from dflash_mlx.bench import cli
    from dflash_mlx.cli.common import CLIError

    with pytest.raises(CLIError, match="runs alone"):
        cli.main(["--suite", "depth,gsm8k"])
    with pytest.raises(CLIError, match="whole numbers"):
        cli.main(["--suite", "depth", "--depths", "256,x"])


@needs_docs
def test_runs_of_different_depths_merge_into_one_result(tmp_path):
    model, tok = tiny_target("qwen3", seed=3)
    draft = random_draft(model, block_size=4)
    runs = [depth.run(model, draft, tok, depth.DepthConfig(depths=[d], documents=2, max_tokens=5, widths=[2],
                                                            warmup=False, model="tiny", draft="random"))
            for d in (120, 90)]
    merged = depth_summary.merge(runs)
    assert [r["depth"] for r in merged["records"]] == [90, 90, 120, 120]
    assert set(merged["summary"]) == {"90", "120"}
    assert merged["summary"]["120"] == runs[0]["summary"]["120"]
    depth_report.write_all(merged, tmp_path, with_plot=False)
    assert "| 90 |" in (tmp_path / "README.md").read_text()
    with pytest.raises(ValueError, match="measured twice"):
        depth_summary.merge([runs[0], runs[0]])
    other = dict(runs[1], config=dict(runs[1]["config"], max_tokens=9))
    with pytest.raises(ValueError, match="max_tokens"):
        depth_summary.merge([runs[0], other])


@needs_docs
def test_repeats_decode_every_setting_again_and_keep_the_median(tmp_path):
    import statistics

    model, tok = tiny_target("qwen3", seed=3)
    draft = random_draft(model, block_size=4)
    other = random_draft(model, block_size=4, seed=1)
    cfg = depth.DepthConfig(depths=[100], documents=2, max_tokens=5, widths=[2], warmup=False, repeats=3,
                            model="tiny", draft="random")
    doc = depth.run(model, draft, tok, cfg, others={"other": other})
    assert depth_summary.mismatches(doc) == 0
    for rec in doc["records"]:
        assert set(rec["runs"]) == {"plain", "auto", "auto other", "block 2"}
        for run in rec["runs"].values():
            assert len(run["decode_tps_runs"]) == 3 and len(run["decode_tps_cpu_runs"]) == 3
            assert run["decode_tps"] == statistics.median(run["decode_tps_runs"])
    assert "median of 3 runs" in depth_report.markdown(doc)
    once = dict(doc, config=dict(doc["config"], repeats=1))
    with pytest.raises(ValueError, match="repeats"):
        depth_summary.merge([doc, once])
