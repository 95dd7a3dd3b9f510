"""Every architecture mlx-lm ships, and the multimodal wrappers real checkpoints load through
(`gemma4`, `qwen3_vl`, `mistral3`, `llama4`, ...): on a tiny random float32 model, DFlash greedy
equals mlx-lm's own greedy decode (a random draft at width 1 and `auto`, a scripted draft right
for a random number of tokens each cycle), or the target is refused with one line when it is
built, before anything decodes. Each model is built once (`dflash_mlx.testing.arch_check`);
the families z-lab drafts for keep their deeper checks in tests/test_families.py.
"""

import re
from functools import lru_cache

import pytest

import dflash_mlx  # noqa: F401  (before mlx.core: BLAS routing)
import mlx.core as mx

from dflash_mlx.testing import arch_check, more_archs

RUN = [k for k in arch_check.QUICK if k not in more_archs.NOT_RUN]


@lru_cache(maxsize=None)
def model_for(key):
    return arch_check.build(key)


def test_every_model_module_of_mlx_lm_is_covered():
    covered = {arch_check.module_of(k) for k in arch_check.ARCHITECTURES}
    modules = set(arch_check.mlx_lm_modules())
    assert len(modules) >= 120
    assert modules - covered == set()
    wrappers = {"gemma3", "gemma4", "qwen2_vl", "qwen3_vl", "qwen3_vl_moe", "mistral3", "pixtral", "lfm2-vl",
                "kimi_vl", "kimi_k3", "llama4", "minimax_m3_vl", "muse_spark", "gemma3n"}
    assert wrappers <= {arch_check.module_of(k) for k in more_archs.WRAPPER_CONFIGS}
    assert all("text_config" in more_archs.WRAPPER_CONFIGS[k] for k in more_archs.WRAPPER_CONFIGS)


@pytest.mark.parametrize("key", RUN)
def test_exact_or_refused_in_one_line(key):
    from dflash_mlx.models.target.adapter import Target

    model = model_for(key)
    if key in more_archs.REFUSED:
        reason = arch_check.refusal(model)
        assert reason is not None and re.search(more_archs.REFUSED[key], reason), reason
        assert "\n" not in reason
        return
    prompt, ref = arch_check.case(model)
    outcome = arch_check.quick_check(model, prompt, ref)
    assert outcome.status == "exact", outcome.reason
    assert len(set(outcome.accepts)) >= 2  # partial accepts of different lengths: rollbacks ran
    assert Target(model).rollback_kinds()


def test_a_refused_target_fails_before_anything_decodes():
    from dflash_mlx import stream_generate
    from dflash_mlx.models.target.adapter import UnsupportedTargetError
    from dflash_mlx.testing.targets import byte_tokenizer

    model = model_for("olmo")
    stream = stream_generate(model, None, byte_tokenizer(), [1, 2, 3], max_tokens=4, baseline=False)
    with pytest.raises(UnsupportedTargetError, match="mlx-lm's own model fails on a prompt of two tokens"):
        next(stream)


def test_a_text_model_that_takes_its_models_mask_and_a_head_with_its_own_norm():
    """Phixtral (the old `phi-msft` checkpoints) keeps its token table one module deeper
    (`embd.wte`), its text model takes the mask its `Model` makes, and its head is a LayerNorm then
    a linear layer: the forward gets mlx-lm's mask, the head runs whole (the reduced vocabulary
    takes its columns), and the logits are the model's own. Greedy DFlash: the quick check."""
    from dflash_mlx.models.target.adapter import Target

    model = model_for("phixtral")
    target = Target(model)
    assert target.embed_tokens is model.transformer.embd.wte and target._takes_mask
    ids = mx.array([[1, 2, 3]])
    h, _, _ = target.forward(ids, target.make_cache(), layer_ids=[0])
    assert mx.allclose(target.logits(h), model(ids), atol=1e-5).item()
    vocab = mx.array([5, 1, 9])
    assert mx.allclose(target.head(h, vocab), mx.take(model(ids), vocab, axis=-1), atol=1e-5).item()


