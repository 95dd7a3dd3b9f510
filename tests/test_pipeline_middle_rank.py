"""The middle rank of a pipeline split over three processes, in one process: the other ranks'
messages are stood in for (a received hidden state is zeros, a send passes its input through, a
gather or sum repeats this rank's part). mlx-lm's multimodal wrappers make a cache for every
entry of the layer list up to the rank's last, the other ranks' too; their model then makes its hop
wait on the last cache, which on a middle rank is never filled, and raises there
(`mx.depends(None, h)`) while the other ranks wait for its message. The Target gives the model the
caches of its own layers (three real ranks: `benchmarks/split_variants.py --ranks 3`)."""

import pytest

import dflash_mlx  # noqa: F401  (before mlx.core: BLAS routing)
import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from dflash_mlx.models.sharded import split
from dflash_mlx.models.target.adapter import Target
from dflash_mlx.testing import variants


class MiddleRank:
    """Rank 1 of three."""

    def rank(self):
        return 1

    def size(self):
        return 3


@pytest.fixture
def other_ranks(monkeypatch):
    d = mx.distributed
    monkeypatch.setattr(d, "recv_like", lambda x, src, group=None, stream=None: mx.zeros_like(x))
    monkeypatch.setattr(d, "send", lambda x, dst, group=None, stream=None: x)
    monkeypatch.setattr(d, "all_gather", lambda x, group=None, stream=None: mx.concatenate([x] * 3))
    monkeypatch.setattr(d, "all_sum", lambda x, group=None, stream=None: x * 3)
    from dflash_mlx.models.target import sharding

    monkeypatch.setattr(sharding.Sharding, "size", property(lambda self: 3))


@pytest.mark.parametrize("key", ["kimi_vl", "qwen2_vl", "mistral3+mistral4"])
def test_a_middle_rank_decodes_with_its_own_layers_caches(other_ranks, key):
    model = variants.build(key, variants.Variant(key, "layers3", {"num_hidden_layers": 3}).config(), 0)
    split(model, "pipeline", group=MiddleRank())
    prompt = mx.array([[5, 6, 7, 8]])
    own = make_prompt_cache(model)
    assert len(own) == 2  # the first rank's layer's cache, and its own
    with pytest.raises(TypeError, match="depends"):  # mlx-lm's own caches: the hop waits on nothing
        mx.eval(model(prompt, cache=own))

    target = Target(model)
    cache = target.make_cache()
    assert len(cache) == 1 and target.layer_offset == 1
    mx.eval(model(prompt, cache=cache))
    assert cache[0].offset == 4  # its layer's cache, filled
    h, _, _ = target.forward(mx.array([[9, 10]]), cache)
    mx.eval(h)
    assert cache[0].offset == 6
