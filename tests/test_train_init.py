"""Target initialisation, feature preconditioning and the overfit check of the
training recipe (dflash_mlx/train/init.py, trainer.py), on tiny targets."""

import os
import random

import mlx.core as mx
import numpy as np
import pytest

import dflash_mlx  # noqa: F401
from dflash_mlx.models.draft.checkpoints import load_draft
from dflash_mlx.models.target.adapter import Target
from dflash_mlx.testing.targets import greedy_reference, tiny_target
from dflash_mlx.train import data as D
from dflash_mlx.train.packed import pack_responses, unpack_responses
from dflash_mlx.train import init as I
from dflash_mlx.train.export import export_draft
from dflash_mlx.train.grow import grow_draft
from dflash_mlx.train.forward import training_logits
from dflash_mlx.train.features import FeatureSource
from dflash_mlx.train.batch import make_batch
from dflash_mlx.train.config import TrainConfig
from dflash_mlx.train.trainer import Trainer
from dflash_mlx.train.vocab import index_map


def _records(model, n=6, prompt_len=24, max_tokens=64):
    out = []
    for s in range(n):
        rng = random.Random(s)
        prompt = [rng.randrange(0, 256) for _ in range(prompt_len)]
        out.append({"id": f"r{s}", "prompt": prompt, "response": greedy_reference(model, prompt, max_tokens)})
    return out


@pytest.fixture(scope="module")
def setup():
    model, tok = tiny_target("llama")
    target = Target(model)
    return model, tok, target, _records(model)


def _overfit(target, tok, recs, tmp_path, steps=150, lr=3e-3, init="target"):
    cfg = I.make_draft_config(target, tok, recs, 2, 8, init)
    feats = FeatureSource(target, cfg.target_layer_ids)
    mx.random.seed(0)
    draft, scale, _ = I.make_draft(cfg, target, recs, feats, init=init)
    tc = TrainConfig(steps=steps, batch_tokens=256, blocks_per_seq=8, lr=lr, eval_every=0, log_every=10**6)
    tr = Trainer(draft, recs, recs, feats, tc, tmp_path, log=lambda s: None, feature_scale=scale)
    before = tr.evaluate()
    tr.train()
    return before, tr.evaluate()


def test_overfit_check_fits_a_handful_of_sequences(setup, tmp_path):
    _, tok, target, recs = setup
    before, after = _overfit(target, tok, recs, tmp_path)
    assert before["val_acc"] < 0.2
    assert after["val_acc"] >= 0.9, after
    assert min(after["val_pos_acc"]) >= 0.8, after["val_pos_acc"]
    assert after["val_tau_hat"] > 5.0


def test_overfit_check_reports_a_recipe_that_cannot_learn(setup, tmp_path):
    # lr 0: the optimiser does nothing; the check must say so, not pass anyway.
    _, tok, target, recs = setup
    _, after = _overfit(target, tok, recs, tmp_path, steps=20, lr=0.0)
    assert after["val_acc"] < 0.3


class _MassiveActivations:
    """Tapped features with the pathology measured on SmolLM2: one dimension per tap carries
    a huge near-constant value (mean |x| 432 there against a per-position RMS of 26), and the
    first position is far larger than the rest (RMS ~1000 there)."""

    def __init__(self, source, hidden_size, magnitude=400.0):
        self.source, self.H, self.magnitude = source, hidden_size, magnitude

    def __call__(self, rec):
        f = np.array(self.source(rec), np.float32)
        f[:, 5 :: self.H] += self.magnitude
        f[0] *= 30
        return f


