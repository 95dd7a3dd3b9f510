"""Tiny float32 random-weight models of many mlx-lm 0.32.2 text architectures.

Used by tests that check DFlash speculative decoding is exactly lossless per architecture.
Every entry: vocab 300 (byte tokenizer of dflash_mlx.testing.targets), hidden 64, 3-4 layers; `build(key)`
gives a float32 eval-mode model whose greedy 24-token decode of random byte prompts (lengths 5 and
60) is varied (>= 8 distinct tokens for at least 7 of 8 checked prompts), deterministic, has a
top-2 logit gap > 1e-3 at almost every step, and takes ~0.1-0.6 s on 2 CPU cores once warm.
Knobs chosen per key to reach that: SEEDS (added to build's seed), EMBED_SCALE (token-embedding
factor, default 4.0 as in testing._scale_embeddings) and TWEAKS (param-suffix -> fn; used to undo
"copy the last token" collapse of tied models: small embedding x big final-norm gain, and to
sharpen random attention with q/k x3).  Paths below: m = build(key).

key              | kind              | make_cache() classes (per layer)             | len==layers | layers path                  | embedding path
-----------------|-------------------|----------------------------------------------|-------------|------------------------------|------------------------------
qwen3_moe        | MoE               | KVCache x4                                   | yes         | m.model.layers               | m.model.embed_tokens
qwen3_next       | hybrid+MoE        | ArraysCache, KVCache, ArraysCache, KVCache   | yes         | m.model.layers               | m.model.embed_tokens
qwen3_5_moe      | hybrid+MoE        | ArraysCache, KVCache, ArraysCache, KVCache   | yes         | m.language_model.model.layers| m.language_model.model.embed_tokens
gemma4_text_moe  | sliding+MoE       | RotatingKVCache, KVCache (x2)                | yes         | m.model.layers               | m.model.embed_tokens
gpt_oss          | sliding+MoE       | RotatingKVCache, KVCache (x2)                | yes         | m.model.layers               | m.model.embed_tokens
minimax          | MoE               | KVCache x4                                   | yes         | m.model.layers               | m.model.embed_tokens
kimi_k25         | MLA+MoE           | KVCache x4                                   | yes         | m.language_model.model.layers| m.language_model.model.embed_tokens
glm_moe_dsa      | MLA+MoE+DSA       | CacheList(KVCache, KVCache) x4 (latent, idx) | yes         | m.model.layers               | m.model.embed_tokens
qwen2            | dense             | KVCache x4                                   | yes         | m.model.layers               | m.model.embed_tokens
phi3             | dense             | KVCache x4                                   | yes         | m.model.layers               | m.model.embed_tokens
gemma            | dense (tied)      | KVCache x4                                   | yes         | m.model.layers               | m.model.embed_tokens
gemma2           | dense (tied)      | KVCache x4 (mlx-lm gemma2 has no sliding)    | yes         | m.model.layers               | m.model.embed_tokens
olmo2            | dense             | KVCache x4                                   | yes         | m.model.layers               | m.model.embed_tokens
granite          | dense             | KVCache x4                                   | yes         | m.model.layers               | m.model.embed_tokens
cohere           | dense (tied)      | KVCache x4                                   | yes         | m.model.layers               | m.model.embed_tokens
cohere2          | sliding (tied)    | RotatingKVCache, KVCache (x2)                | yes         | m.model.layers               | m.model.embed_tokens
exaone4          | sliding           | RotatingKVCache x3, KVCache                  | yes         | m.model.layers               | m.model.embed_tokens
starcoder2       | dense             | KVCache x4                                   | yes         | m.model.layers               | m.model.embed_tokens
internlm3        | dense             | KVCache x4                                   | yes         | m.model.layers               | m.model.embed_tokens
smollm3          | dense (NoPE 1/2)  | KVCache x4                                   | yes         | m.model.layers               | m.model.embed_tokens
ministral3       | sliding           | RotatingKVCache, KVCache (x2)                | yes         | m.model.layers               | m.model.embed_tokens
mixtral          | MoE               | KVCache x4                                   | yes         | m.model.layers               | m.model.embed_tokens
olmoe            | MoE               | KVCache x4                                   | yes         | m.model.layers               | m.model.embed_tokens
qwen2_moe        | MoE               | KVCache x4                                   | yes         | m.model.layers               | m.model.embed_tokens
granitemoe       | MoE               | KVCache x4                                   | yes         | m.model.layers               | m.model.embed_tokens
phimoe           | MoE               | KVCache x4                                   | yes         | m.model.layers               | m.model.embed_tokens
deepseek_v2      | MLA+MoE           | KVCache x4                                   | yes         | m.model.layers               | m.model.embed_tokens
deepseek_v3      | MLA+MoE           | KVCache x4                                   | yes         | m.model.layers               | m.model.embed_tokens
glm4_moe         | MoE               | KVCache x4                                   | yes         | m.model.layers               | m.model.embed_tokens
minicpm3         | MLA (dense)       | KVCache x4                                   | yes         | m.model.layers               | m.model.embed_tokens
glm4_moe_lite    | MLA+MoE           | KVCache x4                                   | yes         | m.model.layers               | m.model.embed_tokens
mimo_v2_flash    | sliding+MoE+sinks | KVCache, RotatingKVCache x2, KVCache         | yes         | m.model.layers               | m.model.embed_tokens
nemotron_h       | hybrid+MoE (M*ME) | ArraysCache, KVCache, ArraysCache            | NO (3 vs 4) | m.backbone.layers            | m.backbone.embeddings
falcon_h1        | hybrid (parallel) | CacheList(ArraysCache, KVCache) x4           | yes         | m.model.layers               | m.model.embed_tokens
granitemoehybrid | hybrid+MoE        | ArraysCache, KVCache, ArraysCache, KVCache   | yes         | m.model.layers               | m.model.embed_tokens
lfm2             | hybrid (tied)     | ArraysCache, KVCache, ArraysCache, KVCache   | yes         | m.model.layers               | m.model.embed_tokens
jamba            | hybrid+MoE        | ArraysCache, KVCache, ArraysCache, KVCache   | yes         | m.model.layers               | m.model.embed_tokens
plamo2           | hybrid            | ArraysCache, KVCache, ArraysCache, KVCache   | yes         | m.model.layers.layers        | m.model.embed_tokens
kimi_linear      | hybrid+MLA+MoE    | ArraysCache, KVCache, ArraysCache, KVCache   | yes         | m.model.layers               | m.model.embed_tokens
olmo_hybrid      | hybrid            | ArraysCache, KVCache, ArraysCache, KVCache   | yes         | m.model.layers               | m.model.embed_tokens
bailing_hybrid   | hybrid+MLA+MoE    | ArraysCache, KVCache, ArraysCache, KVCache   | yes         | m.model.layers               | m.model.word_embeddings
recurrent_gemma  | hybrid+sliding    | ArraysCache x2, RotatingKVCache, ArraysCache | yes         | m.model.layers               | m.model.embed_tokens
mamba2           | recurrent (SSM)   | ArraysCache x3                               | yes (3)     | m.backbone.layers            | m.backbone.embeddings
rwkv7            | recurrent         | ArraysCache x3                               | yes (3)     | m.model.layers               | m.model.embeddings
(m.layers exists on every model; for plamo2 it is m.model.layers.layers, for kimi_k25 /
qwen3_5_moe / bailing_hybrid it is the pipeline_layers list of the inner model.)

Transformations beyond `lm_head(norm(h))` (attribute names):
  gemma, gemma2, gemma4_text_moe: embeddings x sqrt(hidden) inside the inner model (gemma4:
    model.embed_scale); tied head (embed_tokens.as_linear); gemma/gemma2 RMSNorm uses (1 + weight).
  gemma2: attention softcap args.attn_logit_softcapping; final logits tanh(x/c)*c,
    c = args.final_logit_softcapping.   gemma4_text_moe: logit_softcap(final_logit_softcapping=30).
  recurrent_gemma: embeddings x sqrt(hidden) (config.embeddings_scale_by_sqrt_dim); logits
    tanh(x/c)*c with c = args.logits_soft_cap (untied here: lm_head exists on a fresh build).
  granite, granitemoe, granitemoehybrid: embeddings x model.embedding_multiplier, residual branches
    x residual_multiplier, logits / m.logits_scaling (attention scale = attention_multiplier).
  cohere, cohere2: tied head, logits x args.logit_scale (m.model.args.logit_scale).
  minicpm3: embeddings x args.scale_emb; residuals x scale_depth/sqrt(L); logits =
    lm_head(out / (hidden_size / dim_model_base)).
  falcon_h1: untied here -> plain lm_head (the tied path would multiply logits by
    lm_head_multiplier/embedding_multiplier); internal mup multipliers in attention/ssm/mlp.
  lfm2: tied head; final norm is m.model.embedding_norm.   ministral3: query scaling
    1 + beta*log(1 + floor(pos/original_max_position_embeddings)) (llama_4_scaling_beta).
  kimi_k25 / qwen3_5_moe: wrapper Model -> m.language_model(...); no extra transform.
  All others: plain lm_head(norm(h)) (tied or not per config).

Hybrid decoder-layer calls (inner model loop; cache always the per-layer entry):
  qwen3_next, qwen3_5_moe: layer(h, mask=mask, cache=c)                    keyword
  nemotron_h:   layer(h, mask=mask, cache=c); c = None for "E"/"-" layers, cache list
                only has entries for M and * layers (counter)                keyword
  falcon_h1:    layer(h, cache=c, attn_mask=..., mamba_mask=...); c = CacheList(mamba, attn)
                (every layer runs mamba and attention in parallel)          keyword
  granitemoehybrid: layer(h, mask=mask, cache=c)                            keyword
  lfm2:         layer(h, mask, cache=c)                                     keyword
  jamba:        layer(h, mask=mask, cache=c)                                keyword
  plamo2:       l(x, mask=..., cache=c) (PlamoDecoder.__call__(x, cache))  keyword
  kimi_linear:  layer(h, mask=mask, cache=layer_cache)                      keyword
  olmo_hybrid:  layer(h, mask=fa_mask|ssm_mask, cache=c)                    keyword
  bailing_hybrid: layer(h, mask, c, offset=offset); offset = attn cache offset  POSITIONAL cache
  recurrent_gemma: block(x, mask=mask, cache=cache[i]); signature (x, cache=None, mask=None)  keyword
  mamba2:       layer(hidden, mask, c)                                      POSITIONAL cache
  rwkv7:        x, v_first = layer(x, v_first, c)  (returns a tuple)        POSITIONAL cache
(Non-hybrids: layer(h, mask, cache=c) or layer(h, mask, c); ministral3 also passes attn_scale;
gemma4_text passes per_layer_input/shared_kv/offset keywords.)
"""

