"""What `auto` learned about a target/draft pair, kept on disk between processes.

`auto`'s policies learn as they go: the draft's acceptance at each depth, each verify
width's cycle time per range of context lengths, what copies and trees commit, whether a
guess pays (`sizer_for`, and what rides on it; `lookahead_for`). A process keeps them for
its life, so a chat or a server pays for the exploration once; but a one-shot command is a
process per prompt, and each run paid for it again (about a tenth of a 128-token answer of
SmolLM2 with its draft on a 2-core CPU, 2026-12-06). The CLI and the chat app `restore` a
pair's policies before its first answer in a process and `save` them after each one; the
server restores them before its engine starts and saves them when it stops.

One file per pair and machine under `$XDG_CACHE_HOME/dflash_mlx/policies/` (`user_cache`) (or
`DFLASH_MLX_POLICY_CACHE`, a folder; `0` turns it off), named by a hash of what the
measurements depend on (`pair_key`): the target's and the draft's parameters (names, shapes,
dtypes, a few values), the device, MLX's version and the policy code itself, so another
model, machine or version of this code starts over. Written to a temporary file and renamed
(two processes at once: the last one's stands); a file that cannot be read is ignored and
replaced by the next save. It holds numbers only, and is read back by an unpickler that
builds nothing but this package's policy classes. Which width runs never changes a greedy
token, only the speed.
"""

import hashlib
import io
import os
import pickle
import tempfile
from functools import lru_cache
from pathlib import Path
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from dflash_mlx.policy import lookahead, sizer
from dflash_mlx.user_cache import user_cache

ENV_VAR = "DFLASH_MLX_POLICY_CACHE"
FORMAT = 1

# The modules whose classes a saved file may build (a policy's attributes are numbers, lists,
# dicts and these classes' objects, nothing else).
_ALLOWED_MODULES = ("dflash_mlx.policy.", "dflash_mlx.speculation.copies", "dflash_mlx.speculation.copy_tree")
_CODE = ("policy", "speculation/copies.py", "speculation/copy_tree.py")


def folder() -> Optional[Path]:
    """Where the files go, or None when `DFLASH_MLX_POLICY_CACHE=0`."""
    choice = os.environ.get(ENV_VAR, "").strip()
    if choice == "0":
        return None
    if choice:
        return Path(choice).expanduser()
    return user_cache("policies")


@lru_cache(maxsize=1)
def _code_hash() -> str:
    """The policy code's own hash: a change to how it learns makes old files another pair's."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for entry in _CODE:
        for path in sorted((root / entry).rglob("*.py")) if (root / entry).is_dir() else [root / entry]:
            h.update(path.name.encode() + path.read_bytes())
    return h.hexdigest()


def _fingerprint(module, h) -> None:
    """What sets `module` apart from another: its parameters' names, shapes and dtypes, and the first
    values of the first and last ones (two models of one shape differ there)."""
    params = tree_flatten(module.parameters())
    for name, value in params:
        h.update(f"{name}{tuple(value.shape)}{value.dtype};".encode())
    for _, value in (params[0], params[-1]) if params else ():
        h.update(np.array(value.reshape(-1)[:16].astype(mx.float32)).tobytes())


def pair_key(model, draft) -> Optional[str]:
    """The file name of `model`'s and `draft`'s policies on this machine (`draft` None: none); None for
    a model or draft that is not an MLX module (a test double), which is not kept."""
    if not all(isinstance(m, nn.Module) for m in (model, draft) if m is not None):
        return None
    info = mx.device_info()  # the CPU's or the GPU's name and architecture
    h = hashlib.sha256(f"{FORMAT};{mx.__version__};{mx.default_device()};".encode())
    h.update(f"{info.get('device_name', '')};{info.get('architecture', '')};".encode())
    h.update(_code_hash().encode())
    _fingerprint(model, h)
    if draft is not None:
        h.update(b"draft;")
        _fingerprint(draft, h)
    return h.hexdigest()[:32]


class _PolicyUnpickler(pickle.Unpickler):
    """Builds this package's policy classes and nothing else (no function, no other module)."""

    def find_class(self, module, name):
        if module.startswith(_ALLOWED_MODULES) and not name.startswith("_"):
            cls = super().find_class(module, name)
            if isinstance(cls, type) and cls.__module__ == module:  # defined there, not imported there
                return cls
        raise pickle.UnpicklingError(f"{module}.{name} is not a policy class")


def restore(model, draft) -> bool:
    """Load the pair's saved policies into this process, unless it has learned its own already.
    True when a file was found and read."""
    where = folder()
    key = pair_key(model, draft) if where is not None and not sizer.has_sizer(model, draft) else None
    if key is None:
        return False
    path = where / f"{key}.pkl"
    try:
        saved = _PolicyUnpickler(io.BytesIO(path.read_bytes())).load()
        width_policy, guess_policy = saved
        if not (isinstance(width_policy, sizer.BlockSizer) and isinstance(guess_policy, lookahead.LookAhead)):
            return False
    except Exception:  # a cache: a file that cannot be read whole is as good as none (the next save replaces it)
        return False
    expected = draft.block_size if draft is not None else 1
    if width_policy.max_block != expected:
        return False
    if not sizer.adopt_sizer(model, draft, width_policy):
        return False
    lookahead.adopt_lookahead(model, draft, guess_policy)  # (none learned yet either: no sizer was)
    return True


def save(model, draft) -> bool:
    """Write what this process's policies for the pair learned. False where nothing could be written."""
    where = folder()
    key = pair_key(model, draft) if where is not None and sizer.has_sizer(model, draft) else None
    if key is None:
        return False
    try:
        data = pickle.dumps((sizer.sizer_for(model, draft), lookahead.lookahead_for(model, draft)))
    except (pickle.PicklingError, TypeError, AttributeError):  # a policy holding what cannot be kept
        return False
    try:
        where.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=where, suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, where / f"{key}.pkl")
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError:
        return False
    return True