def test_layers_the_model_never_calls_whole_are_read_at_the_next_layers_input_norm():
    """IQuest's loop coder runs its layers' parts itself, every layer twice: no layer is called
    whole, so each layer's output is read where the next layer's input norm takes it (its second
    pass), the last one's where the final norm does. Greedy DFlash is mlx-lm's: the quick check."""
    from dflash_mlx.models.target.adapter import Target

    target = Target(model_for("iquestloopcoder"))
    assert target.tap_inputs
    n, size = len(target.layers), target.hidden_size
    h, features, _ = target.forward(mx.array([[1, 2, 3]]), target.make_cache(), layer_ids=list(range(n)))
    assert features.shape == (1, 3, n * size)
    last = features[..., (n - 1) * size:]
    assert mx.allclose(target.text_model.norm(last), h, atol=1e-5).item()  # the final norm's input
    assert type(target.layers[1]["input_layernorm"]).__name__ == "RMSNorm"  # put back after the forward


@pytest.mark.parametrize("key", sorted(k for k in more_archs.NOT_RUN if k != "phi3small"))
def test_what_is_not_run_here_is_what_mlx_lm_cannot_run_on_this_cpu(key):
    """Metal-only kernels: mlx-lm's own forward fails here (Phi-3-small's corrupts the heap,
    so it is not run at all); when it runs, the key belongs in the checks above."""
    if mx.default_device() == mx.gpu:
        pytest.skip("a GPU may run them")
    with pytest.raises(RuntimeError, match="Metal"):
        mx.eval(model_for(key)(mx.array([[1, 2, 3]])))


def test_recurrent_state_no_layer_is_handed_is_refused_in_one_line():
    from mlx_lm.models.cache import ArraysCache

    from dflash_mlx.models.target.adapter import Target, UnsupportedTargetError

    model = arch_check.build("mamba")  # a fresh model: the probe runs once per model
    own = model.make_cache
    model.make_cache = lambda: own() + [ArraysCache(size=1)]  # e.g. an embedding's own cache
    with pytest.raises(UnsupportedTargetError, match=r"cache 2 \(ArraysCache\) holds recurrent state that no "
                                                     "decoder layer is handed"):
        Target(model)


def test_a_mixer_replayed_alone_must_rebuild_the_state():
    """Where a layer's call cannot be replayed (Kimi K3's running block residuals), the module
    it hands its state to is re-run instead, checked on one rollback: RWKV-7 hands one state to
    two modules, so re-running either alone is caught."""
    from dflash_mlx.models.target import probe
    from dflash_mlx.models.target.adapter import Target

    target = Target(model_for("kimi_k3"))
    assert target.replay_mixers and probe._mixers_replay(target) is None
    rwkv = Target(arch_check.build("rwkv7"))
    assert not rwkv.replay_mixers
    rwkv.replay_mixers = True
    assert "cannot be re-run alone" in probe._mixers_replay(rwkv)


@pytest.mark.parametrize("neighbors", [2, 3])
def test_an_embedding_that_keeps_its_own_cache_is_replayed(neighbors):
    """LongCat's n-gram embedding keeps the context's last n - 1 token ids in a cache of its own,
    which no decoder layer is handed: a verify records the embedding's call, a partial accept
    re-runs it on the kept ids, and the draft embeds with its `word_embeddings`. Greedy DFlash is
    mlx-lm's at every width and over two turns (trigrams; bigrams: the quick check above); in a
    batch where rows' caches line up (bigrams), and one at a time where a one-token row's would be
    shorter than the others' (trigrams)."""
    from dflash_mlx.engine.batch_caches import batch_support
    from dflash_mlx.models.target.adapter import Target
    from dflash_mlx.testing import variant_check, variants

    v = variants.Variant("longcat_flash_ngram", f"neighbors{neighbors}", {"emb_neighbor_num": neighbors})
    target = Target(variants.build(v.key, v.config(v.overrides), 0))
    assert target.embed_tokens is target.text_model["ngram_embeddings"]["word_embeddings"]
    assert target.rollback_kinds()[0] == "replay"
    refusal = batch_support(target)
    assert (refusal is None) == (neighbors == 2), refusal
    if neighbors == 2:  # three rows of 1, 8 and 15 prompt tokens in one batch
        assert variant_check._batches(target.model, 1) is None
        return
    r = variant_check.check(v, batches=False)
    assert r.status == "exact", r.reason
    assert r.checked[:5] == ["1", "4", "16", "auto", "turns"]


