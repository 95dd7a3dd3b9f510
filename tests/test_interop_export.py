"""`export-draft`: our drafts in the layouts other engines read, each checked by that reader's rules.

- zlab-full: z-lab's reference (`dflash` 0.1.0) loads it and computes what we compute.
- speculators: equal, tensor for tensor, to what speculators' own converter / model class
  wrote for the same draft (fixtures), and speculators' loader read our files into the
  same state dict (recorded in converter-notes.json when the fixtures were made).
- vllm: vLLM's `DFlashQwen3ForCausalLM` rules (draft_vocab_size, an lm_head of that many
  rows, d2t offsets scattered into the full vocabulary) applied by hand propose what we do.
"""

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from dflash_mlx import load_draft
from dflash_mlx.models.draft.checkpoints import expected_shapes
from dflash_mlx.cli.export_draft import ExportDraftError, _load_stored, export_draft
from dflash_mlx.models.target.adapter import Target

FIX = Path(__file__).parent / "fixtures" / "speculators"
PROMPT = [72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100]



def write_exports(folder, model, sources=("zlab", "zlab-reduced"), fmt="speculators"):
    """Our exports of the fixture drafts (how tests/fixtures/speculators/exports/ was made)."""
    t = Target(model)
    for src in sources:
        export_draft(_load_stored(str(FIX / src), t), Path(folder) / f"{src}-{fmt}", fmt, target=t,
                     verifier="verifier", verifier_architectures=["Qwen3ForCausalLM"], source=src,
                     target_name="verifier")


def hidden_and_proposals(draft, model):
    t = Target(model)
    _, feats, _ = t.forward(mx.array([PROMPT]), t.make_cache(), draft.config.target_layer_ids)
    h = draft.propose_hidden(mx.array([PROMPT[-1]]), feats, draft.make_cache(), 16)
    return h, draft.to_target_ids(mx.argmax(draft.logits(h), axis=-1))


def tensors(folder):
    return mx.load(str(Path(folder) / "model.safetensors"))


def same_tensors(a, b):
    return sorted(a) == sorted(b) and all(a[k].dtype == b[k].dtype and mx.array_equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("src,theirs", [("zlab", "speculators"), ("zlab-reduced", "speculators-reduced")])
def test_speculators_export_is_what_speculators_writes(verifier, tmp_path, src, theirs):
    write_exports(tmp_path, verifier, sources=(src,))
    ours = tmp_path / f"{src}-speculators"
    assert same_tensors(tensors(ours), tensors(FIX / theirs))
    cfg, their_cfg = (json.loads((f / "config.json").read_text()) for f in (ours, FIX / theirs))
    for key in ("speculators_model_type", "aux_hidden_state_layer_ids", "draft_vocab_size", "block_size",
                "mask_token_id", "sample_from_anchor", "sliding_window_non_causal"):
        assert cfg[key] == their_cfg[key], key
    assert cfg["speculators_config"]["verifier"] == their_cfg["speculators_config"]["verifier"]
    tl, their_tl = cfg["transformer_layer_config"], their_cfg["transformer_layer_config"]
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                "intermediate_size", "vocab_size", "rms_norm_eps", "layer_types", "model_type"):
        assert tl[key] == their_tl[key], key
    # the committed exports (read by speculators' loader when the fixtures were made) are today's output
    assert same_tensors(tensors(ours), tensors(FIX / "exports" / ours.name))
    notes = json.loads((FIX / "converter-notes.json").read_text())[f"export:{ours.name}"]
    assert notes["loaded"] and notes["state_dict_equals_theirs"] and not notes["nan"]
    # and it loads back here, proposing what the original does
    _, a = hidden_and_proposals(load_draft(str(FIX / src), verifier), verifier)
    _, b = hidden_and_proposals(load_draft(str(ours), verifier), verifier)
    assert a.tolist() == b.tolist()


def test_speculators_export_refuses_a_draft_reading_the_last_layer(verifier, tmp_path):
    """speculators' converter fails on such a draft (its fc no longer fits): so does ours, with a reason."""
    t = Target(verifier)
    with pytest.raises(ExportDraftError, match="last layer"):
        export_draft(_load_stored(str(FIX / "zlab-last"), t), tmp_path / "x", "speculators", target=t,
                     verifier="verifier")
    assert not (tmp_path / "x").exists()