@pytest.mark.parametrize("feature_scale,fits", [(False, False), (True, True)])
def test_overfit_check_fails_raw_badly_conditioned_features(setup, tmp_path, feature_scale, fits):
    """The old recipe (fresh layers, raw features) cannot fit 6 sequences in 150 steps when
    the features are conditioned like a real LLM's; per-dimension preconditioning (folded
    into fc at export) can. Fresh layers on both sides: target-initialised layers take the
    target's own input path, which a random tiny target was never trained to read with
    such features (a real target's layers are), so they would not isolate the features."""
    _, tok, target, recs = setup
    cfg = I.make_draft_config(target, tok, recs, 2, 8, "random", None, None, target.vocab_size - 1)
    feats = _MassiveActivations(FeatureSource(target, cfg.target_layer_ids), target.hidden_size)
    mx.random.seed(0)
    draft, scale, _ = I.make_draft(cfg, target, recs, feats, init="random", feature_scale=feature_scale)
    tc = TrainConfig(steps=150, batch_tokens=256, blocks_per_seq=8, lr=3e-3, eval_every=0, log_every=10**6)
    tr = Trainer(draft, recs, recs, feats, tc, tmp_path, log=lambda s: None, feature_scale=scale)
    tr.train()
    acc = tr.evaluate()["val_acc"]
    # measured here: raw 0.13, preconditioned 0.91
    assert (acc >= 0.8) if fits else (acc < 0.4), acc


def test_init_copies_target_layers_and_passes_the_feeding_tap(setup):
    model, tok, target, recs = setup
    L = target.num_layers
    cfg = I.make_draft_config(target, tok, recs, 2, 8, "target")
    assert (L - 3) in cfg.target_layer_ids  # feeds the first copied layer, L-2
    feats = FeatureSource(target, cfg.target_layer_ids)
    draft, scale, done = I.make_draft(cfg, target, recs, feats)
    assert done["copied_layers"] == [L - 2, L - 1]
    assert done["passthrough_tap"] == L - 3
    src = model.model.layers[L - 2]
    np.testing.assert_array_equal(np.array(draft.layers[0].self_attn.q_proj.weight), np.array(src.self_attn.q_proj.weight))
    np.testing.assert_array_equal(np.array(draft.layers[0].mlp.down_proj.weight), np.array(src.mlp.down_proj.weight))
    # The fused context is exactly what the first copied layer reads: its input norm
    # applied to the feeding layer's output.
    f = mx.array(np.asarray(feats(recs[0]), np.float32))
    fused = draft.fuse(f * mx.array(scale))
    H = target.hidden_size
    j = cfg.target_layer_ids.index(L - 3)
    expect = src.input_layernorm(f[:, j * H : (j + 1) * H])
    np.testing.assert_allclose(np.array(fused), np.array(expect), rtol=1e-4, atol=1e-4)


def test_feature_scale_is_folded_into_fc_at_export(setup, tmp_path):
    model, tok, target, recs = setup
    cfg = I.make_draft_config(target, tok, recs, 2, 8, "target")
    feats = FeatureSource(target, cfg.target_layer_ids)
    draft, scale, _ = I.make_draft(cfg, target, recs, feats)
    # make fc non-trivial in every column, as after training
    draft.fc.weight = draft.fc.weight + 0.01 * mx.random.normal(draft.fc.weight.shape)
    assert np.ptp(scale) > 0
    batch = make_batch(recs[:2], feats, np.random.default_rng(0), 8, 4, cfg.mask_token_id,
                       index_map(None, cfg.vocab_size), feature_scale=scale)
    trained = training_logits(draft, batch.features, batch.block_ids, batch.anchors)
    export_draft(draft, tmp_path / "d", dtype=mx.float32, feature_scale=scale)
    shipped = load_draft(tmp_path / "d", model)
    raw = batch.features / mx.array(scale)  # what the engine feeds: unscaled features
    exported = training_logits(shipped, raw, batch.block_ids, batch.anchors)
    np.testing.assert_allclose(np.array(exported), np.array(trained), rtol=1e-3, atol=1e-3)


def test_mask_token_is_never_a_token_of_the_data():
    class Tok:
        eos_token_ids = [0]

    recs = [{"prompt": [1, 2, 3], "response": [299, 4]}]
    m = I.choose_mask_token(Tok(), recs, 300)
    assert m == 298
    recs = [{"prompt": list(range(300)), "response": [1]}]
    with pytest.raises(ValueError, match="mask token"):
        I.choose_mask_token(Tok(), recs, 300)


