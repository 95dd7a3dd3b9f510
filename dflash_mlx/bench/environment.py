"""What a benchmark result records about where it ran: the machine (`doctor.machine()`
under the result schema's names), the model's dtype, BLAS threads and the load average."""

import os
import platform
from datetime import datetime, timezone
from typing import Optional

def loadavg() -> Optional[float]:
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


def _model_dtype(model) -> str:
    from mlx.utils import tree_flatten

    for _, v in tree_flatten(model.parameters()):
        return str(v.dtype).replace("mlx.core.", "")
    return "?"


def environment(model=None) -> dict:
    """`doctor.machine()` under the result schema's names, plus what explains timings."""
    from dflash_mlx.cli.doctor import machine

    m = machine()
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "mlx_version": m["mlx"],
        "mlx_lm_version": m["mlx_lm"],
        "backend": m["backend"],
        "device": m["device"],
        "platform": platform.platform(),
        "python": m["python"],
        "cpu": m["cpu"],
        "cpu_count": m["cpu_count"],
        "gpu": m["gpu"],
        "blas": m["blas"],
        "dtype": _model_dtype(model) if model is not None else None,
        # BLAS threads and machine load explain most run-to-run spread on shared
        # CPUs (OpenBLAS with more threads than free cores thrashes).
        "thread_env": {k: os.environ.get(k) for k in
                       ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")},
        "loadavg": loadavg(),
    }
