"""Load a target model + tokenizer from a packaged name, a folder, a .gguf or a hub id.

`resolve_source` is the one place that tells those apart (drafts use it too);
`hub_snapshot` the one place that downloads from the Hugging Face Hub.

dtype policy (`default_dtype`): GGUF weights are dequantized, and mlx-lm folders
are cast, to
* float32 on MLX's CPU backend: with a real BLAS f32 is the fast path there;
  bf16 and quantized matmuls run 2-10x slower on CPU (measured: README, "Measured here");
* bfloat16 on a GPU (Metal/CUDA): half the memory traffic of f32, and bf16's
  range avoids the fp16 overflows Gemma activations are known for.
Only floating-point parameters are cast: a quantized mlx-lm folder stays
quantized (its scales and biases take the dtype). Override with
`load(..., dtype=...)` or `DFLASH_MLX_DTYPE=float32|float16|bfloat16`;
`DFLASH_MLX_DTYPE=keep` keeps an mlx-lm folder's stored dtypes as they are.
"""

import os
import sys
from pathlib import Path
from typing import Optional, Tuple

from dflash_mlx.models import packaged

DTYPE_ENV = "DFLASH_MLX_DTYPE"
_DTYPES = ("float32", "float16", "bfloat16")


class ModelLoadError(Exception):
    """A model could not be loaded; the message says why and what to do."""


def _known_sources(what: str = "model"):
    if what == "draft":
        return (
            f"packaged names: {', '.join(packaged.packaged_names())}; or a draft folder "
            "(config.json + model.safetensors), or a hub id like 'z-lab/Qwen3-8B-DFlash-b16'"
        )
    return (
        f"packaged models: {', '.join(packaged.packaged_names())}; or a .gguf file, "
        "an mlx-lm model folder, or a Hugging Face repo id like 'mlx-community/SmolLM2-135M-Instruct'"
    )


def _dtype_from_name(name):
    import mlx.core as mx

    if name not in _DTYPES:
        raise ModelLoadError(f"unknown dtype {name!r}; choose one of {', '.join(_DTYPES)}")
    return getattr(mx, name)


def default_dtype():
    """The dtype weights are loaded in on this backend (see the module docstring)."""
    import mlx.core as mx

    env = os.environ.get(DTYPE_ENV, "").strip().lower()
    if env and env != "keep":
        return _dtype_from_name(env)
    if mx.default_device().type == mx.DeviceType.cpu:
        return mx.float32
    return mx.bfloat16


def resolve_dtype(dtype):
    import mlx.core as mx

    if dtype is None:
        return default_dtype()
    if isinstance(dtype, str):
        return _dtype_from_name(dtype)
    if isinstance(dtype, mx.Dtype):
        return dtype
    raise ModelLoadError(f"dtype must be an mlx dtype or one of {', '.join(_DTYPES)}")


def resolve_source(name: str, what: str = "model") -> Tuple[str, Optional[Path]]:
    """Which kind of source `name` is, without loading anything.

    `("packaged", None)`, `("path", path)` for an existing file or folder, or
    `("hub", None)` for an `owner/repo` id. Anything else is a ModelLoadError
    naming what was expected.
    """
    name = str(name).strip()
    if not name:
        raise ModelLoadError(f"no {what} given; {_known_sources(what)}")
    if packaged.is_packaged(name):
        return "packaged", None
    path = Path(name).expanduser()
    if path.exists():
        return "path", path
    if name.startswith((".", "/", "~")) or name.endswith(".gguf") or name.count("/") > 1:
        raise ModelLoadError(f"no such file or folder for the {what}: {path}")
    if name.count("/") != 1 or " " in name:
        raise ModelLoadError(f"unknown {what} {name!r}; {_known_sources(what)}")
    return "hub", None


