"""The prepared GPU check (benchmarks/gpu/check.py) at smoke scale on this machine's backend:
every part but the packaged-model one runs, writes its results, README and plots, and
deterministic mode's rows show no divergence from mlx-lm's greedy decode."""

import json
import sys
from pathlib import Path

GPU = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu"


def test_gpu_check_runs_at_smoke_scale(tmp_path):
    sys.path.insert(0, str(GPU))
    try:
        import check

        check.main(["--smoke", "--out", str(tmp_path), "--parts", "kernels,ops,host,batch,exactness,kvcache,shapes"])
    finally:
        sys.path.remove(str(GPU))
    results = json.loads((tmp_path / "results.json").read_text())
    parts = results["parts"]
    assert not [name for name, part in parts.items() if "error" in part], parts
    assert set(parts["ops"]) >= {"linear bfloat16", "linear 4-bit", "attention bfloat16"}
    if "skipped" not in parts["kernels"]:  # (the CPU harness needs g++) qmv_rows' rows are each row alone's
        assert parts["kernels"]["rows"] and all(r["kernel_invariant"] == r["M"] for r in parts["kernels"]["rows"])
    rows = parts["exactness"]["rows"]
    assert {r["deterministic"] for r in rows} == {True, False}
    assert all(r["diverged"] == 0 for r in rows if r["deterministic"])
    kv = parts["kvcache"]["rows"]  # (a width probed for each of 8 and 4 bits; every answer mlx-lm's)
    assert all(1 <= r["row_invariant_width"] <= 16 for r in kv if "row_invariant_width" in r)
    assert {r["setting"] for r in kv if "tokens" in r} == {"kv_bits 8", "max_kv_size 8"}
    assert all(r["diverged_at"] is None for r in kv if "tokens" in r) and len(kv) == 6
    for label, shape in parts["shapes"].items():
        assert shape["verify_ms"] and all(r["measured_tau"] >= 0.75 * r["tau"] for r in shape["speedups"]), label
        # mlx-lm's tokens with the graph queued a layer at a time, whole and every 4 layers
        assert all(r["exact"] and r["speedup_whole_graph"] > 0 for r in shape["speedups"]), label
    assert all(r["identical"] and r["ms a step"]["ahead"] > 0 for r in parts["batch"]["rows"])
    assert parts["host"]["cycles"] and parts["host"]["engine_plain_step_read_first_ms"] > 0
    assert all(c["cycle_ms_whole_graph"] > 0 for c in parts["host"]["cycles"].values())
    ceiling = parts["host"]["ceiling"]  # the forwards' own cost (json keys are strings)
    assert ceiling["ideal"]["1"] == 1.0 and all(c["efficiency"] > 0 for c in parts["host"]["cycles"].values())
    # one host sync and one read a step, as mlx-lm's: a cycle's outcome comes back as one array
    calls = parts["host"]["host_calls"]
    assert calls["mlx_lm_step"]["syncs"] == 1.0 and calls["1"]["syncs"] == 1.0 and calls["4"]["syncs"] == 1.0, calls
    # (the read evaluates the outcome itself: no `eval` before it, as mlx-lm's `item`)
    assert all(calls[w]["eval"] == 0.0 and calls[w]["item"] + calls[w]["tolist"] == 1.0 for w in ("1", "4")), calls
    readme = (tmp_path / "README.md").read_text()
    assert "(a) Divergence" in readme and "CUDA kernels" in readme and "(d) Host time" in readme and "cpu backend" in readme.lower()
    assert "syncs a step" in readme and "queued only after the last is read" in readme
    assert "ideal from the forwards' cost" in readme
    assert (tmp_path / "shapes.png").exists() and (tmp_path / "host.png").exists()