def test_smollm2_style_special_token_is_preferred():
    class Added:
        special = True

    class HF:
        added_tokens_decoder = {0: Added(), 1: Added(), 2: Added(), 16: Added()}
        bos_token_id = 1

    class Tok:
        eos_token_ids = [2]
        _tokenizer = HF()

    assert I.choose_mask_token(Tok(), [{"prompt": [0, 1, 5], "response": [2]}], 100) == 16


def test_weight_decay_leaves_norms_alone(setup, tmp_path):
    _, tok, target, recs = setup
    cfg = I.make_draft_config(target, tok, recs, 1, 8, "target")
    feats = FeatureSource(target, cfg.target_layer_ids)
    results = []
    for wd in (0.0, 0.5):
        mx.random.seed(0)
        draft, scale, _ = I.make_draft(cfg, target, recs, feats)
        tc = TrainConfig(steps=1, batch_tokens=128, blocks_per_seq=4, lr=1e-2, weight_decay=wd, warmup=0.0,
                         eval_every=0, log_every=10**6)
        Trainer(draft, recs, [], feats, tc, tmp_path / str(wd), log=lambda s: None, feature_scale=scale).train()
        results.append(draft)
    a, b = results
    np.testing.assert_array_equal(np.array(a.layers[0].input_layernorm.weight), np.array(b.layers[0].input_layernorm.weight))
    np.testing.assert_array_equal(np.array(a.hidden_norm.weight), np.array(b.hidden_norm.weight))
    assert not np.allclose(np.array(a.layers[0].mlp.up_proj.weight), np.array(b.layers[0].mlp.up_proj.weight))


def test_feature_cache_with_more_layers_than_the_draft_taps(setup, tmp_path):
    import json

    _, _, target, recs = setup
    run = tmp_path / "run"
    (run / "features").mkdir(parents=True)
    (run / "feature_layers.json").write_text(json.dumps([0, 1, 2, 3]))
    full = FeatureSource(target, [0, 1, 2, 3], run / "features", save_missing=True)
    wide = np.asarray(full(recs[0]))
    sub = FeatureSource(target, [1, 3], run / "features")
    H = target.hidden_size
    np.testing.assert_array_equal(np.asarray(sub(recs[0])), np.concatenate([wide[:, H:2 * H], wide[:, 3 * H:]], 1))
    direct = FeatureSource(target, [1, 3])(recs[0])
    np.testing.assert_allclose(np.asarray(sub(recs[0]), np.float32), np.asarray(direct, np.float32), atol=2e-2, rtol=2e-2)


def test_packed_responses_round_trip(tmp_path):
    from dflash_mlx.testing.targets import byte_tokenizer

    tok = byte_tokenizer()
    prompts = D.gsm8k_train_prompts()[:3]
    recs = [{"id": p.id, "prompt": D.chat_prompt_ids(tok, p.text), "response": [5, 6, 7 + i], "finish": "length"}
            for i, p in enumerate(prompts)]
    recs.append({"id": "gsm8k-train:999999", "prompt": [1, 2], "response": [3], "finish": "stop"})
    path = tmp_path / "r.jsonl.gz"
    pack_responses(recs, path)
    msgs = []
    back = unpack_responses(path, tok, log=msgs.append)
    assert back == recs[:3]
    assert msgs and "1 records without their prompt source" in msgs[0]


def _long_gsm8k_responses(tok, tmp_path, n=4):
    """The first `n` committed GSM8K responses of 60 tokens or more, unpacked. The choice
    reads only ids and responses, which unpacking keeps (it drops records, in order), so the
    records chosen before unpacking are those chosen after: only they are re-tokenized (all
    ~5800 records take ~3 s)."""
    import gzip
    import json

    keep = lambda r: r["id"].startswith("gsm8k-train:") and len(r["response"]) >= 60  # noqa: E731
    with gzip.open(D.DATA_DIR / "smollm2-135m-responses.jsonl.gz", "rt", encoding="utf-8") as f:
        lines = [line for line in f if line.strip() and keep(json.loads(line))]
    out = []
    for start in range(0, len(lines), n):  # (a record is skipped if its prompt cannot be rebuilt)
        with gzip.open(tmp_path / "subset.jsonl.gz", "wt", encoding="utf-8") as f:
            f.writelines(lines[start : start + n])
        out += unpack_responses(tmp_path / "subset.jsonl.gz", tok)
        if len(out) >= n:
            return out[:n]
    return out


