"""A target split over the processes of `mlx.launch` (tensor or pipeline parallel, as mlx-lm does).

`split` splits a model in memory: tensor parallel (`Model.shard`) where the model has it,
pipeline parallel (`model.model.pipeline`) where it has only that, or the one asked for.
`load_split` loads an mlx-lm folder straight into its split (`mlx_lm.utils.sharded_load`:
each rank reads only its own weights). Drafts are small: every rank loads the whole draft.
The target adapter reads the split from the model (`models.target.sharding`).
"""

from pathlib import Path
from typing import Optional, Tuple

MODES = ("tensor", "pipeline", "auto")


class ShardingError(ValueError):
    pass


def world():
    """The group of every process `mlx.launch` started (size 1 when run alone)."""
    import mlx.core as mx

    return mx.distributed.init()


def modes_of(model) -> Tuple[bool, bool]:
    """(takes tensor parallelism, takes pipeline parallelism) for an mlx-lm model."""
    inner = model.get("model") if "model" in model else None
    if inner is None and "language_model" in model:
        inner = model.language_model.get("model")
    return hasattr(model, "shard"), inner is not None and hasattr(inner, "pipeline")


def choose_mode(model, mode: str) -> str:
    """The parallelism `mode` ("tensor" | "pipeline" | "auto") means for `model`; auto: tensor
    where the model has `shard` (each rank works on every token), else pipeline."""
    if mode not in MODES:
        raise ShardingError(f"unknown distributed mode {mode!r}; choose one of {', '.join(MODES)}")
    tensor, pipeline = modes_of(model)
    name = type(model).__module__.rsplit(".", 1)[-1]
    if mode == "auto":
        if not (tensor or pipeline):
            raise ShardingError(f"{name}: mlx-lm cannot split this model (no shard or pipeline); "
                                "run it in one process")
        return "tensor" if tensor else "pipeline"
    if mode == "tensor" and not tensor:
        raise ShardingError(f"{name}: mlx-lm has no tensor parallelism for this model"
                            + ("; use --distributed pipeline" if pipeline else "; run it in one process"))
    if mode == "pipeline" and not pipeline:
        raise ShardingError(f"{name}: mlx-lm has no pipeline parallelism for this model"
                            + ("; use --distributed tensor" if tensor else "; run it in one process"))
    return mode


def _launched(group):
    group = group or world()
    if group.size() < 2:
        raise ShardingError("distributed decoding needs two or more processes: start it with mlx.launch "
                            "(e.g. mlx.launch -n 2 --backend ring ...)")
    return group


def _pipeline_holder(model):
    return model.language_model.model if "language_model" in model and "model" not in model else model.model


def _every_rank_holds_a_layer(model, group) -> None:
    """Refuses a pipeline split that would leave a rank without a decoder layer. mlx-lm's own
    split (`PipelineMixin`) refuses it; the models that split themselves (Kimi K3) let it through,
    and then a prompt's hop to the empty rank is never read there (its caches hold nothing to
    evaluate), so every later message between the ranks is read out of step."""
    layers = len(_pipeline_holder(model).layers)
    if layers < group.size():
        raise ShardingError(f"no pipeline split over {group.size()} processes: a process would hold none of its "
                            f"{layers} decoder layer{'s' * (layers != 1)} (mlx-lm's own decode of that split reads "
                            "the ranks' messages out of step); use fewer processes or --distributed tensor")


def split(model, mode: str = "auto", group=None) -> str:
    """Split the in-memory `model` over `group` (default: every launched process) in place;
    returns the parallelism used. Refuses a group of one process (nothing to split)."""
    import mlx.core as mx

    group = _launched(group)
    mode = choose_mode(model, mode)
    if mode == "pipeline":
        _every_rank_holds_a_layer(model, group)
    heads = _head_counts(model) if mode == "tensor" else None
    try:
        if mode == "tensor":
            model.shard(group)
        else:
            _pipeline_holder(model).pipeline(group)
    except (AssertionError, ValueError, ZeroDivisionError) as e:  # heads or layers that do not divide
        raise _cannot_split(mode, group, e) from None
    if mode == "tensor":
        _every_rank_holds_heads(heads, _head_counts(model), group)
    mx.eval(model.parameters())
    return mode


def _cannot_split(mode: str, group, error: Exception) -> ShardingError:
    return ShardingError(f"mlx-lm cannot split this model {mode} parallel over {group.size()} processes"
                         f"{': ' + str(error) if str(error) else ''}; try another --distributed mode or process count")


def _head_counts(model) -> dict:
    """{(module path, name): count} of every module's head counts (`n_kv_heads`, `num_attention_heads`,
    `num_v_heads`, ...), as mlx-lm's `shard` methods divide them over the ranks."""
    return {(path, name): value for path, module in model.named_modules() for name, value in vars(module).items()
            if name.endswith("heads") and name.startswith(("n_", "num_")) and type(value) is int}


def _every_rank_holds_heads(before: dict, after: dict, group) -> None:
    """Refuses a tensor split that leaves a rank no head of some kind: mlx-lm's `shard` divides the
    count by the ranks, to 0 where they outnumber it, and the first forward then fails in a reshape."""
    for key, count in after.items():
        if count == 0 and before.get(key, 0) > 0:
            raise ShardingError(f"no tensor split over {group.size()} processes: {key[1]} is {before[key]}, so a "
                                "process would hold none of those heads; use fewer processes or --distributed pipeline")


def load_split(path: Path, mode: str = "auto", group=None, source: Optional[str] = None):
    """(model, tokenizer, mode) of the mlx-lm folder `path` (or of hub repo `source`, whose config
    is in `path`), each rank reading (and fetching) only its part."""
    import mlx.core as mx
    from mlx_lm.utils import load_model, sharded_load

    group = _launched(group)
    model, _ = load_model(path, lazy=True, strict=False)
    mode = choose_mode(model, mode)
    if mode == "pipeline":
        _every_rank_holds_a_layer(model, group)
    heads = _head_counts(model) if mode == "tensor" else None
    del model
    try:
        model, tokenizer = sharded_load(source or str(path), pipeline_group=group if mode == "pipeline" else None,
                                        tensor_group=group if mode == "tensor" else None)
    except ZeroDivisionError as e:  # (a head count over more ranks, in some models' `shard`)
        raise _cannot_split(mode, group, e) from None
    if mode == "tensor":
        _every_rank_holds_heads(heads, _head_counts(model), group)
    mx.eval(mx.distributed.all_sum(mx.array(1.0), group=group, stream=mx.cpu))
    return model, tokenizer, mode


def is_rank0(group=None) -> bool:
    """Whether this process speaks for the group (reads input, writes output)."""
    return (group or world()).rank() == 0



def share(obj, group=None):
    """Rank 0's `obj` on every rank (`obj` elsewhere is ignored), as mlx-lm's server shares its
    requests: one all-sum of its pickled size, then one of its bytes, summed with zeros from the
    other ranks. None on rank 0 costs the first alone and is None everywhere; rank 0 keeps its
    own `obj`."""
    import pickle

    import mlx.core as mx

    from dflash_mlx.models.target.sharding import bytes_from, settle

    group = group or world()
    if group.size() < 2:
        return obj
    settle()  # a split forward still running on the generation stream shares the ranks' connections
    speaks = group.rank() == 0
    data = pickle.dumps(obj) if speaks and obj is not None else b""
    size = mx.distributed.all_sum(mx.array([len(data)]), group=group, stream=mx.cpu).item()
    if size == 0:
        return None
    out = bytes_from(group, 0, data, size)  # evaluated on every rank
    return obj if speaks else pickle.loads(out)