def hub_snapshot(repo: str, allow_patterns, what: str = "model") -> Path:
    """The local folder of hub repo `repo` (downloaded unless cached); one-line errors."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        return Path(snapshot_download(repo, allow_patterns=allow_patterns))
    except LocalEntryNotFoundError:
        raise ModelLoadError(
            f"{what} {repo!r} is not in the local Hugging Face cache and the hub cannot be reached "
            "(offline?); download it on a connected machine, or use a local one"
        ) from None
    except (RepositoryNotFoundError, GatedRepoError, RevisionNotFoundError) as e:
        raise ModelLoadError(
            f"Hugging Face repo {repo!r} not found or not accessible ({type(e).__name__}); "
            f"check the {what} name"
        ) from None
    except Exception as e:  # network errors come in many types
        raise ModelLoadError(f"could not fetch {what} {repo!r} from the Hugging Face Hub: {e}") from None


def load(name_or_path, dtype=None, quiet: bool = False, distributed: Optional[str] = None,
         adapter_path: Optional[str] = None, trust_remote_code: bool = False):
    """`(model, tokenizer)`: packaged name | .gguf file | mlx-lm folder | hub id.

    `distributed` ("tensor" | "pipeline" | "auto", under `mlx.launch`): the model split over the
    launched processes (`models.sharded`); an mlx-lm folder or hub id is read by each rank in
    its part only, another source is loaded whole and then split.
    `adapter_path`: a folder of fine-tuned adapters from `mlx_lm.lora` (`adapter_config.json`,
    `adapters.safetensors`: LoRA, DoRA or full), applied as mlx-lm's `load(adapter_path=)` applies them.
    `trust_remote_code`: mlx-lm's, for an mlx-lm folder's or hub model's tokenizer."""
    name = str(name_or_path).strip()
    kind, path = resolve_source(name)
    dt = resolve_dtype(dtype)
    if adapter_path is not None and distributed is not None:
        raise ModelLoadError("adapters (--adapter-path) are not supported on a model split over processes: fuse "
                             "them into the model first (mlx_lm.fuse) and load the fused folder")
    if distributed is not None:
        model, tokenizer = _load_distributed(name, kind, path, dtype, dt, quiet, distributed)
    elif kind == "packaged":
        model, tokenizer = _load_packaged(name, dtype, dt, quiet)
    elif kind == "hub":
        model, tokenizer = _load_hub(name, dtype, dt, trust_remote_code)
    elif path.is_file():
        if not _is_gguf(path):
            raise ModelLoadError(
                f"{path} is not a GGUF file; give a .gguf file or an mlx-lm model folder"
            )
        model, tokenizer = _load_gguf(path, dt, quiet)
    else:
        model, tokenizer = _load_folder(path, dtype, dt, trust_remote_code)
    if adapter_path is not None:
        _apply_adapters(model, name, Path(adapter_path))
    model.name = name
    from dflash_mlx.models.layout import relayout_for_cpu

    relayout_for_cpu(model)  # the CPU's GEMM reads W.T faster when it is contiguous
    return model, tokenizer


def _apply_adapters(model, name: str, folder: Path):
    """mlx-lm's adapters from `folder` applied to `model` (its Linear layers become LoRA/DoRA layers, or its
    weights are replaced: `fine_tune_type` "full"); ModelLoadError naming what is missing or does not fit."""
    from mlx_lm.utils import load_adapters

    missing = [f for f in ("adapter_config.json", "adapters.safetensors") if not (folder / f).is_file()]
    if not folder.is_dir() or missing:
        what = "no such folder" if not folder.is_dir() else f"no {' or '.join(missing)} in it"
        raise ModelLoadError(f"adapters {str(folder)!r}: {what}; give the --adapter-path folder mlx_lm.lora wrote")
    try:
        load_adapters(model, str(folder))
    except Exception as e:  # keys or shapes of another model, a config mlx-lm cannot read
        line = " ".join(str(e).split())[:200]
        raise ModelLoadError(f"adapters {str(folder)!r} do not fit model {name!r} ({type(e).__name__}: {line}): "
                             "give the adapters trained for this model") from None
    model.eval()


def _load_distributed(name, kind, path, dtype, dt, quiet, mode):
    from dflash_mlx.models import sharded

    try:
        if kind == "hub" or (kind == "path" and path.is_dir() and (path / "config.json").is_file()):
            # from the hub: the config first (to choose the split), then each rank's own weights
            folder = hub_snapshot(name, ["*.json", "*.py", "*.txt", "*.jinja", "tokenizer.model", "*.tiktoken"]) \
                if kind == "hub" else path
            model, tokenizer, _ = sharded.load_split(folder, mode, source=name if kind == "hub" else None)
            return _cast(model, dtype, dt), tokenizer
        model, tokenizer = load(name, dtype, quiet)
        sharded.split(model, mode)
        return model, tokenizer
    except sharded.ShardingError as e:
        raise ModelLoadError(str(e)) from None