@pytest.fixture(scope="module")
def smollm2_overfit_setup(smollm2, tmp_path_factory):
    """The real embedded target, 4 committed GSM8K responses, and one feature source for
    both recipes (same taps: the frozen target's features are computed once per record)."""
    model, tok = smollm2
    target = Target(model)
    gsm = _long_gsm8k_responses(tok, tmp_path_factory.mktemp("gsm8k"))
    return tok, target, gsm[:4], FeatureSource(target, [1, 10, 18, 27])


def _smollm2_overfit(setup, init, feature_scale, steps=40):
    """The overfit check on the real embedded target: 4 committed GSM8K responses,
    `steps` steps of 256 block tokens (each sequence seen 10 times), top-1 on them. The draft
    vocabulary is the recipe's default (8192 tokens, built from the records trained on, as
    `dflash-mlx train --overfit` builds it)."""
    from dflash_mlx.train.vocab import build_vocab

    tok, target, recs, feats = setup
    mask = None if init == "target" else target.vocab_size - 1  # the old recipe's mask token
    cfg = I.make_draft_config(target, tok, recs, 2, 16, init, feats.layer_ids, None, mask)
    vocab = build_vocab(recs, 8192, target.vocab_size, always=list(tok.eos_token_ids))
    mx.random.seed(0)
    draft, scale, _ = I.make_draft(cfg, target, recs, feats, init=init, feature_scale=feature_scale, vocab=vocab)
    tc = TrainConfig(steps=steps, batch_tokens=256, blocks_per_seq=16, lr=1e-3, eval_every=0, log_every=10**9,
                     checkpoint_every=10**9)
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        tr = Trainer(draft, recs, recs, feats, tc, tmp, log=lambda s: None, feature_scale=scale)
        tr.train()
        return tr.evaluate()


# The negative control (the old recipe fails the bar) costs ~50 s here and repeats on a real
# target what test_overfit_check_fails_raw_badly_conditioned_features shows on a tiny one in 4 s:
# it runs with DFLASH_TEST_CONTROLS=1.
_CONTROL = pytest.mark.skipif(os.environ.get("DFLASH_TEST_CONTROLS") != "1",
                              reason="the real-model negative control runs with DFLASH_TEST_CONTROLS=1")


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["target init, preconditioned",
                                    pytest.param("random layers, raw features", marks=_CONTROL)])
def test_overfit_check_on_smollm2_separates_the_recipes(smollm2_overfit_setup, recipe):
    """The recipe of session 2 (random layers, raw features) fits its own data far more
    slowly than the target-initialised one: the check must tell them apart. One recipe per
    test, so that the two (each ~a minute here) run side by side under pytest-xdist."""
    new = recipe.startswith("target")
    result = _smollm2_overfit(smollm2_overfit_setup, "target" if new else "random", new)
    print(f"\noverfit check, SmolLM2, 4 sequences, 40 steps, {recipe}: top-1 {result['val_acc']:.3f} "
          f"{result['val_pos_acc'][:3]}, loss {result['val_loss']:.2f}")
    # Measured here: new 0.125 (loss 4.07), old 0.069 (loss 4.81); new after 30 steps 0.065
    # (5.31). The check's bar, 10% top-1 on the sequences trained on after 40 steps, passes
    # the recipe and fails the old one; the losses sit on either side of 4.44, halfway between.
    if new:
        assert result["val_acc"] >= 0.10 and result["val_loss"] < 4.44
    else:
        assert result["val_acc"] < 0.10 and result["val_loss"] > 4.44


