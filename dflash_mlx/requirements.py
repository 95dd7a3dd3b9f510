"""The oldest MLX and mlx-lm this package runs on, checked at import.

An environment can hold an older MLX or mlx-lm than `pyproject.toml` asks for (installed with
`--no-deps`, pinned by another package, downgraded later). The library would then fail deep inside
an import (mlx-lm 0.28-0.31: `TextStateMachine`, `new_thread_local_stream`); importing it says in one
line what to upgrade instead. The bounds are the oldest versions the whole test suite passes on
(`benchmarks/results/20261205-oldest-versions/`: what failed on older ones; mlx-lm 0.32.0
lacks model types the suite's tables name).
"""

import sys
from importlib import metadata
from typing import Callable, Optional

from packaging.version import InvalidVersion, Version

MINIMUM = {"mlx": "0.32.4", "mlx-lm": "0.32.2"}
# MLX's CUDA builds on Linux: each distribution, and the extra of `mlx` that installs it
CUDA_BUILDS = {"mlx-cuda-13": "cuda13", "mlx-cuda-12": "cuda12", "mlx-cuda": "cuda"}


def installed(name: str) -> Optional[str]:
    """The installed distribution's version, or None (a build from source may have no metadata)."""
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def cuda_build(version_of: Callable[[str], Optional[str]] = installed) -> Optional[str]:
    """The installed MLX CUDA build's distribution name (`CUDA_BUILDS`), or None. Read from package
    metadata: `mlx.core` must not be imported before the BLAS routing (`blas`)."""
    return next((name for name in CUDA_BUILDS if version_of(name)), None)


def requirement(name: str, least: str, version_of: Callable[[str], Optional[str]], platform: str) -> str:
    """What to ask pip for: on Linux, MLX with the backend build this environment holds (the build is
    a package of its own, pinned to MLX's version)."""
    if name == "mlx" and platform.startswith("linux"):
        build = cuda_build(version_of)
        return f"'mlx[{CUDA_BUILDS[build] if build else 'cpu'}]>={least}'"
    return f"'{name}>={least}'"


def check(version_of: Callable[[str], Optional[str]] = installed, platform: str = sys.platform):
    """Raise ImportError naming each package older than `MINIMUM` and the command that upgrades it."""
    old = []
    for name, least in MINIMUM.items():
        found = version_of(name)
        try:
            if found is not None and Version(found) < Version(least):
                old.append((name, least, found))
        except InvalidVersion:
            continue
    if old:
        names = ", ".join(f"{n} >= {least} (found {found})" for n, least, found in old)
        upgrade = " ".join(requirement(n, least, version_of, platform) for n, least, _ in old)
        raise ImportError(f"dflash-mlx needs {names}: pip install -U {upgrade}")
