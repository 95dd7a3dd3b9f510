"""Caches rolled back by running the text model again (`models/target/rerun.py`): DeepSeek V4.1,
whose layers share compressed KV and index picks within a forward, so none can be re-run alone.
Greedy DFlash equals mlx-lm's own greedy decode with its compressed attention switched on; a
rollback leaves the caches as a forward of the kept tokens alone does; what this path cannot
hold (a model that writes into its caches' arrays, one that mixes such caches with others) is
refused in one line when the target is built."""

from types import SimpleNamespace

import pytest

import dflash_mlx  # noqa: F401  (before mlx.core: BLAS routing)
import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache

from dflash_mlx.models.target.adapter import Target, UnsupportedTargetError
from dflash_mlx.testing import arch_check, variant_check, variants

# The tiny config compresses groups of 4 on layer 1 and indexes them (3 kept, candidate blocks
# of 2), layer 2 reads both; these move the sources, the ratios and the index around.
CONFIGS = {
    "base": {},
    "ratio 1, no candidates": dict(compress_ratios=[0, 1, 4], kv_source_layer_ids=[1, 2],
                                   index_source_layer_ids=[2], candidate_source_layer_id=-1),
    "every layer compresses": dict(compress_ratios=[4, 4, 4], kv_source_layer_ids=[0, 2],
                                   index_source_layer_ids=[0, 1, 2], candidate_source_layer_id=0,
                                   candidate_topk_blocks=2, candidate_block_size=1),
    "ratio 8, index keeps 1": dict(compress_ratios=[8, 0, 2], kv_source_layer_ids=[0, 2],
                                   index_source_layer_ids=[2], candidate_source_layer_id=-1, index_topk=1),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_deepseek_v41_is_exact_with_its_compressed_attention(name):
    """Its own config at every width and over two turns; the others at the widths that roll back
    (a scripted draft's partial accepts at 4, a random draft's at 16)."""
    full = name == "base"
    r = variant_check.check(variants.Variant("deepseek_v41", name, CONFIGS[name]),
                            widths=variant_check.WIDTHS if full else (4, 16), turns=full)
    assert r.status == "exact", r.reason
    assert r.checked[:5 if full else 2] == (["1", "4", "16", "auto", "turns"] if full else ["4", "16"])


def _fields(cache):
    return [{k: v for k, v in vars(c).items()} for c in cache]


def test_a_rollback_leaves_the_caches_as_a_forward_of_the_kept_tokens():
    target = Target(arch_check.build("deepseek_v41"))
    assert set(target.rollback_kinds()) == {"rerun"} and target.recurrent
    prompt = mx.array([list(range(1, 19))])
    rolled, alone = target.make_cache(), target.make_cache()
    target.forward(prompt, rolled)
    target.forward(prompt, alone)
    _, _, record = target.forward(mx.array([[5, 6, 7, 8, 9, 10]]), rolled, record=True)
    assert record.rerun is not None
    target.rollback(rolled, 6, 4, record)  # keep 2: the caches close a compressed group at 20
    target.forward(mx.array([[5, 6]]), alone)
    for x, y in zip(_fields(rolled), _fields(alone)):
        assert x.keys() == y.keys()
        for k in y:
            if isinstance(y[k], mx.array):
                assert x[k].shape == y[k].shape and mx.allclose(x[k], y[k], atol=1e-5).item(), k
            else:
                assert x[k] == y[k], k
    assert vars(rolled[1])["compress_kv"].shape[1] == 5
    nxt = mx.array([[11]])
    assert mx.allclose(target.forward(nxt, rolled)[0], target.forward(nxt, alone)[0], atol=1e-5).item()


def test_batches_and_trees_are_refused_in_one_line_deterministic_mode_is_taken():
    from dflash_mlx.engine.batch_caches import batch_support
    from dflash_mlx.models.target.tree_attention import tree_support

    target = Target(arch_check.build("deepseek_v41"))
    assert "LayerCache" in batch_support(target) and "LayerCache" in tree_support(target)
    target.deterministic = True  # (its rows' states are kept: tests/test_deterministic.py decodes it)
    assert target.deterministic


# -- toy models: what the path refuses ------------------------------------------------------


class _OwnCache:
    """A model's own cache class: a running sum, no trim."""

    def __init__(self):
        self.offset = 0
        self.total = mx.zeros((1, 1, 8))

    def is_trimmable(self):
        return False


class _Layer(nn.Module):
    def __init__(self, in_place: bool):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.in_place = in_place

    def __call__(self, x, cache=None):
        if cache is None:
            return self.proj(x)
        sums = cache.total + mx.cumsum(x, axis=1)  # [1, S, 8]: the running sum at each position
        if self.in_place:
            cache.total[...] = sums[:, -1:]  # written into the array the cache holds
        else:
            cache.total = sums[:, -1:]
        cache.offset += x.shape[1]
        return self.proj(x) + sums


class _Text(nn.Module):
    def __init__(self, in_place: bool):
        super().__init__()
        self.embed_tokens = nn.Embedding(16, 8)
        self.layers = [_Layer(in_place), _Layer(in_place)]
        self.norm = nn.RMSNorm(8)

    def __call__(self, inputs, cache=None):
        h = self.embed_tokens(inputs)
        for layer, c in zip(self.layers, cache or [None] * len(self.layers)):
            h = layer(h, cache=c)
        return self.norm(h)


class _Toy(nn.Module):
    def __init__(self, in_place: bool = False, caches=None):
        super().__init__()
        self.model = _Text(in_place)
        self.lm_head = nn.Linear(8, 16, bias=False)
        self.args = SimpleNamespace(model_type="toy", hidden_size=8, vocab_size=16)
        self._caches = caches or (lambda: [_OwnCache(), _OwnCache()])

    def __call__(self, inputs, cache=None):
        return self.lm_head(self.model(inputs, cache))

    def make_cache(self):
        return self._caches()

    @property
    def layers(self):
        return self.model.layers


def test_a_model_whose_caches_are_replaced_runs_and_one_that_writes_into_them_is_refused():
    target = Target(_Toy(in_place=False))
    assert target.rollback_kinds() == ["rerun", "rerun"]
    with pytest.raises(UnsupportedTargetError, match=r"cache 0 \(_OwnCache\) is not put back") as e:
        Target(_Toy(in_place=True))
    assert "\n" not in str(e.value)


def test_a_model_that_mixes_rerun_caches_with_others_is_refused():
    with pytest.raises(UnsupportedTargetError, match="mixes the two") as e:
        Target(_Toy(caches=lambda: [_OwnCache(), KVCache()]))
    assert "\n" not in str(e.value)