# -- self-distillation: the target's top-k distribution as soft labels ---------------


def test_teacher_top_k_is_the_targets_distribution_and_is_cached(setup, tmp_path):
    model, tok, target, recs = setup
    src = FeatureSource(target, [1, 2], tmp_path, save_missing=True, teacher_topk=8)
    rec = recs[0]
    ids, logp = src.teacher(rec)
    seq = rec["prompt"] + rec["response"]
    assert ids.shape == logp.shape == (len(seq) - 1, 8)
    # greedy data: the teacher's most likely token at row j is the token at j+1
    P = len(rec["prompt"])
    best = ids[np.arange(len(ids)), np.argmax(logp, axis=-1)]
    assert list(best[P - 1 :]) == seq[P:]
    # log-probabilities of the full softmax (not renormalised over the top-k)
    logits = np.array(target.logits(target.forward(mx.array([seq[:-1]]), None)[0])[0], np.float32)
    ref = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) - logits.max(-1, keepdims=True)
    np.testing.assert_allclose(logp.astype(np.float32), np.take_along_axis(ref, ids, -1), atol=2e-2)
    assert (np.exp(logp.astype(np.float32)).sum(-1) <= 1.0 + 1e-2).all()
    again = FeatureSource(target, [1, 2], tmp_path, teacher_topk=8).teacher(rec)  # from the cache now
    np.testing.assert_array_equal(again[0], ids)
    assert any(p.name.endswith(".top8.npz") for p in tmp_path.iterdir())


def test_soft_labels_in_the_batch_and_the_loss(setup):
    from dflash_mlx.train.loss import block_loss

    _, tok, target, recs = setup
    src = FeatureSource(target, [1, 2], teacher_topk=8)
    vocab = index_map(None, target.vocab_size)
    b = make_batch(recs[:2], src, np.random.default_rng(0), 8, 4, 299, vocab, teacher=src.teacher)
    sums = np.array(b.soft_probs.sum(-1))
    exists = np.array(b.exists)
    np.testing.assert_allclose(sums[exists], 1.0, atol=1e-5)  # renormalised over the top-k
    assert (sums[~exists] == 0).all()
    logits = mx.random.normal((*b.labels.shape, target.vocab_size))
    hard, _ = block_loss(logits, b.labels, b.valid, 7.0)
    # one-hot soft labels at the targets' tokens: the soft cross-entropy is the hard one
    one_hot_ids = b.labels[..., None]
    same, _ = block_loss(logits, b.labels, b.valid, 7.0, one_hot_ids, mx.ones(one_hot_ids.shape), 1.0)
    assert abs(hard.item() - same.item()) < 1e-4
    soft, _ = block_loss(logits, b.labels, b.valid, 7.0, b.soft_ids, b.soft_probs, 1.0)
    assert soft.item() != hard.item()


def test_overfit_with_self_distillation(setup, tmp_path):
    _, tok, target, recs = setup
    cfg = I.make_draft_config(target, tok, recs, 2, 8, "target")
    feats = FeatureSource(target, cfg.target_layer_ids, teacher_topk=16)
    mx.random.seed(0)
    draft, scale, _ = I.make_draft(cfg, target, recs, feats, init="target")
    tc = TrainConfig(steps=150, batch_tokens=256, blocks_per_seq=8, lr=3e-3, eval_every=0, log_every=10**6,
                     distill=0.5)
    tr = Trainer(draft, recs, recs, feats, tc, tmp_path, log=lambda s: None, feature_scale=scale)
    tr.train()
    after = tr.evaluate()
    # half the loss on the (here nearly flat: random weights) distribution, half on its argmax
    assert after["val_acc"] >= 0.9, after


