"""Past the model's position limit (`max_position_embeddings`, or a window the probe found),
DFlash decodes on as mlx-lm does, token for token: a verify's rows stop at the limit, and past
it each cycle runs one row, the shape mlx-lm's own forward has there (issue 47: a stop at the
limit parted DFlash's answer from mlx-lm's, which goes on)."""

import random

import pytest

import dflash_mlx  # noqa: F401,I001  (before mlx.core: BLAS routing)

from dflash_mlx import stream_generate
from dflash_mlx.engine.engine import BatchEngine
from dflash_mlx.engine.rows import BatchRequest
from dflash_mlx.models.target.adapter import Target
from dflash_mlx.options import GenerationOptions
from dflash_mlx.testing.targets import EOS_ID, RowScriptedDrafts, ScriptedDraft, greedy_reference, tiny_target

LIMIT = 40
DYNAMIC_NTK = {"type": "dynamic", "factor": 1000.0}  # its base grows with offset + rows past the limit


def _model(rope_scaling):
    return tiny_target("llama", seed=1, max_position_embeddings=LIMIT, rope_scaling=rope_scaling,
                       layer_types=None, sliding_window=None)


def _case(model, prompt_len, max_tokens, seed=0):
    rng = random.Random(seed)
    for _ in range(50):
        prompt = [rng.randrange(0, 256) for _ in range(prompt_len)]
        ref = greedy_reference(model, prompt, max_tokens)
        if EOS_ID not in ref:
            return prompt, ref
    raise AssertionError("no EOS-free case")


def test_dynamic_ntk_rope_depends_on_the_forwards_width_past_the_limit():
    """What makes the rows' limit needed: past it, a row of a two-row forward is not the row
    mlx-lm's one-row step computes."""
    import mlx.core as mx

    model, _ = _model(DYNAMIC_NTK)
    rope = model.model.layers[0].self_attn.rope
    x = mx.random.normal((1, 1, 2, rope.dims), key=mx.random.key(0))
    assert mx.array_equal(rope(x, offset=LIMIT - 2)[:, :, :1], rope(x[:, :, :1], offset=LIMIT - 2)).item()
    assert not mx.allclose(rope(x, offset=LIMIT)[:, :, :1], rope(x[:, :, :1], offset=LIMIT)).item()


@pytest.mark.parametrize("rope_scaling", [DYNAMIC_NTK, None], ids=["dynamic-ntk", "default"])
@pytest.mark.parametrize("width", [1, 4, 16, "auto"])
def test_decodes_past_the_position_limit_as_mlx_lm(rope_scaling, width):
    """An oracle draft makes every verify as wide as the width allows, so one would span the
    limit if the rows were not stopped there."""
    model, tok = _model(rope_scaling)
    prompt, ref = _case(model, 30, 24)
    draft = ScriptedDraft(Target(model), prompt + ref, lambda c: 10**9, block_size=16)
    responses = list(stream_generate(model, draft, tok, prompt, max_tokens=len(ref), block_size=width,
                                     stop_token_ids=[], token_trees=False))
    assert [t for r in responses for t in r.tokens] == ref
    assert responses[-1].finish_reason == "length" and responses[-1].generation_tokens == len(ref)


def test_batch_rows_decode_past_the_position_limit_as_mlx_lm():
    """Two rows of one batch at different positions, one of them crossing the limit (a batch
    of dynamic NTK rows is refused in one line: its RoPE takes one offset for the batch)."""
    from dflash_mlx.models.target.rollback import UnsupportedTargetError

    with pytest.raises(UnsupportedTargetError, match=r"rotary embedding \(DynamicNTKScalingRoPE\) takes one position"):
        BatchEngine(_model(DYNAMIC_NTK)[0], None, _model(None)[1], max_batch=2)
    model, tok = _model(None)
    cases = [_case(model, 30, 24), _case(model, 11, 24, seed=1)]
    draft = RowScriptedDrafts(Target(model), cases, lambda c: 10**9, block_size=8)
    engine = BatchEngine(model, draft, tok, max_batch=2, block_size=8)
    outs = {}
    for prompt, ref in cases:
        row = engine.add(BatchRequest(prompt, GenerationOptions(max_tokens=len(ref)), stop_token_ids=[]))
        draft.register(row.state, prompt)
        outs[row.uid] = []
    while not engine.idle:
        for row, event in engine.step():
            outs[row.uid] += event.tokens
    assert list(outs.values()) == [ref for _, ref in cases]


@pytest.mark.parametrize("width", [1, 4, "auto"])
def test_hunyuan_ntk_alpha_past_a_short_position_limit(width):
    """The issue's case as a new user builds it: hunyuan_v1_dense, NTK-alpha RoPE (`rope_scaling`
    type `dynamic` with `alpha`), q/k norms, a tiny config's short `max_position_embeddings`, and an
    answer that runs past it."""
    import copy

    import mlx.core as mx
    from mlx_lm.utils import _get_classes

    from dflash_mlx.models.draft.checkpoints import random_draft
    from dflash_mlx.testing import arch_check
    from dflash_mlx.testing.targets import byte_tokenizer

    cfg = copy.deepcopy(arch_check.ARCHITECTURES["hunyuan_v1_dense"])
    cfg.update(max_position_embeddings=32, use_qk_norm=True,
               rope_scaling={"type": "dynamic", "alpha": 1000.0, "factor": 1.0})
    model_class, args_class = _get_classes(cfg)
    mx.random.seed(0)
    model = model_class(args_class.from_dict(cfg))
    model.set_dtype(mx.float32)
    model.eval()
    prompt, ref = _case(model, 20, 30)
    draft = random_draft(model, num_layers=1, block_size=8, seed=3)
    out = [t for r in stream_generate(model, draft, byte_tokenizer(), prompt, max_tokens=len(ref), block_size=width,
                                      stop_token_ids=[]) for t in r.tokens]
    assert out == ref