def _load_packaged(name: str, dtype, dt, quiet):
    """The packaged GGUF; without its package, the same model from the hub."""
    entry = packaged.PACKAGED[name]
    try:
        path = entry.locate()
    except packaged.PackagedModelError as e:
        if entry.hub_repo is None:
            raise ModelLoadError(str(e)) from None
        from mlx_lm.utils import DEFAULT_ALLOW_PATTERNS

        if not quiet:
            print(f"[dflash-mlx] {e}; loading {entry.hub_repo} from the Hugging Face Hub instead",
                  file=sys.stderr)
        try:
            folder = hub_snapshot(entry.hub_repo, DEFAULT_ALLOW_PATTERNS)
        except ModelLoadError as hub_error:
            raise ModelLoadError(
                f"{name}: package {entry.distribution!r} is not installed and its hub copy "
                f"{entry.hub_repo!r} could not be fetched ({hub_error}); install the package: "
                f"{entry.install}"
            ) from None
        return _load_folder(folder, dtype, dt)
    return _load_gguf(path, dt, quiet)


def _is_gguf(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def _load_gguf(path, dt, quiet):
    from dflash_mlx.models.gguf.loader import load_gguf
    from dflash_mlx.models.gguf.reader import GGUFError

    progress = (lambda done, total: None) if quiet else None
    try:
        model, tokenizer, _ = load_gguf(path, dtype=dt, progress=progress)
    except GGUFError as e:
        raise ModelLoadError(str(e)) from None
    except FileNotFoundError as e:
        raise ModelLoadError(str(e)) from None
    return model, tokenizer


def _cast(model, dtype, dt):
    """Cast float parameters unless the user said keep (quantized stays quantized)."""
    if dtype is None and os.environ.get(DTYPE_ENV, "").strip().lower() == "keep":
        return model
    import mlx.core as mx
    from mlx.utils import tree_flatten

    floats = [v for _, v in tree_flatten(model.parameters()) if mx.issubdtype(v.dtype, mx.floating)]
    if any(v.dtype != dt for v in floats):
        model.set_dtype(dt)
        mx.eval(model.parameters())
    return model


def _load_folder(path: Path, dtype, dt, trust_remote_code: bool = False):
    from mlx_lm import load as mlx_lm_load

    if not (path / "config.json").is_file():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return _load_gguf(ggufs[0], dt, quiet=False)
        raise ModelLoadError(
            f"{path} is not an mlx-lm model folder (no config.json)"
            + (f"; it holds several .gguf files, pick one: {', '.join(g.name for g in ggufs)}" if ggufs else "")
        )
    try:
        model, tokenizer = mlx_lm_load(str(path), trust_remote_code=trust_remote_code)
    except (ValueError, FileNotFoundError, KeyError) as e:
        raise ModelLoadError(f"could not load the mlx-lm folder {path}: {e}") from None
    return _cast(model, dtype, dt), tokenizer


def _load_hub(repo: str, dtype, dt, trust_remote_code: bool = False):
    from mlx_lm.utils import DEFAULT_ALLOW_PATTERNS

    return _load_folder(hub_snapshot(repo, DEFAULT_ALLOW_PATTERNS), dtype, dt, trust_remote_code)


def apply_chat_template(tokenizer, messages_or_prompt, system: Optional[str] = None, tools=None,
                        template_kwargs: Optional[dict] = None, prefill_response: Optional[str] = None) -> str:
    """The prompt string to generate from.

    With a chat template: the template applied to the messages (a plain string
    becomes one user message), ending with the assistant's turn. Without one
    (base models such as Gemma 3 270M): the text itself, after the system text.
    `tools` (OpenAI's form) go to the template, as mlx-lm's server passes them;
    `template_kwargs` too (mlx-lm's `--chat-template-config`, e.g. {"enable_thinking": False}).
    `prefill_response`: the start of the assistant's answer, which the model continues (mlx-lm's
    `--prefill-response`: the template's `continue_final_message`).
    """
    if isinstance(messages_or_prompt, str):
        messages = [{"role": "user", "content": messages_or_prompt}]
    else:
        messages = [dict(m) for m in messages_or_prompt]
    if system and not (messages and messages[0].get("role") == "system"):
        messages.insert(0, {"role": "system", "content": system})
    if getattr(tokenizer, "chat_template", None):
        extra = dict(template_kwargs or {}, **({"tools": tools} if tools else {}))
        if prefill_response is not None:
            messages.append({"role": "assistant", "content": prefill_response})
            return tokenizer.apply_chat_template(messages, tokenize=False, continue_final_message=True, **extra)
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **extra)
    return "\n\n".join(str(m.get("content", "")) for m in messages) + (prefill_response or "")