def test_features_and_teacher_come_from_one_target_forward(setup, monkeypatch):
    _, tok, target, recs = setup
    calls = []
    forward = target.forward
    monkeypatch.setattr(target, "forward", lambda *a, **k: calls.append(1) or forward(*a, **k))
    src = FeatureSource(target, [1, 2], teacher_topk=8)  # no cache: nothing to read back
    make_batch(recs[:2], src, np.random.default_rng(0), 8, 4, 299, index_map(None, target.vocab_size),
               teacher=src.teacher)
    assert len(calls) == 2


def test_features_are_remembered_once_per_record_within_a_byte_bound(setup, monkeypatch):
    """Without a feature folder the target runs once per record, not once per step; the
    memory holds at most `memory_bytes` (least recently used out) and gives the same arrays."""
    _, tok, target, recs = setup
    calls = []
    forward = target.forward
    monkeypatch.setattr(target, "forward", lambda *a, **k: calls.append(1) or forward(*a, **k))
    src = FeatureSource(target, [1, 2], teacher_topk=8)
    first = [src(r) for r in recs[:3]]
    teachers = [src.teacher(r) for r in recs[:3]]
    again = [src(r) for r in recs[:3]]
    assert len(calls) == 3
    for a, b in zip(first, again):
        np.testing.assert_array_equal(a, b)
    fresh = FeatureSource(target, [1, 2], teacher_topk=8, memory_bytes=0)
    np.testing.assert_array_equal(fresh.teacher(recs[1])[0], teachers[1][0])
    one = first[0].nbytes + sum(a.nbytes for a in teachers[0])
    small = FeatureSource(target, [1, 2], teacher_topk=8, memory_bytes=one + 1)  # room for one record
    calls.clear()
    small(recs[0]), small(recs[0]), small(recs[1]), small(recs[1]), small(recs[0])
    assert len(calls) == 3  # recs[0], recs[1], then recs[0] again: it was pushed out
    assert small._memory_used <= one + 1


def _trained_draft(setup, tmp_path, layers=2, steps=30):
    _, tok, target, recs = setup
    cfg = I.make_draft_config(target, tok, recs, layers, 8, "target")
    feats = FeatureSource(target, cfg.target_layer_ids)
    mx.random.seed(0)
    draft, scale, _ = I.make_draft(cfg, target, recs, feats)
    tc = TrainConfig(steps=steps, batch_tokens=256, blocks_per_seq=8, lr=3e-3, eval_every=0, log_every=10**6)
    Trainer(draft, recs, recs, feats, tc, tmp_path / "small", log=lambda s: None, feature_scale=scale).train()
    return draft, feats, scale


@pytest.fixture(scope="module")
def trained(setup, tmp_path_factory):
    """The 30-step draft the growing tests start from, trained once, and its run folder
    (its checkpoint: run/small/checkpoint). Growing reads it and never changes it."""
    run = tmp_path_factory.mktemp("run")
    return (*_trained_draft(setup, run), run)


@pytest.mark.parametrize("layers", [3, 4, 5])
def test_grown_draft_computes_what_the_trained_draft_does(setup, trained, tmp_path, layers):
    _, tok, target, recs = setup
    draft, feats, scale, _ = trained
    grown = grow_draft(draft, layers)
    assert grown.config.num_hidden_layers == layers and len(grown.layers) == layers
    assert grown.config.target_layer_ids == draft.config.target_layer_ids
    batch = make_batch(recs[:3], feats, np.random.default_rng(1), 8, 4, draft.config.mask_token_id,
                       index_map(None, draft.config.vocab_size), feature_scale=scale)
    small = training_logits(draft, batch.features, batch.block_ids, batch.anchors)
    big = training_logits(grown, batch.features, batch.block_ids, batch.anchors)
    np.testing.assert_allclose(np.array(big), np.array(small), rtol=1e-5, atol=1e-5)
    # The new layers start as copies of the last trained ones, minus their output matrices.
    src = draft.layers[{3: 1, 4: 1, 5: 0}[layers]]  # the last `extra` layers in order, cycled past 2
    np.testing.assert_array_equal(np.array(grown.layers[-1].self_attn.q_proj.weight),
                                  np.array(src.self_attn.q_proj.weight))
    assert not np.any(np.array(grown.layers[-1].self_attn.o_proj.weight))
    assert not np.any(np.array(grown.layers[-1].mlp.down_proj.weight))
    # ... and they learn: one step moves their output matrices off zero.
    tc = TrainConfig(steps=1, batch_tokens=256, blocks_per_seq=8, lr=1e-3, warmup=0.0, eval_every=0,
                     log_every=10**6)
    Trainer(grown, recs, [], feats, tc, tmp_path / "grown", log=lambda s: None, feature_scale=scale).train()
    assert np.any(np.array(grown.layers[-1].self_attn.o_proj.weight))
    assert np.any(np.array(grown.layers[-1].mlp.down_proj.weight))


