"""Where dflash-mlx keeps files between runs: `$XDG_CACHE_HOME/dflash_mlx/` (else `~/.cache/dflash_mlx/`)."""

import os
from pathlib import Path


def user_cache(*names: str) -> Path:
    """`names` under this user's dflash-mlx cache folder (nothing is created)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
    return Path(base, "dflash_mlx", *names)
