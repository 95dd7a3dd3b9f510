"""z-lab's draft format, written (what `dflash_mlx.load_draft` reads) and read back
(`--init-from`: an exported draft's weights, with the feature scale taken back out of `fc`)."""

import json
from pathlib import Path

import numpy as np
import torch

from .recipe import DRAFTS_DIR, log

BODY = ("layers.", "fc.", "hidden_norm.", "norm.")


def export_zlab(draft, out, taps, mask_id, vocab, scale, num_target_layers, args, info, dtype=torch.bfloat16):
    """z-lab's layout: config.json, safetensors shards (bf16), draft_vocab.npy."""
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.safetensors"):
        old.unlink()
    tl = draft.config.transformer_layer_config
    rope = getattr(tl, "rope_parameters", None) or {}
    cfg = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3",
        "hidden_size": tl.hidden_size, "num_hidden_layers": tl.num_hidden_layers,
        "num_attention_heads": tl.num_attention_heads, "num_key_value_heads": tl.num_key_value_heads,
        "head_dim": tl.head_dim, "intermediate_size": tl.intermediate_size, "vocab_size": tl.vocab_size,
        "rms_norm_eps": tl.rms_norm_eps, "rope_theta": float(rope.get("rope_theta", getattr(tl, "rope_theta", 1e6))),
        "max_position_embeddings": tl.max_position_embeddings, "block_size": args.block_size,
        "num_target_layers": num_target_layers, "layer_types": list(tl.layer_types),
        "dflash_config": {"target_layer_ids": list(taps), "mask_token_id": int(mask_id)},
    }
    body = {k: v.detach().float().cpu() for k, v in draft.state_dict().items() if k.startswith(BODY)}
    body["fc.weight"] = body["fc.weight"] * torch.from_numpy(scale)[None, :]  # preconditioning folded in
    shards, cur, size = [], {}, 0
    for k in sorted(body):
        t = body[k].to(dtype).contiguous()
        if cur and size + t.numel() * t.element_size() > args.shard_mb * 2**20:
            shards.append(cur)
            cur, size = {}, 0
        cur[k] = t
        size += t.numel() * t.element_size()
    shards.append(cur)
    for i, shard in enumerate(shards):
        save_file(shard, str(out / f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    if len(vocab) < tl.vocab_size:
        np.save(out / "draft_vocab.npy", np.asarray(vocab, dtype=np.int32))
    (out / "training.json").write_text(json.dumps(info, indent=2) + "\n")
    log(f"exported z-lab format to {out} ({len(shards)} shard(s))")


def read_exported(spec):
    """(config, weights, vocab or None) of an exported z-lab draft: a folder, or the name of
    a draft shipped in dflash_mlx/drafts/."""
    from safetensors.torch import load_file

    folder = Path(spec)
    if not (folder / "config.json").exists() and (DRAFTS_DIR / str(spec) / "config.json").exists():
        folder = DRAFTS_DIR / str(spec)
    if not (folder / "config.json").exists():
        raise SystemExit(f"--init-from {spec}: no exported draft there (config.json)")
    cfg = json.loads((folder / "config.json").read_text())
    weights = {}
    for f in sorted(folder.glob("*.safetensors")):
        weights.update(load_file(str(f)))
    vocab = np.load(folder / "draft_vocab.npy") if (folder / "draft_vocab.npy").exists() else None
    return cfg, weights, vocab


@torch.no_grad()
def load_exported_weights(draft, weights, scale):
    """Weights only: the body copied in, the export's folded feature scale divided back out
    of `fc` (the run's own scale, measured again, is applied to the features)."""
    state = draft.state_dict()
    missing = [k for k in state if k.startswith(BODY) and k not in weights]
    if missing:
        raise SystemExit(f"--init-from: the draft lacks {missing[:3]}... (a z-lab export of this layout?)")
    for k, v in weights.items():
        if k not in state or tuple(state[k].shape) != tuple(v.shape):
            raise SystemExit(f"--init-from: {k} {tuple(v.shape)} does not fit the draft")
        v = v.float()
        if k == "fc.weight":
            v = v / torch.from_numpy(scale)[None, :]
        state[k].copy_(v.to(state[k].dtype))