def test_a_text_model_that_soft_caps_after_its_own_head_hands_over_its_hidden_states():
    """Gemma 3n's text model applies its tied head and then soft-caps: the forward gives what the
    head step was handed (the capped values the text model returns are dropped), DFlash applies
    the head and the cap, and its AltUp layers, which carry stacked streams, hand the draft the
    first one. (Greedy DFlash against mlx-lm's greedy decode: the quick check above, and Gemma 3n's
    variants in tests/test_variants.py.)"""
    from dflash_mlx.models.target.adapter import Target

    model = model_for("gemma3n")
    target = Target(model)
    assert (target.arch, target.inner_head.name, target.inner_head.tied) == ("gemma3n_text", "embed_tokens", True)
    assert target.vocab.softcap == 30.0
    ids = mx.array([[1, 2, 3]])
    h, features, _ = target.forward(ids, target.make_cache(), layer_ids=[0, 3])
    assert h.shape == (1, 3, target.hidden_size) and features.shape == (1, 3, 2 * target.hidden_size)
    assert mx.allclose(target.logits(h), model(ids), atol=1e-4).item()


@pytest.mark.parametrize("key,name,tied", [("gpt_neox", "embed_out", False), ("lille-130m", "tok_embeddings", True)])
def test_a_text_model_that_applies_its_head_itself_runs_exact(key, name, tied):
    """GPT-NeoX applies `embed_out` inside its text model, Lille its tied `as_linear`: during a
    forward that step passes the final hidden states through, DFlash applies the same head, and
    greedy DFlash is mlx-lm's greedy decode at every width, over two turns, in trees and batches."""
    from dflash_mlx.models.target.adapter import Target
    from dflash_mlx.testing import variant_check, variants

    model = model_for(key)
    target = Target(model)
    assert (target.inner_head.name, target.inner_head.tied) == (name, tied)
    h, _, _ = target.forward(mx.array([[1, 2, 3]]), target.make_cache(), layer_ids=[0])
    assert h.shape == (1, 3, target.hidden_size)  # hidden states, not logits
    assert type(target.text_model[name]).__name__ in ("Linear", "Embedding")  # put back after the forward
    logits = model(mx.array([[1, 2, 3]]))
    assert mx.allclose(target.logits(h), logits, atol=1e-4).item()
    r = variant_check.check(variants.Variant(key, "base", {}))
    assert r.status == "exact", r.reason
    assert r.checked[:7] == ["1", "4", "16", "auto", "turns", "trees", "batches"]


@pytest.mark.skipif(mx.default_device().type != mx.DeviceType.cpu,
                    reason="MLX's CPU GatherMM takes float32 only; a GPU runs a bfloat16 MoE")
def test_a_target_mlx_lm_itself_cannot_run_is_refused_as_such():
    """A bfloat16 MoE on MLX's CPU backend: mlx-lm's own forward raises, and the refusal says so
    rather than blaming how DFlash calls the text model."""
    from dflash_mlx.models.target.adapter import Target, UnsupportedTargetError

    model = arch_check.build("jamba")
    model.set_dtype(mx.bfloat16)
    with pytest.raises(UnsupportedTargetError, match="mlx-lm's own model fails on a prompt of two tokens "
                                                     r"\(RuntimeError: \[GatherMM::eval\]") as e:
        Target(model)
    assert "\n" not in str(e.value)


def test_every_tiny_model_with_recurrent_state_reads_it():
    """A check of a recurrent rollback on a model whose state does not reach its tokens cannot
    fail: every tiny model's recurrent states move its next token's logits."""
    checked = []
    for key in arch_check.ARCHITECTURES:
        if key in more_archs.REFUSED or key in more_archs.NOT_RUN:
            continue
        model = model_for(key)
        reads = arch_check.reads_state(model)
        if reads is not None:
            assert reads, key
            checked.append(key)
    assert {"qwen3_5", "rwkv7", "recurrent_gemma", "mamba", "jamba"} <= set(checked)