import importlib
from typing import Callable, Dict, Tuple

import dflash_mlx  # noqa: F401  (BLAS routing before mlx.core)
import mlx.core as mx

VOCAB = 300


def _c(*bases, **kw):
    out = {}
    for b in bases:
        out.update(b)
    out.update(kw)
    return out

_B = dict(vocab_size=VOCAB, rms_norm_eps=1e-5, max_position_embeddings=4096)
_ATT = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2)

# DeepSeek-V3-style MLA + MoE text config (shared by kimi_k25, deepseek_v3)
_DSV3 = _c(
    _B, _ATT, intermediate_size=128, moe_intermediate_size=32, n_shared_experts=1, n_routed_experts=8,
    num_experts_per_tok=2, routed_scaling_factor=2.5, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8,
    v_head_dim=16, qk_nope_head_dim=16, topk_method="noaux_tc", scoring_func="sigmoid", norm_topk_prob=True,
    n_group=2, topk_group=1, moe_layer_freq=1, first_k_dense_replace=1, rope_theta=10000.0,
    num_key_value_heads=4,
)

# key -> (mlx_lm.models module name, config dict incl. "model_type")
FAMILY_ARCHS: Dict[str, Tuple[str, dict]] = {
    "qwen3_moe": ("qwen3_moe", _c(
        _B, _ATT, model_type="qwen3_moe", intermediate_size=128, head_dim=16, num_experts=8,
        num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[], moe_intermediate_size=32,
        rope_theta=10000.0, tie_word_embeddings=False, norm_topk_prob=True)),
    "qwen3_next": ("qwen3_next", _c(
        _B, _ATT, model_type="qwen3_next", intermediate_size=128, head_dim=16,
        linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_conv_kernel_dim=4, num_experts=8, num_experts_per_tok=2, decoder_sparse_step=1,
        shared_expert_intermediate_size=32, mlp_only_layers=[], moe_intermediate_size=32, rope_theta=10000.0,
        partial_rotary_factor=0.25, norm_topk_prob=True, full_attention_interval=2, tie_word_embeddings=False)),
    "qwen3_5_moe": ("qwen3_5_moe", _c(
        _B, _ATT, model_type="qwen3_5_moe", intermediate_size=128, head_dim=16,
        linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_conv_kernel_dim=4, full_attention_interval=2, tie_word_embeddings=False,
        num_experts=8, num_experts_per_tok=2, shared_expert_intermediate_size=32, moe_intermediate_size=32)),
    "gemma4_text_moe": ("gemma4_text", dict(
        _B, model_type="gemma4_text", hidden_size=64, num_hidden_layers=4, intermediate_size=64,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=16,
        num_global_key_value_heads=1, attention_k_eq_v=True, num_kv_shared_layers=0,
        hidden_size_per_layer_input=0, vocab_size_per_layer_input=VOCAB, sliding_window=16,
        sliding_window_pattern=2, use_double_wide_mlp=False, enable_moe_block=True, num_experts=8,
        top_k_experts=2, moe_intermediate_size=32)),
    "gpt_oss": ("gpt_oss", _c(
        _B, _ATT, model_type="gpt_oss", num_local_experts=8, num_experts_per_tok=2, intermediate_size=64,
        head_dim=16, sliding_window=16, rope_theta=10000,
        layer_types=["sliding_attention", "full_attention"] * 2)),
    "minimax": ("minimax", _c(
        _B, _ATT, model_type="minimax", intermediate_size=64, num_experts_per_tok=2, num_local_experts=8,
        shared_intermediate_size=0, rope_theta=10000.0, rotary_dim=8, head_dim=16, tie_word_embeddings=False)),
    "kimi_k25": ("kimi_k25", dict(model_type="kimi_k25", text_config=dict(_DSV3, model_type="kimi_k2"))),
    "glm_moe_dsa": ("glm_moe_dsa", dict(
        _DSV3, model_type="glm_moe_dsa", index_head_dim=16, index_n_heads=2, index_topk=16,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, attention_bias=False)),
}