def test_grow_refuses_fewer_layers(setup, tmp_path):
    draft, _, _ = _trained_draft(setup, tmp_path, steps=1)
    with pytest.raises(ValueError, match="--layers"):
        grow_draft(draft, 1)


def test_dropout_is_training_only_and_random(setup, tmp_path):
    _, tok, target, recs = setup
    draft, feats, scale = _trained_draft(setup, tmp_path, steps=1)
    batch = make_batch(recs[:2], feats, np.random.default_rng(0), 8, 4, draft.config.mask_token_id,
                       index_map(None, draft.config.vocab_size), feature_scale=scale)
    plain = np.array(training_logits(draft, batch.features, batch.block_ids, batch.anchors))
    np.testing.assert_array_equal(plain, np.array(training_logits(draft, batch.features, batch.block_ids,
                                                                  batch.anchors, dropout=0.0)))
    a = np.array(training_logits(draft, batch.features, batch.block_ids, batch.anchors, dropout=0.2))
    b = np.array(training_logits(draft, batch.features, batch.block_ids, batch.anchors, dropout=0.2))
    assert not np.allclose(a, plain) and not np.allclose(a, b)
    # the expectation is kept: dropped units are rescaled, so the logits stay close on average
    assert abs(np.mean(a) - np.mean(plain)) < 0.25 * np.std(plain)


def test_grown_draft_adopts_the_trained_runs_adam_moments(setup, trained, tmp_path):
    from mlx.utils import tree_flatten

    _, tok, target, recs = setup
    draft, feats, scale, run = trained  # its checkpoint: run/small/checkpoint
    grown = grow_draft(draft, 4)
    tc = TrainConfig(steps=1, batch_tokens=256, blocks_per_seq=8, lr=1e-3, eval_every=0, log_every=10**6)
    tr = Trainer(grown, recs, [], feats, tc, tmp_path / "grown", log=lambda s: None, feature_scale=scale)
    n = tr.adopt_moments(run / "small" / "checkpoint")
    saved = mx.load(str(run / "small" / "checkpoint" / "optimizer.safetensors"))
    state = dict(tree_flatten(tr.optimizer.state))
    old = [k for k in state if k.endswith((".m", ".v")) and not k.startswith(("layers.2.", "layers.3."))]
    assert n == len(old) > 0
    for k in old:
        np.testing.assert_array_equal(np.array(state[k]), np.array(saved[k]))
    new = [k for k in state if k.startswith(("layers.2.", "layers.3.")) and k.endswith((".m", ".v"))]
    assert new and all(not np.any(np.array(state[k])) for k in new)
    # the schedule is this run's: its step count is not taken over
    assert int(saved["step"].item()) == 30 and int(state["step"].item()) == 0


def test_default_taps_stay_inside_a_small_target():
    """z-lab's spread skips the first and last layers; on a target of 1 or 2 layers it ran below
    layer 0 ([-1, 0, 1] for 2), which the draft's config then refused."""
    from dflash_mlx.models.draft.config import default_target_layer_ids

    for layers in range(1, 8):
        for draft_layers in (1, 2, 4, 5):
            taps = default_target_layer_ids(layers, draft_layers)
            assert len(taps) == draft_layers and all(0 <= t < layers for t in taps), (layers, taps)
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # z-lab's Qwen3-8B drafts
