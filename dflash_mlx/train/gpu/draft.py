"""The target (an HF folder, a hub id, a .gguf file or a packaged name) and the draft:
speculators' DFlashDraftModel initialised from the target as the recipe does."""

from pathlib import Path

import numpy as np
import torch

from .data import Taps, target_features
from .recipe import PACKAGED, packaged_gguf


def load_target(spec, device, dtype):
    """(model, tokenizer). A .gguf file (or a packaged name: its shipped GGUF) loads through
    transformers' `gguf_file=` (dequantized; needs `gguf`); the GGUF quantizer is then
    dropped so the model can be saved like any other (`save_pretrained`)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = packaged_gguf(spec) if spec in PACKAGED else (Path(spec) if str(spec).endswith(".gguf") else None)
    if spec in PACKAGED and gguf is None:
        spec = PACKAGED[spec][2]  # the package is missing: the same model from the hub
    if gguf is not None:
        kw = dict(gguf_file=gguf.name)
        tok = AutoTokenizer.from_pretrained(gguf.parent, **kw)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=dtype, **kw)
        model.hf_quantizer = None
        for cfg in (model.config, getattr(model.config, "text_config", None)):
            if cfg is not None and hasattr(cfg, "quantization_config"):
                delattr(cfg, "quantization_config")
    else:
        tok = AutoTokenizer.from_pretrained(spec)
        model = AutoModelForCausalLM.from_pretrained(spec, dtype=dtype)
    model = model.to(device).eval()
    for q in model.parameters():
        q.requires_grad_(False)
    return model, tok


def feature_scale(model, records, taps, device, n=32):
    """Per-dimension 1/RMS of the tapped features over `n` records (the first position left out)."""
    docs = [r["prompt"] + r["response"] for r in records[:n]]
    feats, _ = target_features(model, docs, taps, device, torch.float32)
    sq, count = None, 0
    for f in torch.split(feats, [len(d) for d in docs]):
        f = f[1:].double().cpu()
        sq = f.pow(2).sum(0) if sq is None else sq + f.pow(2).sum(0)
        count += f.shape[0]
    return (1.0 / np.maximum(np.sqrt(sq.numpy() / max(count, 1)), 1e-3)).astype(np.float32)


def build_draft(model, cfg_t, args, taps, copy, mask_id, vocab, scale, sample, device):
    """speculators' DFlashDraftModel, initialised from the target as our recipe does."""
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import Qwen3Config

    H, V = cfg_t.hidden_size, cfg_t.vocab_size
    heads = cfg_t.num_attention_heads
    head_dim = getattr(cfg_t, "head_dim", None) or H // heads
    rope = getattr(cfg_t, "rope_parameters", None) or {"rope_type": "default",
                                                       "rope_theta": getattr(cfg_t, "rope_theta", 10000.0)}
    layer_cfg = Qwen3Config(hidden_size=H, num_hidden_layers=args.layers, num_attention_heads=heads,
                            num_key_value_heads=getattr(cfg_t, "num_key_value_heads", heads), head_dim=head_dim,
                            intermediate_size=cfg_t.intermediate_size, vocab_size=V,
                            rms_norm_eps=cfg_t.rms_norm_eps, rope_parameters=dict(rope),
                            max_position_embeddings=cfg_t.max_position_embeddings,
                            layer_types=["full_attention"] * args.layers)
    layer_cfg._attn_implementation = "simple_flex_attention" if device.type == "cuda" else "eager"
    config = DFlashSpeculatorConfig(
        transformer_layer_config=layer_cfg, draft_vocab_size=len(vocab), block_size=args.block_size,
        aux_hidden_state_layer_ids=[i + 1 for i in taps], mask_token_id=mask_id,
        speculators_config=SpeculatorsConfig(
            algorithm="dflash", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=args.block_size - 1)],
            default_proposal_method="greedy", verifier=VerifierConfig(name_or_path=None, architectures=[])))
    draft = DFlashDraftModel(config=config)
    ids = torch.tensor(vocab, dtype=torch.long)
    if len(vocab) < V:
        t2d = torch.zeros(V, dtype=torch.bool)
        t2d[ids] = True
        draft.load_vocab_mappings(t2d, ids - torch.arange(len(vocab)))
    emb = model.get_input_embeddings().weight.detach().float().cpu()
    head = model.get_output_embeddings().weight.detach().float().cpu()[ids]
    with torch.no_grad():
        draft.embed_tokens.weight.copy_(emb)
        draft.lm_head.weight.copy_(head)
        draft.verifier_lm_head.weight.copy_(head)
        draft.verifier_norm.weight.copy_(model.model.norm.weight.detach().float().cpu())
        if sample is not None:
            init_from_target(draft, model, copy, taps, scale, sample, head_dim)
    # the exported draft borrows the target's embedding and head (z-lab's format has neither):
    # train what is exported, nothing else
    for m in (draft.embed_tokens, draft.lm_head, draft.verifier_lm_head, draft.verifier_norm):
        m.weight.requires_grad_(False)
    return draft


@torch.no_grad()
def init_from_target(draft, model, copy, taps, scale, sample, head_dim):
    """dflash_mlx.train.init.init_from_target, in torch."""
    tl_all = model.model.layers
    for dl, li in zip(draft.layers, copy):
        src = dict(tl_all[li].named_parameters())
        for name, p in dl.named_parameters():
            if name in src and tuple(src[name].shape) == tuple(p.shape):
                p.copy_(src[name].detach().float().cpu())
        if "self_attn.q_norm.weight" not in src:  # the draft normalizes q/k: start at the target's typical RMS
            x = target_layer_input(model, li, sample)
            attn = tl_all[li].self_attn
            for proj, norm in ((attn.q_proj, dl.self_attn.q_norm), (attn.k_proj, dl.self_attn.k_norm)):
                y = proj(tl_all[li].input_layernorm(x)).float()
                y = y.reshape(*y.shape[:-1], -1, head_dim)[:, 1:]
                norm.weight.fill_(float(y.pow(2).mean(-1).sqrt().median()))
    feed = copy[0] - 1
    H = draft.fc.weight.shape[0]
    if feed in taps:
        j = taps.index(feed)
        w = torch.zeros_like(draft.fc.weight)
        w[:, j * H: (j + 1) * H] = torch.diag(torch.from_numpy(1.0 / scale[j * H: (j + 1) * H]).float())
        draft.fc.weight.copy_(w)
        draft.hidden_norm.weight.copy_(tl_all[copy[0]].input_layernorm.weight.detach().float().cpu())
    draft.norm.weight.copy_(model.model.norm.weight.detach().float().cpu())


@torch.no_grad()
def target_layer_input(model, li, sample):
    ids = torch.tensor([sample], device=model.device)
    if li == 0:
        return model.get_input_embeddings()(ids)
    with Taps(model.model.layers, [li - 1]) as t:
        model.model(input_ids=ids)
    return t.out[li - 1]
