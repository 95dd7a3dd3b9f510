"""Write tiny GGUF files the way llama.cpp's converter does, for fast loader tests.

The conversions applied here are llama.cpp's (convert_hf_to_gguf.py): llama Q/K
rows permuted for its RoPE layout, Gemma norms stored as 1 + w, Qwen3-MoE experts
stacked as [n_expert, out, in] with the router kept in F32. Loading one of these
files must give back the original model exactly.
"""

import numpy as np

from dflash_mlx.models.loading import load as _load  # bound now: tests may patch loading.load
from dflash_mlx.testing.targets import tiny_target

LLAMA = dict(layer_types=None, sliding_window=None, tie_word_embeddings=False)
# llama.cpp fixes Gemma 3's sliding pattern at 6 and the query scale at head_dim^-0.5.
GEMMA3 = dict(num_hidden_layers=6, sliding_window_pattern=6, sliding_window=8, query_pre_attn_scalar=16)
QWEN2 = dict(model_type="qwen2", hidden_size=64, num_hidden_layers=4, intermediate_size=128,
             num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
             max_position_embeddings=4096, rope_theta=10000.0, tie_word_embeddings=False)
# Qwen3-MoE (Qwen3-30B-A3B's shape, shrunk): every layer sparse, top-k renormalized.
QWEN3MOE = dict(model_type="qwen3_moe", hidden_size=64, num_hidden_layers=3, intermediate_size=128,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
                num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1,
                mlp_only_layers=[], norm_topk_prob=True, rms_norm_eps=1e-6,
                max_position_embeddings=4096, rope_theta=10000.0, tie_word_embeddings=False)


def byte_vocab():
    """A byte-level BPE vocabulary (GPT-2 alphabet), two specials, one merge."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    alphabet = list(bytes_to_unicode().values())
    tokens = alphabet + ["<bos>", "<eos>", "\u0120t"]
    types = [1] * 256 + [3, 3, 1]
    return tokens, types, ["\u0120 t"]


def permute_rows(w, n_heads):
    """llama.cpp's permutation (the inverse of convert.unpermute_rows)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_name(hf: str, arch: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if hf in top:
        return top[hf]
    parts = hf.split(".")
    layer, rest = parts[2], ".".join(parts[3:-1])
    names = {
        "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
        "self_attn.k_norm": "attn_k_norm", "input_layernorm": "attn_norm",
        "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
        "post_attention_layernorm": "ffn_norm", "pre_feedforward_layernorm": "ffn_norm",
        "post_feedforward_layernorm": "post_ffw_norm",
        "mlp.gate": "ffn_gate_inp", "mlp.switch_mlp.gate_proj": "ffn_gate_exps",
        "mlp.switch_mlp.up_proj": "ffn_up_exps", "mlp.switch_mlp.down_proj": "ffn_down_exps",
    }
    if arch == "gemma3":
        names["post_attention_layernorm"] = "post_attention_norm"
    name = names[rest]
    return f"blk.{layer}.{name}.{parts[-1]}"


def tiny_qwen2(seed=0, **overrides):
    import mlx.core as mx
    from mlx_lm.models import qwen2

    mx.random.seed(seed)
    model = qwen2.Model(qwen2.ModelArgs.from_dict(dict(QWEN2, **overrides)))
    model.set_dtype(mx.float32)  # random q/k/v biases too: the bias mapping is checked
    mx.eval(model.parameters())
    return model.eval()


def tiny_qwen3moe(seed=0, **overrides):
    import mlx.core as mx
    from mlx_lm.models import qwen3_moe

    mx.random.seed(seed)
    model = qwen3_moe.Model(qwen3_moe.ModelArgs.from_dict(dict(QWEN3MOE, **overrides)))
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    return model.eval()


