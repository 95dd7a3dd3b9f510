"""speculators-format DFlash drafts load with `load_draft` and propose what the z-lab original does.

The fixtures (tests/fixtures/speculators/, made by its make_fixtures.py) hold a tiny
Qwen3 verifier, random z-lab drafts for it, and what speculators 0.9.0 itself made
of them: its converter's output (`speculators/`), a reduced-vocabulary checkpoint
saved by its `DFlashDraftModel` (`speculators-reduced/`), and transformers'
hidden states of the verifier at the converted draft's aux layer ids.
"""

import json
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from dflash_mlx import load_draft, stream_generate
from dflash_mlx.models.target.adapter import Target
from dflash_mlx.testing.targets import byte_tokenizer

FIX = Path(__file__).parent / "fixtures" / "speculators"
PROMPT = [72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100]



def features(model, layer_ids):
    t = Target(model)
    _, feats, _ = t.forward(mx.array([PROMPT]), t.make_cache(), layer_ids)
    return feats


def proposals(draft, feats):
    cache = draft.make_cache()
    logits = draft.propose_logits(mx.array([PROMPT[-1]]), feats, cache, 16)
    return logits, draft.to_target_ids(mx.argmax(logits, axis=-1))


def test_converter_shifts_layer_ids_by_one():
    """speculators' converter: aux ids = z-lab ids + 1; a draft reading the last layer does not convert."""
    zlab = json.loads((FIX / "zlab" / "config.json").read_text())
    spec = json.loads((FIX / "speculators" / "config.json").read_text())
    assert spec["aux_hidden_state_layer_ids"] == [i + 1 for i in zlab["dflash_config"]["target_layer_ids"]]
    notes = json.loads((FIX / "converter-notes.json").read_text())
    assert notes["zlab-last"]["converted"] is False and "fc.weight" in notes["zlab-last"]["error"]


def test_aux_ids_are_transformers_hidden_states(verifier):
    """What the ids mean: our features at z-lab ids = transformers' hidden_states[aux id] of the verifier."""
    draft = load_draft(str(FIX / "speculators"), verifier)
    aux = json.loads((FIX / "speculators" / "config.json").read_text())["aux_hidden_state_layer_ids"]
    hf = mx.load(str(FIX / "hf_hidden_states.safetensors"))
    ours = features(verifier, draft.config.target_layer_ids)[0]
    theirs = mx.concatenate([hf[f"hidden_states.{k}"] for k in aux], axis=-1)
    assert ours.shape == theirs.shape
    assert float(mx.abs(ours - theirs).max()) < 1e-3 * float(mx.abs(theirs).max())


@pytest.mark.parametrize("zlab,spec", [("zlab", "speculators"), ("zlab-reduced", "speculators-reduced")])
def test_same_proposals_as_the_zlab_original(verifier, zlab, spec):
    original = load_draft(str(FIX / zlab), verifier)
    converted = load_draft(str(FIX / spec), verifier)
    assert converted.config.target_layer_ids == original.config.target_layer_ids
    if original.vocab_ids is None:
        assert converted.vocab_ids is None
    else:
        assert converted.vocab_ids.tolist() == original.vocab_ids.tolist()
    feats = features(verifier, original.config.target_layer_ids)
    (la, ta), (lb, tb) = proposals(original, feats), proposals(converted, feats)
    assert mx.array_equal(la, lb) and ta.tolist() == tb.tolist()
    # and the engine (every front end's path) runs the converted draft the same way
    tok = byte_tokenizer()
    runs = [list(stream_generate(verifier, d, tok, PROMPT, max_tokens=20, block_size=16)) for d in (original, converted)]
    assert [r.tokens for r in runs[0]] == [r.tokens for r in runs[1]]
    assert runs[0][-1].accept_lengths == runs[1][-1].accept_lengths


def _broken(tmp_path, name="speculators-reduced", cfg_edit=None, weights_edit=None):
    out = tmp_path / "draft"
    shutil.copytree(FIX / name, out)
    if cfg_edit:
        cfg = json.loads((out / "config.json").read_text())
        cfg_edit(cfg)
        (out / "config.json").write_text(json.dumps(cfg))
    if weights_edit:
        w = mx.load(str(out / "model.safetensors"))
        weights_edit(w)
        mx.save_safetensors(str(out / "model.safetensors"), w)
    return str(out)


def _other_head(w):
    w["lm_head.weight"] = mx.array(np.random.default_rng(0).standard_normal(w["lm_head.weight"].shape), mx.float16)


BROKEN = {
    "missing key": (dict(cfg_edit=lambda c: c.pop("aux_hidden_state_layer_ids")), "'aux_hidden_state_layer_ids'"),
    "no mask token": (dict(cfg_edit=lambda c: c.pop("mask_token_id")), "'mask_token_id'"),
    "id 0": (dict(cfg_edit=lambda c: c.update(aux_hidden_state_layer_ids=[0, 3])), "embedding output"),
    "id out of range": (dict(cfg_edit=lambda c: c.update(aux_hidden_state_layer_ids=[1, 4])), "out of range"),
    "another target's vocabulary": (
        dict(cfg_edit=lambda c: c["transformer_layer_config"].update(vocab_size=500)), "made for another target"),
    "another target's head": (dict(weights_edit=_other_head), "made for another target"),
    "reduced without d2t": (dict(weights_edit=lambda w: w.pop("d2t")), "'d2t'"),
    "t2d disagrees": (dict(weights_edit=lambda w: w.update(t2d=mx.roll(w["t2d"], 1))), "'t2d'"),
    "other model type": (dict(cfg_edit=lambda c: c.update(speculators_model_type="eagle3")), "speculators_model_type"),
    "anchor sampling": (dict(cfg_edit=lambda c: c.update(sample_from_anchor=True)), "sample_from_anchor"),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_malformed_config_is_one_line(verifier, tmp_path, case):
    edits, words = BROKEN[case]
    with pytest.raises(ValueError) as e:
        load_draft(_broken(tmp_path, **edits), verifier)
    msg = str(e.value)
    assert words in msg and "\n" not in msg and "speculators draft" in msg


def test_verifier_tensors_stored_with_the_draft_are_checked_then_dropped(verifier, tmp_path):
    """Older speculators checkpoints carry the verifier's embedding/head/norm: the target's own load
    (and change nothing), another model's are refused."""
    vw = mx.load(str(FIX / "verifier" / "model.safetensors"))

    def add_verifier(w):
        w["embed_tokens.weight"] = vw["model.embed_tokens.weight"]
        w["verifier_lm_head.weight"] = w["lm_head.weight"]
        w["verifier_norm.weight"] = vw["model.norm.weight"]

    draft = load_draft(_broken(tmp_path, weights_edit=add_verifier), verifier)
    feats = features(verifier, draft.config.target_layer_ids)
    original = load_draft(str(FIX / "speculators-reduced"), verifier)
    assert mx.array_equal(proposals(draft, feats)[0], proposals(original, feats)[0])

    def other_embedding(w):
        add_verifier(w)
        w["embed_tokens.weight"] = mx.array(np.random.default_rng(1).standard_normal((300, 64)), mx.float16)

    with pytest.raises(ValueError, match="embed_tokens.weight.*another target") as e:
        load_draft(_broken(tmp_path / "x", weights_edit=other_embedding), verifier)
    assert "\n" not in str(e.value)
