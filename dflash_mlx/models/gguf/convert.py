"""GGUF tensors and metadata -> an mlx-lm model: config, names, and llama.cpp's layout undone.

The config comes from the GGUF metadata (plus what llama.cpp does not store,
e.g. Gemma 3's layer pattern); tensor names map to mlx-lm's; llama.cpp's Q/K
row permutation (llama) and Gemma's stored `1 + w` norm scales are undone; a
`rope_freqs` tensor (Llama 3.1) becomes explicit per-pair RoPE frequencies.
gpt-oss and any architecture not in `SUPPORTED_ARCHS` are refused.
"""

from typing import Optional

import numpy as np

from dflash_mlx.models.gguf.reader import GGUFError, GGUFFile, tensor_to_mlx, tensor_to_numpy

SUPPORTED_ARCHS = ("llama", "gemma3", "qwen2", "qwen3", "qwen3moe")
_MODEL_TYPES = {"llama": "llama", "gemma3": "gemma3_text", "qwen2": "qwen2", "qwen3": "qwen3",
                "qwen3moe": "qwen3_moe"}
_ALTERNATIVE = "convert the Hugging Face checkpoint with mlx_lm.convert and pass the folder instead"


# ----------------------------------------------------------------------------- config


def model_config(gf: GGUFFile) -> dict:
    """An HF/mlx-lm style config dict from GGUF metadata."""
    arch = gf.architecture
    if arch == "gpt-oss":
        # gguf.quants dequantizes MXFP4, but the attention sinks, expert biases,
        # YaRN RoPE and the fused/split expert layouts of llama.cpp's converter are
        # not mapped or tested here: refuse rather than load a subtly wrong model.
        raise GGUFError(
            f"{gf.path}: gpt-oss GGUF files are not supported (MXFP4 experts, attention sinks "
            f"and YaRN RoPE are not mapped); {_ALTERNATIVE}"
        )
    if arch not in SUPPORTED_ARCHS:
        raise GGUFError(
            f"{gf.path}: architecture {arch!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_ARCHS)}); {_ALTERNATIVE}"
        )
    tokens = gf.metadata.get("tokenizer.ggml.tokens")
    vocab = int(gf.arch_key("vocab_size", len(tokens) if tokens is not None else 0))
    if not vocab:
        emb = gf.tensors.get("token_embd.weight")
        vocab = emb.shape[0] if emb else 0

    def need(key):
        v = gf.arch_key(key)
        if v is None:
            raise GGUFError(f"{gf.path}: metadata key {arch}.{key} missing")
        return int(v) if not isinstance(v, float) else v

    n_heads = need("attention.head_count")
    hidden = need("embedding_length")
    n_layers = need("block_count")
    if arch == "qwen3moe" and gf.arch_key("feed_forward_length") is None:
        ffn = need("expert_feed_forward_length")  # only used by dense layers, if any
    else:
        ffn = need("feed_forward_length")
    cfg = {
        "model_type": _MODEL_TYPES[arch],
        "hidden_size": hidden,
        "num_hidden_layers": n_layers,
        "intermediate_size": ffn,
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(gf.arch_key("attention.head_count_kv", n_heads)),
        "rms_norm_eps": float(need("attention.layer_norm_rms_epsilon")),
        "vocab_size": vocab,
        "max_position_embeddings": int(gf.arch_key("context_length", 2048)),
        "rope_theta": float(gf.arch_key("rope.freq_base", 10000.0)),
        "head_dim": int(gf.arch_key("attention.key_length", hidden // n_heads)),
    }
    eos = gf.metadata.get("tokenizer.ggml.eos_token_id")
    if eos is not None:
        cfg["eos_token_id"] = int(eos)
    bos = gf.metadata.get("tokenizer.ggml.bos_token_id")
    if bos is not None:
        cfg["bos_token_id"] = int(bos)
    cfg["tie_word_embeddings"] = "output.weight" not in gf.tensors
    scale = gf.arch_key("rope.scaling.type")
    if scale == "linear":
        cfg["rope_scaling"] = {"type": "linear", "factor": float(gf.arch_key("rope.scaling.factor", 1.0))}
    elif scale not in (None, "none"):
        raise GGUFError(f"{gf.path}: rope scaling {scale!r} is not supported")
    if arch == "gemma3":
        # The GGUF stores the sliding window but not the layer pattern, the local
        # RoPE base or the query scale; these are Gemma 3's published values and
        # mlx-lm's defaults (checked against llama.cpp in tests/test_reference_llamacpp.py).
        cfg["sliding_window"] = int(gf.arch_key("attention.sliding_window", 512))
        cfg["sliding_window_pattern"] = 6
        cfg["rope_local_base_freq"] = 10000.0
        cfg["query_pre_attn_scalar"] = cfg["head_dim"]
    if arch == "qwen3moe":
        cfg["num_experts"] = need("expert_count")
        cfg["num_experts_per_tok"] = need("expert_used_count")
        cfg["moe_intermediate_size"] = need("expert_feed_forward_length")
        # llama.cpp's qwen3moe graph always renormalizes the top-k weights and its
        # converter writes no key for it (all released Qwen3-MoE set norm_topk_prob).
        cfg["norm_topk_prob"] = True
        # llama.cpp makes every layer sparse; a layer without a router is a dense
        # MLP layer (mlx-lm's mlp_only_layers), so step 1 and the list say it all.
        cfg["decoder_sparse_step"] = 1
        cfg["mlp_only_layers"] = [
            i for i in range(n_layers) if f"blk.{i}.ffn_gate_inp.weight" not in gf.tensors
        ]
    return cfg


# ----------------------------------------------------------------------------- weights

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_ARCH_LAYER_NAMES = {
    "llama": {"ffn_norm": "post_attention_layernorm"},
    "qwen2": {"ffn_norm": "post_attention_layernorm"},
    "qwen3": {"ffn_norm": "post_attention_layernorm"},
    "qwen3moe": {
        "ffn_norm": "post_attention_layernorm",
        # router and stacked experts, [n_expert, out, in] as SwitchGLU holds them
        "ffn_gate_inp": "mlp.gate",
        "ffn_gate_exps": "mlp.switch_mlp.gate_proj",
        "ffn_up_exps": "mlp.switch_mlp.up_proj",
        "ffn_down_exps": "mlp.switch_mlp.down_proj",
    },
    "gemma3": {
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
}


def hf_name(arch: str, gguf_name: str) -> Optional[str]:
    """The mlx-lm parameter name for a GGUF tensor name (None: not a model weight)."""
    top = {
        "token_embd.weight": "model.embed_tokens.weight",
        "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight",
    }
    if gguf_name in top:
        return top[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk":
        names = {**_LAYER_NAMES, **_ARCH_LAYER_NAMES.get(arch, {})}
        if parts[2] in names:
            return f"model.layers.{parts[1]}.{names[parts[2]]}.{parts[3]}"
    return None


def unpermute_rows(w, n_heads: int):
    """Undo llama.cpp's Q/K row permutation (its RoPE pairs adjacent dims; HF's
    and mlx-lm's pair dim i with i + d/2)."""
    out_dim = w.shape[0]
    return (
        w.reshape(n_heads, out_dim // n_heads // 2, 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def convert_tensor(gf: GGUFFile, cfg: dict, name: str, w):
    """A dequantized tensor (numpy or MLX) in mlx-lm's layout."""
    arch = gf.architecture
    if arch == "llama":  # only llama.cpp's LlamaModel converter permutes
        if name.endswith("attn_q.weight"):
            w = unpermute_rows(w, cfg["num_attention_heads"])
        elif name.endswith("attn_k.weight"):
            w = unpermute_rows(w, cfg["num_key_value_heads"])
    elif arch == "gemma3" and name.endswith("norm.weight"):
        # llama.cpp stores Gemma's RMSNorm scale as 1 + w; mlx-lm adds the 1 itself.
        w = w - 1.0
    return w


# ----------------------------------------------------------------------------- model


def load_gguf_model(gf: GGUFFile, dtype=None, progress=None):
    """Build the mlx-lm model for a parsed GGUF file, weights dequantized to `dtype`."""
    import mlx.core as mx
    from mlx_lm.utils import _get_classes

    cfg = model_config(gf)
    model_class, args_class = _get_classes(cfg)
    model = model_class(args_class.from_dict(cfg))
    dtype = dtype or mx.float32
    data = np.memmap(gf.path, dtype=np.uint8, mode="r")
    names = [n for n in gf.tensors if hf_name(gf.architecture, n) is not None]
    weights = {}
    for i, name in enumerate(names):
        # one tensor evaluated at a time: the file's bytes and float32 copies never pile up
        weight = convert_tensor(gf, cfg, name, tensor_to_mlx(gf, name, data)).astype(dtype)
        mx.eval(weight)
        weights[hf_name(gf.architecture, name)] = weight
        if progress:
            progress(i + 1, len(names))
    if hasattr(model, "sanitize"):
        weights = model.sanitize(weights)
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        raise GGUFError(f"{gf.path}: weights do not match the {cfg['model_type']} model: {e}") from None
    if "rope_freqs.weight" in gf.tensors:
        _apply_rope_freqs(model, cfg, tensor_to_numpy(gf, "rope_freqs.weight", data))
    mx.eval(model.parameters())
    model.eval()
    return model, cfg


def _freq_rope_class():
    import mlx.core as mx
    import mlx.nn as nn

    class FreqRoPE(nn.Module):
        """RoPE with explicit per-pair frequencies (llama.cpp's `rope_freqs`
        tensor, written for Llama 3.1-style scaling instead of config values).

        llama.cpp divides each pair's angle by its factor, so the
        wavelength-like `freqs` mx.fast.rope takes are base^(2i/d) * factor.
        """

        def __init__(self, dims, base, factors):
            super().__init__()
            self.dims = dims
            # underscore: a constant, not a parameter
            self._freqs = (base ** (mx.arange(0, dims, 2, dtype=mx.float32) / dims)) * mx.array(factors)

        def __call__(self, x, offset=0):
            return mx.fast.rope(x, self.dims, traditional=False, base=None, scale=1.0,
                                offset=offset, freqs=self._freqs)

    return FreqRoPE


def _apply_rope_freqs(model, cfg, factors):
    head_dim = cfg["head_dim"]
    if factors.shape != (head_dim // 2,):
        raise GGUFError(f"rope_freqs has shape {factors.shape}, expected ({head_dim // 2},)")
    rope = _freq_rope_class()(head_dim, cfg["rope_theta"], factors.astype(np.float32))
    for layer in model.layers:
        layer.self_attn.rope = rope
    # config.json cannot express these frequencies; export refuses such models.
    model.gguf_rope_freqs = True