MORE_ARCHS: Dict[str, Tuple[str, dict]] = {
    # ---- dense
    "qwen2": ("qwen2", _c(_B, _ATT, model_type="qwen2", intermediate_size=128, rope_theta=10000.0,
                            tie_word_embeddings=False)),
    "phi3": ("phi3", _c(_B, _ATT, model_type="phi3", intermediate_size=128, partial_rotary_factor=0.5)),
    "gemma": ("gemma", _c(_B, _ATT, model_type="gemma", intermediate_size=128, head_dim=16,
                            num_key_value_heads=1)),
    "gemma2": ("gemma2", _c(_B, _ATT, model_type="gemma2", intermediate_size=128, head_dim=16,
                              query_pre_attn_scalar=16.0, attn_logit_softcapping=50.0,
                              final_logit_softcapping=30.0)),
    "olmo2": ("olmo2", _c(_B, _ATT, model_type="olmo2", intermediate_size=128, tie_word_embeddings=False)),
    "granite": ("granite", _c(_B, _ATT, model_type="granite", intermediate_size=128, logits_scaling=4.0,
                                attention_multiplier=0.0625, embedding_multiplier=2.0, residual_multiplier=0.8,
                                attention_bias=False, mlp_bias=False, rope_theta=10000.0,
                                tie_word_embeddings=False)),
    "cohere": ("cohere", _c(_B, _ATT, model_type="cohere", intermediate_size=128, logit_scale=0.25,
                              use_qk_norm=False)),
    "cohere2": ("cohere2", _c(_B, _ATT, model_type="cohere2", intermediate_size=128, head_dim=16,
                                logit_scale=0.25, sliding_window=16, sliding_window_pattern=2)),
    "exaone4": ("exaone4", _c(_B, _ATT, model_type="exaone4", intermediate_size=128, head_dim=16,
                                rope_theta=10000.0, tie_word_embeddings=False, rope_scaling=None,
                                sliding_window=16, sliding_window_pattern="LLLG")),
    "starcoder2": ("starcoder2", _c(_B, _ATT, model_type="starcoder2", intermediate_size=128,
                                      rope_theta=10000.0, tie_word_embeddings=False)),
    "internlm3": ("internlm3", _c(_B, _ATT, model_type="internlm3", intermediate_size=128)),
    "smollm3": ("smollm3", _c(_B, _ATT, model_type="smollm3", intermediate_size=128, no_rope_layer_interval=2,
                                tie_word_embeddings=False)),
    "ministral3": ("ministral3", _c(
        _B, _ATT, model_type="ministral3", intermediate_size=128, head_dim=16, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "llama_4_scaling_beta": 0.1,
                         "original_max_position_embeddings": 16},
        layer_types=["sliding_attention", "full_attention"] * 2, sliding_window=16)),
    # ---- MoE
    "mixtral": ("mixtral", _c(_B, _ATT, model_type="mixtral", intermediate_size=64, num_local_experts=8,
                                num_experts_per_tok=2, rope_theta=10000.0)),
    "olmoe": ("olmoe", _c(_B, _ATT, model_type="olmoe", intermediate_size=32, num_experts=8,
                            num_experts_per_tok=2, tie_word_embeddings=False)),
    "qwen2_moe": ("qwen2_moe", _c(_B, _ATT, model_type="qwen2_moe", intermediate_size=128, num_experts=8,
                                    num_experts_per_tok=2, moe_intermediate_size=32,
                                    shared_expert_intermediate_size=32, rope_theta=10000.0)),
    "granitemoe": ("granitemoe", _c(_B, _ATT, model_type="granitemoe", intermediate_size=32, logits_scaling=4.0,
                                      attention_multiplier=0.0625, embedding_multiplier=2.0,
                                      residual_multiplier=0.8, attention_bias=False, rope_theta=10000.0,
                                      num_local_experts=8, num_experts_per_tok=2, tie_word_embeddings=False)),
    "phimoe": ("phimoe", _c(_B, _ATT, model_type="phimoe", intermediate_size=32, num_local_experts=8,
                              num_experts_per_tok=2)),
    "deepseek_v2": ("deepseek_v2", _c(
        _B, _ATT, model_type="deepseek_v2", intermediate_size=128, moe_intermediate_size=32,
        n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=2, routed_scaling_factor=1.0,
        kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16,
        topk_method="greedy", n_group=1, topk_group=1, first_k_dense_replace=1, num_key_value_heads=4,
        rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024, "beta_fast": 32,
                      "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707})),
    "deepseek_v3": ("deepseek_v3", dict(_DSV3, model_type="deepseek_v3")),
    "glm4_moe": ("glm4_moe", _c(
        _B, _ATT, model_type="glm4_moe", intermediate_size=128, moe_intermediate_size=32, norm_topk_prob=True,
        n_group=1, head_dim=16, topk_group=1, n_shared_experts=1, n_routed_experts=8, routed_scaling_factor=2.5,
        num_experts_per_tok=2, first_k_dense_replace=1, rope_theta=10000.0, rope_scaling=None, use_qk_norm=True,
        tie_word_embeddings=False, attention_bias=True, partial_rotary_factor=0.5)),
    "minicpm3": ("minicpm3", _c(
        _B, _ATT, model_type="minicpm3", intermediate_size=128, dim_model_base=32, num_key_value_heads=4,
        q_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, kv_lora_rank=16, scale_depth=1.4,
        scale_emb=3.0, rope_theta=10000.0, tie_word_embeddings=False,
        rope_scaling={"type": "longrope", "original_max_position_embeddings": 4096})),
    "glm4_moe_lite": ("glm4_moe_lite", _c(
        _B, _ATT, model_type="glm4_moe_lite", intermediate_size=128, moe_intermediate_size=32, num_key_value_heads=4,
        n_shared_experts=1, n_routed_experts=8, routed_scaling_factor=1.8, kv_lora_rank=16, q_lora_rank=32,
        qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, num_experts_per_tok=2, first_k_dense_replace=1,
        rope_theta=10000.0)),
    "mimo_v2_flash": ("mimo_v2_flash", _c(
        _B, _ATT, model_type="mimo_v2_flash", num_experts_per_tok=2, hybrid_layer_pattern=[0, 1, 1, 0],
        moe_layer_freq=[0, 1, 1, 1], add_swa_attention_sink_bias=True, add_full_attention_sink_bias=False,
        sliding_window_size=16, intermediate_size=128, moe_intermediate_size=32, n_shared_experts=None,
        n_routed_experts=8, routed_scaling_factor=None, topk_method="noaux_tc", scoring_func="sigmoid",
        norm_topk_prob=True, n_group=1, topk_group=1, layernorm_epsilon=1e-5, rope_theta=10000.0,
        swa_rope_theta=10000.0, swa_num_attention_heads=4, swa_num_key_value_heads=2, head_dim=16,
        v_head_dim=16, swa_head_dim=16, swa_v_head_dim=16, partial_rotary_factor=0.5)),
}

# ---- state-space / recurrent (hybrids mix attention and recurrent layers)
HYBRID_ARCHS: Dict[str, Tuple[str, dict]] = {
    "nemotron_h": ("nemotron_h", _c(
        _ATT, vocab_size=VOCAB, max_position_embeddings=4096, model_type="nemotron_h", intermediate_size=128,
        head_dim=16, attention_bias=False, mamba_num_heads=4, mamba_head_dim=16, mamba_proj_bias=False,
        ssm_state_size=16, conv_kernel=4, n_groups=2, mlp_bias=False, layer_norm_epsilon=1e-5, use_bias=False,
        use_conv_bias=True, hybrid_override_pattern=["M", "*", "M", "E"], moe_intermediate_size=32,
        moe_shared_expert_intermediate_size=32, n_group=1, n_routed_experts=8, n_shared_experts=1, topk_group=1,
        num_experts_per_tok=2, norm_topk_prob=True, routed_scaling_factor=1.0, tie_word_embeddings=False)),
    "falcon_h1": ("falcon_h1", _c(
        _B, _ATT, model_type="falcon_h1", head_dim=16, intermediate_size=128, mamba_d_ssm=64, mamba_n_heads=4,
        mamba_d_head=16, mamba_d_state=16, mamba_n_groups=1, mamba_d_conv=4, mamba_chunk_size=16,
        rope_theta=10000.0, tie_word_embeddings=False)),
    "granitemoehybrid": ("granitemoehybrid", _c(
        _B, _ATT, model_type="granitemoehybrid", intermediate_size=32, attention_bias=False,
        embedding_multiplier=2.0, attention_multiplier=0.0625, logits_scaling=2.0, residual_multiplier=0.8,
        layer_types=["mamba", "attention", "mamba", "attention"], num_local_experts=8, num_experts_per_tok=2,
        shared_intermediate_size=64, mamba_n_heads=4, mamba_d_head=16, mamba_proj_bias=False, mamba_d_state=16,
        mamba_d_conv=4, mamba_n_groups=1, mamba_conv_bias=True, position_embedding_type="rope",
        tie_word_embeddings=False)),
    "lfm2": ("lfm2", _c(
        _ATT, vocab_size=VOCAB, max_position_embeddings=4096, model_type="lfm2", norm_eps=1e-5, conv_bias=False,
        conv_L_cache=3, block_dim=64, block_ff_dim=128, block_multiple_of=16, block_ffn_dim_multiplier=1.0,
        block_auto_adjust_ff_dim=False, rope_theta=10000.0,
        layer_types=["conv", "full_attention", "conv", "full_attention"])),
    "jamba": ("jamba", _c(
        _B, _ATT, model_type="jamba", intermediate_size=64, attn_layer_offset=1, attn_layer_period=2,
        expert_layer_offset=1, expert_layer_period=2, mamba_d_conv=4, mamba_d_state=8, mamba_expand=2,
        num_experts=8, num_experts_per_tok=2, tie_word_embeddings=False)),
    "plamo2": ("plamo2", _c(
        _B, _ATT, model_type="plamo2", hidden_size_per_head=16, attention_window_size=16, mamba_d_state=16,
        mamba_d_conv=4, mamba_num_heads=4, mamba_step=2, mamba_chunk_size=16, intermediate_size=128,
        tie_word_embeddings=False)),
    "kimi_linear": ("kimi_linear", _c(
        _B, _ATT, model_type="kimi_linear", intermediate_size=128, head_dim=16, rope_theta=10000.0,
        linear_attn_config={"kda_layers": [1, 3], "full_attn_layers": [2, 4], "num_heads": 4, "head_dim": 16,
                            "short_conv_kernel_size": 4},
        model_max_length=4096, num_experts=8, moe_intermediate_size=32, kv_lora_rank=16, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, mla_use_nope=False, num_experts_per_token=2, num_shared_experts=1,
        first_k_dense_replace=1, routed_scaling_factor=2.0, num_key_value_heads=4)),
    "olmo_hybrid": ("olmo_hybrid", _c(
        _B, _ATT, model_type="olmo_hybrid", intermediate_size=128, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
        linear_allow_neg_eigval=True, tie_word_embeddings=False, attention_bias=False, head_dim=16,
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"])),
    "bailing_hybrid": ("bailing_hybrid", _c(
        _B, _ATT, model_type="bailing_hybrid", intermediate_size=128, moe_intermediate_size=32, num_experts=8,
        num_experts_per_tok=2, num_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=1,
        layer_group_size=2, group_norm_size=2, rope_theta=10000.0, routed_scaling_factor=2.5, head_dim=16,
        kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, q_lora_rank=32,
        moe_shared_expert_intermediate_size=32, partial_rotary_factor=0.5, num_key_value_heads=4)),
    "recurrent_gemma": ("recurrent_gemma", _c(
        _B, _ATT, model_type="recurrent_gemma", attention_bias=False, conv1d_width=4, intermediate_size=128,
        logits_soft_cap=30.0, num_key_value_heads=1, rope_theta=10000.0, attention_window_size=16,
        block_types=["recurrent", "recurrent", "attention"])),
    "mamba2": ("mamba2", _c(
        vocab_size=VOCAB, model_type="mamba2", num_heads=4, head_dim=16, hidden_size=64, intermediate_size=64,
        state_size=16, num_hidden_layers=3, layer_norm_epsilon=1e-5, conv_kernel=4, n_groups=1, use_bias=False,
        use_conv_bias=True, tie_word_embeddings=False, time_step_limit=(0.0, float("inf")),
        time_step_rank="auto")),
    "rwkv7": ("rwkv7", _c(
        vocab_size=VOCAB, model_type="rwkv7", hidden_size=64, intermediate_size=128, norm_eps=1e-5, head_dim=16,
        num_hidden_layers=3, a_low_rank_dim=8, v_low_rank_dim=8, gate_low_rank_dim=16, decay_low_rank_dim=8)),
}
MORE_ARCHS.update(HYBRID_ARCHS)

# seed offsets chosen so build(key) (seed=0) passes the varied-output check
SEEDS: Dict[str, int] = {"kimi_k25": 1, "glm4_moe": 1, "gemma": 1, "gemma2": 1, "granite": 1, "granitemoe": 3,
                         "starcoder2": 2, "mixtral": 1, "lfm2": 1}
EMBED_SCALE: Dict[str, float] = {"gemma": 0.05, "gemma2": 0.1, "cohere": 0.25, "cohere2": 0.1,
                                 "gemma4_text_moe": 0.1, "lfm2": 0.25}
def _x3(p):
    return p * 3.0


def _uniform(p):
    return mx.random.uniform(shape=p.shape)


# key -> {parameter path suffix: function applied to that parameter after init}
TWEAKS: Dict[str, Dict[str, Callable]] = {
    "gemma": {"model.norm.weight": lambda p: 16.0 * (1.0 + p) - 1.0},
    "gemma2": {"model.norm.weight": lambda p: 8.0 * (1.0 + p) - 1.0},
    "cohere": {"model.norm.weight": lambda p: 8.0 * p, "q_proj.weight": _x3, "k_proj.weight": _x3},
    "cohere2": {"model.norm.weight": lambda p: 8.0 * p, "q_proj.weight": _x3, "k_proj.weight": _x3},
    "gemma4_text_moe": {"model.norm.weight": lambda p: 8.0 * p},
    "lfm2": {"model.embedding_norm.weight": lambda p: 8.0 * p, "q_proj.weight": _x3, "k_proj.weight": _x3},
    "starcoder2": {"q_proj.weight": _x3, "k_proj.weight": _x3},
    # RWKV-7's parameters that start at zeros, its time-mix output norm among them, which left so
    # cut the context out (`arch_check.reads_context`); its token-shift mixes and key/receptance scales
    "rwkv7": {"g_norm.weight": lambda p: mx.ones(p.shape), **{f"attn.x_{n}": _uniform for n in "rwkvag"},
              "ffn.x_k": _uniform, "k_k": _uniform, "k_a": _uniform, "r_k": lambda p: 0.5 * mx.random.normal(p.shape)},
    # Recurrent Gemma's temporal convolution starts at zeros, which leaves its RG-LRU's input, and state, at
    # zero (its attention layers alone read the context); its recurrence made to remember (softplus(-4))
    "recurrent_gemma": {"conv_1d.weight": lambda p: 0.5 * mx.random.normal(p.shape),
                        "recurrent_param": lambda p: mx.full(p.shape, -4.0),
                        "gate_weight": lambda p: 0.25 * mx.random.normal(p.shape)},
}

# The rest of mlx-lm's architectures, and the multimodal wrappers: testing/more_archs.py.

ALL_ARCHS: Dict[str, Tuple[str, dict]] = {**FAMILY_ARCHS, **MORE_ARCHS}

_EMBED_SUFFIXES = ("embed_tokens.weight", "embeddings.weight", "wte.weight", "embedding.weight")


def config(key: str, **overrides) -> Tuple[str, dict]:
    """(module name, config dict with overrides; for kimi_k25 they go into text_config)."""
    module, cfg = ALL_ARCHS[key]
    cfg = dict(cfg)
    if "text_config" in cfg:
        text = dict(cfg["text_config"])
        for k, v in overrides.items():
            (cfg if k in ("model_type", "text_config") else text)[k] = v
        cfg["text_config"] = text
    else:
        cfg.update(overrides)
    return module, cfg


def build(key: str, seed: int = 0, **overrides):
    """The float32 eval-mode model of FAMILY_ARCHS/MORE_ARCHS[key], weights from
    mx.random.seed(SEEDS.get(key, 0) + seed), token embedding x EMBED_SCALE.get(key, 4.0)."""

    return build_config(key, config(key, **overrides)[1], seed)


def build_config(key: str, cfg: dict, seed: int = 0):
    """`build` from `cfg`, a config of `key`'s module (its own, reshaped: `benchmarks/kv_bits_sweep.py`)."""
    module = importlib.import_module(f"mlx_lm.models.{ALL_ARCHS[key][0]}")
    mx.random.seed(SEEDS.get(key, 0) + seed)
    model = module.Model(module.ModelArgs.from_dict(cfg))
    return finish(model, EMBED_SCALE.get(key, 4.0), TWEAKS.get(key, {}), _EMBED_SUFFIXES)


def finish(model, scale: float, tweaks: Dict[str, Callable], embed_suffixes: Tuple[str, ...],
           matrices_only: bool = False):
    """`model` with its token embedding x `scale` (varied greedy output) and `tweaks` applied
    (parameter-path suffix -> function), float32, in eval mode."""
    from mlx.utils import tree_map_with_path

    def fix(path, p):
        if path.endswith(embed_suffixes) and p.shape[0] == VOCAB and (p.ndim == 2 or not matrices_only):
            p = p * scale
        for suffix, fn in tweaks.items():
            if path.endswith(suffix):
                p = fn(p)
        return p

    model.update(tree_map_with_path(fix, model.parameters()))
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    model.eval()
    return model
