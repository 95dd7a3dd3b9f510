"""BLAS routing: numerics unchanged, the fast route active when installed, clean fallbacks.

Each case runs in a fresh interpreter: routing happens once, before mlx.core loads.
"""

import importlib.metadata
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dflash_mlx import blas

REPO = Path(__file__).resolve().parents[1]

_PROBE = textwrap.dedent(
    """
    import json, sys, time
    import dflash_mlx
    from dflash_mlx.blas import active_blas
    import mlx.core as mx
    import numpy as np

    rng = np.random.default_rng(0)
    a = rng.standard_normal((300, 500)).astype(np.float32)
    b = rng.standard_normal((500, 200)).astype(np.float32)
    got = np.array(mx.array(a) @ mx.array(b))
    ref = a.astype(np.float64) @ b.astype(np.float64)
    err = float(np.abs(got - ref).max() / np.abs(ref).max())
    x = mx.random.normal((384, 384))
    mx.eval(x @ x)
    start = time.perf_counter()
    for _ in range(5):
        mx.eval(x @ x)
    ms = (time.perf_counter() - start) / 5 * 1000
    s = active_blas()
    print(json.dumps({"name": s.name, "detail": s.detail, "err": err, "ms": ms,
                      "same": active_blas() is dflash_mlx.blas.enable()}))
    """
)


def probe(**env):
    full = dict(os.environ, **env)
    full["PYTHONPATH"] = os.pathsep.join([str(REPO), full.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                       env=full, timeout=300, cwd=str(REPO))
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1]), r.stderr


def _has_cmeel_openblas():
    try:
        importlib.metadata.version("cmeel-openblas")
        return sys.platform == "linux"
    except importlib.metadata.PackageNotFoundError:
        return False


def test_reference_opt_out_keeps_numerics():
    out, err = probe(DFLASH_MLX_BLAS="reference")
    assert out["name"] == "reference"
    assert out["err"] < 1e-5
    assert out["same"]  # enable() is idempotent
    assert "fast BLAS unavailable" not in err  # opting out is silent


@pytest.mark.skipif(not _has_cmeel_openblas(), reason="cmeel-openblas not installed")
def test_openblas_active_same_numerics_and_faster():
    fast, err = probe()
    if "AVX-512" in fast["detail"]:  # an AVX-512-only build on a CPU without it: refused, not run
        assert fast["name"] == "reference" and "avx512f" not in blas._cpu_flags()
        assert "which this CPU lacks" in err
        pytest.skip("this OpenBLAS build needs AVX-512, which this CPU lacks: reference BLAS in use")
    assert fast["name"] == "openblas", fast
    assert "OpenBLAS" in fast["detail"]
    assert fast["err"] < 1e-5
    ref, _ = probe(DFLASH_MLX_BLAS="reference")
    # measured ~50x on a 384^3 product; 3x leaves room for a busy machine
    assert fast["ms"] * 3 < ref["ms"], (fast["ms"], ref["ms"])


def test_bad_library_falls_back_with_one_line_notice(tmp_path):
    out, err = probe(DFLASH_MLX_BLAS=str(tmp_path / "libnothing.so"))
    assert out["name"] == "reference"
    assert out["err"] < 1e-5
    notices = [line for line in err.splitlines() if "fast BLAS unavailable" in line]
    assert len(notices) == 1 and "DFLASH_MLX_BLAS=reference" in notices[0]


def test_set_soname_on_elf(tmp_path):
    libs = blas._mlx_bundled_libs()
    if libs is None:
        pytest.skip("no mlx_cpu.libs (not the Linux mlx[cpu] wheel)")
    src = next(Path(libs).glob("libgfortran-*.so*"))
    data = bytearray(src.read_bytes())
    assert blas.read_soname(data) == src.name
    blas.set_soname(data, "libgfortran.so.5")
    assert blas.read_soname(data) == "libgfortran.so.5"
    assert len(data) == src.stat().st_size
    with pytest.raises(ValueError, match="longer"):
        blas.set_soname(data, "libgfortran.so.5" + "x" * 64)
    with pytest.raises(ValueError, match="ELF"):
        blas.read_soname(bytearray(b"not an elf file at all" * 4))


def test_default_threads_leave_a_core_for_mlx(monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert blas.default_threads() == 1
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    assert blas.default_threads() == 4


def test_patched_copy_falls_back_to_temp_when_cache_unwritable(tmp_path, monkeypatch):
    libs = blas._mlx_bundled_libs()
    if libs is None:
        pytest.skip("no mlx_cpu.libs (not the Linux mlx[cpu] wheel)")
    src = next(Path(libs).glob("libgfortran-*.so*"))
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the cache folder should be")
    monkeypatch.setattr(blas, "_cache_dir", lambda: blocked / "sub")
    monkeypatch.setattr(blas.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    dst = blas._patched_copy(str(src), "libgfortran.so.5")
    assert dst.is_relative_to(tmp_path / "tmp")
    assert blas.read_soname(dst.read_bytes()) == "libgfortran.so.5"


def test_avx512_only_build_refused_without_avx512(monkeypatch):
    monkeypatch.setattr(blas, "_cpu_flags", lambda: {"avx", "avx2"})
    assert "AVX-512" in blas._unsupported_core("OpenBLAS 0.3.31 NO_AFFINITY SKYLAKEX MAX_THREADS=4")
    assert blas._unsupported_core("OpenBLAS 0.3.31 DYNAMIC_ARCH NO_AFFINITY Haswell") is None
    assert blas._unsupported_core("OpenBLAS 0.3.31 NO_AFFINITY HASWELL") is None
    monkeypatch.setattr(blas, "_cpu_flags", lambda: {"avx2", "avx512f"})
    assert blas._unsupported_core("OpenBLAS 0.3.31 NO_AFFINITY SKYLAKEX MAX_THREADS=4") is None
