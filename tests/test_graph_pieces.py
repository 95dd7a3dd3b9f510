"""A target forward queues its graph a layer at a time while the host builds the rest
(`models.target.taps.submit_layers`): the pieces are queued, and they change no value."""

from types import SimpleNamespace
from unittest import mock

import dflash_mlx  # noqa: F401,I001  (before mlx.core: BLAS routing)
import mlx.core as mx
import pytest

from dflash_mlx.generate import stream_generate
from dflash_mlx.models.target import taps
from dflash_mlx.models.target.adapter import Target
from dflash_mlx.testing.targets import ScriptedDraft, clean_case, tiny_target

LAYERS = 4


@pytest.fixture(scope="module")
def model_tok():
    return tiny_target("qwen3", seed=3, num_hidden_layers=LAYERS)


def queued_by(fn):
    """(fn's result, the arrays the forward queued through `mx.async_eval`)."""
    queued = []

    def spy(*arrays):
        queued.extend(arrays)
        return mx.async_eval(*arrays)

    with mock.patch.object(taps, "mx", SimpleNamespace(async_eval=spy, array=mx.array)):
        return fn(), queued


def forward(target, tokens, **kwargs):
    cache = target.make_cache()
    h, feats, _ = target.forward(mx.array([tokens]), cache, **kwargs)
    mx.eval(h, feats, [c.state for c in cache])
    return h, feats, [c.state for c in cache]


@pytest.mark.parametrize("layer_ids,record,pieces", [
    ([1, 2], False, LAYERS - 1),  # a drafted target's plain step or prompt chunk: taps for the draft
    ([1, 2], True, LAYERS - 1),  # its verify
    ([], True, LAYERS - 1),  # a verify without a draft (a copy)
    ([], False, 0),  # a plain forward with nothing to tap: mlx-lm's forward as it is
])
def test_a_forward_queues_its_graph_after_every_layer_but_the_last(model_tok, layer_ids, record, pieces):
    model, _ = model_tok
    target = Target(model)
    tokens = list(range(3, 19))
    (h, feats, states), queued = queued_by(lambda: forward(target, tokens, layer_ids=layer_ids, record=record))
    assert len(queued) == pieces
    assert all(q.shape == (1, len(tokens), target.hidden_size) for q in queued)
    with mock.patch.object(taps, "SUBMIT_EVERY", 0):
        (h0, feats0, states0), none = queued_by(lambda: forward(target, tokens, layer_ids=layer_ids, record=record))
    assert none == []
    assert mx.array_equal(h, h0).item()
    assert feats is None if not layer_ids else mx.array_equal(feats, feats0).item()
    assert all(mx.array_equal(a, b).item() for s, s0 in zip(states, states0) for a, b in zip(s, s0))


def test_no_pieces_where_the_layers_are_not_called_whole(model_tok):
    """(a model whose taps read the next layer's input norm, `tap_inputs`, calls its layers some other way)"""
    model, _ = model_tok
    target = Target(model)
    target.tap_inputs = True
    _, queued = queued_by(lambda: forward(target, [3, 4, 5], layer_ids=[1]))
    assert queued == []


@pytest.mark.parametrize("every", [0, 1, 2])
@pytest.mark.parametrize("width", [1, 4, 16])
def test_decode_is_the_targets_own_whatever_the_pieces(model_tok, every, width):
    model, tok = model_tok
    prompt, ref = clean_case(model, 21, 40, seed=every)
    draft = ScriptedDraft(Target(model), prompt + ref, lambda c: (c * 5) % 16, width)
    with mock.patch.object(taps, "SUBMIT_EVERY", every):
        out = [t for r in stream_generate(model, draft, tok, prompt, max_tokens=40, block_size=width,
                                          stop_token_ids=[]) for t in r.tokens]
    assert out == ref
