"""`dflash-mlx doctor`: what this machine will run with."""

import json
import os
import platform
import sys
from typing import Optional


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    if sys.platform == "darwin":
        import subprocess

        try:
            return subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"],
                                  capture_output=True, text=True).stdout.strip()
        except OSError:
            pass
    return platform.processor() or platform.machine()


def _gpu_name(mx, backend: str):
    try:
        if backend == "metal":
            return mx.metal.device_info().get("device_name")
        if backend != "cpu":
            return mx.device_info().get("device_name")
    except Exception:  # device_info differs between MLX versions and backends
        pass
    return None


def machine() -> dict:
    """What this process computes on: Python, MLX and mlx-lm versions, backend, BLAS, CPU/GPU.

    The one description of the machine (`doctor` prints it, benchmark results embed it).
    """
    from dflash_mlx import blas  # importing dflash_mlx already ran blas.enable()

    import mlx.core as mx
    import mlx_lm

    device = mx.default_device()
    if device.type == mx.DeviceType.gpu:
        backend = ("metal" if mx.metal.is_available()
                   else "cuda" if hasattr(mx, "cuda") and mx.cuda.is_available() else "gpu")
    else:
        backend = "cpu"
    state = blas.active_blas()
    return {
        "python": platform.python_version(),
        "platform": f"{platform.system()} {platform.machine()}",
        "mlx": mx.__version__,
        "mlx_lm": mlx_lm.__version__,
        "backend": backend,
        "device": str(device),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "gpu": _gpu_name(mx, backend),
        "blas": str(state),
        "blas_fast": state.name != "reference",
    }


def machine_line(m: Optional[dict] = None) -> str:
    """`machine()` as one line for a results README."""
    m = m or machine()
    gpu = f", {m['gpu']}" if m.get("gpu") else ""
    return (f"{m['cpu']} ({m['cpu_count']} cores{gpu}), {m['platform']}, Python {m['python']}, MLX {m['mlx']} "
            f"({m['backend']} backend), mlx-lm {m['mlx_lm']}, BLAS {m['blas']}")


def load_line(start, end) -> str:
    """Load averages at a run's start and end, for a results README (shared machines)."""
    fmt = lambda la: ", ".join(f"{x:.2f}" for x in la)  # noqa: E731
    return f"Load average (1, 5, 15 min) at start {fmt(start)}, at end {fmt(end)}."


def results_footer(load_start, load_end) -> list:
    """The closing lines of a results README: the machine, and its load at the run's ends."""
    return [f"Machine: {machine_line()}", "", load_line(load_start, load_end) + " The machine may have been "
            "shared with other jobs.", ""]


def report() -> dict:
    """`machine()` plus the default dtype and where each packaged model and draft is."""
    from dflash_mlx.kernels import selection
    from dflash_mlx.models.loading import DTYPE_ENV, default_dtype
    from dflash_mlx.models.packaged import PACKAGED, packaged_draft_dir, packaged_status

    models = {}
    for name, entry in PACKAGED.items():
        draft = packaged_draft_dir(name)
        models[name] = {
            "description": entry.description,
            "model": packaged_status(name),
            "draft": str(draft) if draft else "none shipped yet (copies of the context alone; --draft adds one)",
        }
    return {
        **machine(),
        "default_dtype": str(default_dtype()).replace("mlx.core.", ""),
        "dtype_override": f"set {DTYPE_ENV}=float32|float16|bfloat16 or pass --dtype",
        "kernels": selection.summary(),
        "packaged": models,
        "policies": _policies(),
    }


def _policies() -> str:
    """Where the front ends keep what `auto` learned per model/draft pair (`policy.memory`)."""
    from dflash_mlx.policy import memory

    where = memory.folder()
    if where is None:
        return f"not kept ({memory.ENV_VAR}=0)"
    kept = len(list(where.glob("*.pkl"))) if where.is_dir() else 0
    return f"{where} ({kept} model/draft pair{'s' if kept != 1 else ''} kept; {memory.ENV_VAR}=0 turns it off)"


def main(argv=None) -> int:
    from dflash_mlx.cli.common import ArgumentParser

    p = ArgumentParser(prog="dflash-mlx doctor", description="report MLX backend, BLAS, packaged models, default dtype")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    r = report()
    if args.json:
        print(json.dumps(r, indent=2))
        return 0
    width = 20
    for key in ("python", "platform", "mlx", "mlx_lm", "backend", "device", "cpu", "gpu", "blas",
                "default_dtype", "kernels"):
        if r[key] is not None:
            print(f"{key:<{width}} {r[key]}")
    if not r["blas_fast"] and r["backend"] == "cpu":
        print(f"{'':<{width}} (reference BLAS: CPU matmuls 10-30x slower; pip install cmeel-openblas)")
    print(f"{'dtype':<{width}} {r['dtype_override']}")
    for name, info in r["packaged"].items():
        print(f"{'model ' + name:<{width}} {info['description']}: {info['model']}")
        print(f"{'':<{width}} draft: {info['draft']}")
    print(f"{'policies':<{width}} {r['policies']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