def test_zlab_full_loads_in_zlab_reference(verifier, tmp_path, monkeypatch):
    ref = pytest.importorskip("dflash.model_mlx", reason="z-lab's reference: pip install --no-deps dflash==0.1.0")
    monkeypatch.setattr(ref, "snapshot_download", lambda repo, **kw: repo)
    t = Target(verifier)
    reduced = _load_stored(str(FIX / "zlab-reduced"), t)
    out = export_draft(reduced, tmp_path / "full", "zlab-full", target=t)
    assert not (out / "draft_vocab.npy").exists()
    ours = load_draft(str(out), verifier)
    assert ours.vocab_ids is None
    theirs = ref.load_draft(str(out))
    theirs.set_dtype(mx.float32)
    theirs.bind(verifier)
    _, feats, _ = t.forward(mx.array([PROMPT]), t.make_cache(), ours.config.target_layer_ids)
    last = PROMPT[-1]
    logits = ours.propose_logits(mx.array([last]), feats, ours.make_cache(), 16)
    block = mx.array([[last] + [ours.config.mask_token_id] * 15])
    their_logits = theirs(block, feats, theirs.make_cache(), logits_start=1)
    assert logits.shape == their_logits.shape == (1, 15, 300)  # the whole vocabulary
    err = float(mx.abs(logits - their_logits).max() / mx.abs(their_logits).max())
    assert err < 1e-5


def vllm_logits(cfg, weights, hidden):
    """vLLM's DFlashQwen3ForCausalLM.compute_logits, by hand: the draft's own lm_head over
    draft_vocab_size rows, then scattered to target ids arange(n) + d2t, -inf elsewhere."""
    n, vocab = cfg.get("draft_vocab_size") or cfg["vocab_size"], cfg["vocab_size"]
    head = np.array(weights["lm_head.weight"].astype(mx.float32))
    assert head.shape == (n, cfg["hidden_size"])
    logits = np.array(hidden.astype(mx.float32)) @ head.T
    if n == vocab:
        return logits
    d2t = np.array(weights["d2t"])
    assert d2t.dtype == np.int64 and d2t.shape == (n,)
    full = np.full(logits.shape[:-1] + (vocab,), -np.inf, dtype=np.float32)
    full[..., np.arange(n) + d2t] = logits
    return full


def test_vllm_export_follows_vllm_rules(verifier, tmp_path):
    t = Target(verifier)
    reduced = _load_stored(str(FIX / "zlab-reduced"), t)
    out = export_draft(reduced, tmp_path / "vllm", "vllm", target=t)
    cfg, w = json.loads((out / "config.json").read_text()), tensors(out)
    assert cfg["draft_vocab_size"] == 64
    # body tensors keep z-lab's names (vLLM prefixes them with `model.`); t2d is not needed
    assert set(w) - {"lm_head.weight", "d2t"} == set(expected_shapes(reduced.config))
    ours = load_draft(str(FIX / "zlab-reduced"), verifier)
    h, proposed = hidden_and_proposals(ours, verifier)
    assert np.argmax(vllm_logits(cfg, w, h), axis=-1).tolist() == proposed.tolist()
    back = load_draft(str(out), verifier)  # and it loads here again
    assert back.vocab_ids.tolist() == ours.vocab_ids.tolist()
    assert hidden_and_proposals(back, verifier)[1].tolist() == proposed.tolist()
    # a full-vocabulary draft is written in z-lab's layout, which vLLM reads as it is
    full = export_draft(_load_stored(str(FIX / "zlab"), t), tmp_path / "vllm-full", "vllm", target=t)
    assert "draft_vocab_size" not in json.loads((full / "config.json").read_text())
    assert same_tensors(tensors(full), tensors(FIX / "zlab"))


def test_vllm_form_with_a_bad_map_is_one_line(verifier, tmp_path):
    t = Target(verifier)
    out = export_draft(_load_stored(str(FIX / "zlab-reduced"), t), tmp_path / "v", "vllm", target=t)
    w = tensors(out)
    w.pop("d2t")
    mx.save_safetensors(str(out / "model.safetensors"), w)
    with pytest.raises(ValueError, match="no 'd2t'") as e:
        load_draft(str(out), verifier)
    assert "\n" not in str(e.value)


@pytest.mark.slow
def test_cli_exports_the_shipped_draft(tmp_path, smollm2, monkeypatch):
    from dflash_mlx.cli.main import main
    from dflash_mlx.models import loading

    # the target each export loads is the session's (loaded once per process; read, never changed)
    real_load, asked = loading.load, []
    monkeypatch.setattr(loading, "load", lambda name, **kw: asked.append(name) or (
        smollm2 if name == "smollm2-135m" else real_load(name, **kw)))
    for fmt in ("vllm", "speculators", "zlab-full"):
        assert main(["export-draft", "smollm2-135m", str(tmp_path / fmt), "--format", fmt]) == 0
    assert asked == ["smollm2-135m"] * 3  # each export loaded the draft's own target
    model, _ = smollm2
    shipped = load_draft("smollm2-135m", model)
    for fmt in ("vllm", "speculators"):
        back = load_draft(str(tmp_path / fmt), model)
        assert back.vocab_ids.tolist() == shipped.vocab_ids.tolist()
        assert back.config.target_layer_ids == shipped.config.target_layer_ids
    spec = json.loads((tmp_path / "speculators" / "config.json").read_text())
    assert spec["aux_hidden_state_layer_ids"] == [i + 1 for i in shipped.config.target_layer_ids]
    assert spec["speculators_config"]["verifier"]["name_or_path"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