def write_tiny_gguf(path, arch="llama", seed=0, qtype=None, arch_name=None, version=None,
                    rope_freqs=None, chat_template=None, exact_quant=False, **overrides):
    """Write a tiny random model as GGUF; returns the mlx-lm model it came from.

    `rope_freqs`: per-pair RoPE divisors written as llama.cpp's `rope_freqs`
    tensor (Llama 3.1 style); the returned model uses them too.
    `exact_quant`: with `qtype`, the returned model holds the weights as the
    reference `gguf.quants` dequantizes them, so loading must match it exactly.
    """
    import gguf
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten

    tokens, types, merges = byte_vocab()
    if arch == "qwen2":
        model = tiny_qwen2(seed, vocab_size=len(tokens), **overrides)
    elif arch == "qwen3moe":
        model = tiny_qwen3moe(seed, vocab_size=len(tokens), **overrides)
    else:
        mlx_arch = {"llama": "llama", "gemma3": "gemma3_text", "qwen3": "qwen3"}.get(arch, "llama")
        base = {"llama": LLAMA, "gemma3_text": GEMMA3, "qwen3": {}}[mlx_arch]
        cfg = dict(base, **overrides)
        cfg.setdefault("vocab_size", len(tokens))
        model, _ = tiny_target(mlx_arch, seed=seed, **cfg)
    a = model.args
    w = gguf.GGUFWriter(str(path), arch_name or arch)
    p = arch_name or arch
    w.add_uint32(f"{p}.block_count", a.num_hidden_layers)
    w.add_uint32(f"{p}.context_length", a.max_position_embeddings)
    w.add_uint32(f"{p}.embedding_length", a.hidden_size)
    w.add_uint32(f"{p}.feed_forward_length", a.intermediate_size)
    w.add_uint32(f"{p}.attention.head_count", a.num_attention_heads)
    w.add_uint32(f"{p}.attention.head_count_kv", a.num_key_value_heads)
    w.add_float32(f"{p}.rope.freq_base", float(a.rope_theta))
    w.add_float32(f"{p}.attention.layer_norm_rms_epsilon", float(a.rms_norm_eps))
    head_dim = getattr(a, "head_dim", None) or a.hidden_size // a.num_attention_heads
    if arch == "qwen3moe":  # llama.cpp's Qwen2MoeModel.set_gguf_parameters
        w.add_uint32(f"{p}.expert_count", a.num_experts)
        w.add_uint32(f"{p}.expert_used_count", a.num_experts_per_tok)
        w.add_uint32(f"{p}.expert_feed_forward_length", a.moe_intermediate_size)
    if arch in ("gemma3", "qwen3", "qwen3moe"):
        w.add_uint32(f"{p}.attention.key_length", head_dim)
        w.add_uint32(f"{p}.attention.value_length", head_dim)
    if arch == "gemma3":
        w.add_uint32(f"{p}.attention.sliding_window", a.sliding_window)
    else:
        w.add_uint32(f"{p}.rope.dimension_count", head_dim)
        w.add_uint32(f"{p}.vocab_size", a.vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(256)
    w.add_eos_token_id(257)
    w.add_add_bos_token(False)
    if chat_template is not None:
        w.add_chat_template(chat_template)
    if rope_freqs is not None:
        from dflash_mlx.models.gguf.convert import _apply_rope_freqs

        rope_freqs = np.asarray(rope_freqs, dtype=np.float32)
        w.add_tensor("rope_freqs.weight", rope_freqs)
        _apply_rope_freqs(model, {"head_dim": head_dim, "rope_theta": float(a.rope_theta)}, rope_freqs)
    dequantized = []
    for name, value in tree_flatten(model.parameters()):
        t = np.array(value, dtype=np.float32)
        if arch == "llama" and name.endswith("q_proj.weight"):
            t = permute_rows(t, a.num_attention_heads)
        elif arch == "llama" and name.endswith("k_proj.weight"):
            t = permute_rows(t, a.num_key_value_heads)
        elif arch == "gemma3" and name.endswith("norm.weight"):
            t = t + 1.0
        gname = gguf_name(name, arch)
        # llama.cpp keeps MoE routers (ffn_gate_inp) in F32; stacked experts are quantized
        if qtype is not None and t.ndim in (2, 3) and ".ffn_gate_inp." not in gname:
            q = gguf.quants.quantize(t, qtype)
            w.add_tensor(gname, q, raw_dtype=qtype)
            if exact_quant:
                deq = gguf.quants.dequantize(q, qtype).reshape(t.shape)
                if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
                    from dflash_mlx.models.gguf.convert import unpermute_rows

                    heads = a.num_attention_heads if "q_proj" in name else a.num_key_value_heads
                    deq = unpermute_rows(deq, heads)
                dequantized.append((name, mx.array(deq)))
        else:
            w.add_tensor(gname, t)
    if dequantized:
        model.update(tree_unflatten(dequantized))
        mx.eval(model.parameters())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    if version is not None:  # corrupt the version field on purpose
        with open(path, "r+b") as f:
            f.seek(4)
            f.write(int(version).to_bytes(4, "little"))
    return model


_PACKAGED = {}


def load_packaged(name):
    """Packaged models load once per test session (several test files use them)."""
    if name not in _PACKAGED:
        _PACKAGED[name] = _load(name, quiet=True)
    return _PACKAGED[name]
