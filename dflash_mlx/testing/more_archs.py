"""Tiny configs of the rest of mlx-lm 0.32's architectures, and of the multimodal wrappers
real hub checkpoints name as their `model_type` (built through their `text_config`, as mlx-lm
loads them), for the quick exactness check of every architecture (`testing.arch_check`).

Every entry is a config dict as a checkpoint's `config.json` would give it: mlx-lm's own
`_get_classes` picks the module from `model_type`. Sizes: vocab 300 (the byte tokenizer of
`testing.targets`), hidden 32, 2 layers where the model allows (4 where its layer pattern
needs them), a few small experts, sliding windows of 8 (the quick check's prompt runs past them).
"""

from typing import Callable, Dict

import dflash_mlx  # noqa: F401  (BLAS routing before mlx.core)
import mlx.core as mx

from dflash_mlx.testing.archs import ALL_ARCHS, _c, _uniform, _x3
from dflash_mlx.testing.targets import TINY_CONFIGS

V = 300
_B = dict(vocab_size=V, rms_norm_eps=1e-5, max_position_embeddings=4096)
_A = dict(_B, hidden_size=32, num_hidden_layers=2, intermediate_size=64, num_attention_heads=4,
          num_key_value_heads=2)
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
_MLA = dict(kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8)
_DSV3 = dict(_A, **_MLA, moe_intermediate_size=16, n_shared_experts=1, n_routed_experts=4,
             num_experts_per_tok=2, routed_scaling_factor=2.5, topk_method="noaux_tc", scoring_func="sigmoid",
             norm_topk_prob=True, n_group=1, topk_group=1, moe_layer_freq=1, first_k_dense_replace=1,
             rope_theta=10000.0, num_key_value_heads=4)
SW = 8  # sliding windows




# key (mlx-lm module name) -> config
TEXT_CONFIGS: Dict[str, dict] = {
    # ---- dense
    "apertus": _c(_A, model_type="apertus", mlp_bias=False, attention_bias=False, rope_theta=10000.0,
                  post_norm=False, qk_norm=True, tie_word_embeddings=False),
    "baichuan_m1": _c(_A, model_type="baichuan_m1", rope_theta=10000.0, sliding_window=SW, sliding_window_layers=[0],
                      conv_window=2),
    "bitnet": _c(_A, model_type="bitnet", tie_word_embeddings=False),
    "exaone": _c(_B, model_type="exaone", hidden_size=32, num_layers=2, intermediate_size=64, num_attention_heads=4,
                 num_key_value_heads=2, rope_theta=10000.0, layer_norm_epsilon=1e-5, tie_word_embeddings=False),
    "ernie4_5": _c(_A, model_type="ernie4_5", head_dim=8, rope_theta=10000.0, use_bias=False,
                   tie_word_embeddings=False),
    "glm": _c(_A, model_type="glm", head_dim=8, tie_word_embeddings=False),
    "glm4": _c(_A, model_type="glm4", attention_bias=True, head_dim=8, partial_rotary_factor=0.5,
               rope_theta=10000.0),
    "gpt2": _c(model_type="gpt2", n_ctx=1024, n_embd=32, n_head=4, n_layer=2, n_positions=1024,
               layer_norm_epsilon=1e-5, vocab_size=V),
    "gpt_bigcode": _c(model_type="gpt_bigcode", n_embd=32, n_layer=2, n_inner=64, n_head=4, n_positions=1024,
                      layer_norm_epsilon=1e-5, vocab_size=V),
    "gpt_neox": _c(model_type="gpt_neox", max_position_embeddings=4096, hidden_size=32, num_attention_heads=4,
                   num_hidden_layers=2, layer_norm_eps=1e-5, vocab_size=V, rotary_emb_base=10000,
                   rotary_pct=0.5),
    "gptj": _c(model_type="gptj", n_embd=32, vocab_size=V, n_positions=1024, n_head=4, rotary_dim=4, n_layer=2),
    "helium": _c(_A, model_type="helium", attention_bias=False, head_dim=8, mlp_bias=False, rope_theta=10000.0,
                 tie_word_embeddings=False),
    "hunyuan_v1_dense": _c(_A, model_type="hunyuan_v1_dense"),
    "internlm2": _c(_A, model_type="internlm2", bias=False),
    "iquestloopcoder": _c(_A, model_type="iquestloopcoder", head_dim=8, rope_theta=10000.0, loop_window_size=SW),
    "lille-130m": _c(model_type="lille-130m", block_size=1024, layer_norm_eps=1e-5, n_embd=64, n_head=4,
                     n_kv_heads=2, n_layer=2, rope_theta=10000.0, vocab_size=V),
    "mimo": _c(_A, model_type="mimo", num_nextn_predict_layers=0),
    "minicpm": _c(_A, model_type="minicpm", dim_model_base=16, scale_depth=1.4, scale_emb=3.0,
                  rope_theta=10000.0),
    "nanbeige": _c(_A, model_type="nanbeige", num_loops=2),
    "nanochat": _c(model_type="nanochat", hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=V, max_position_embeddings=4096, intermediate_size=64),
    "nemotron": _c(_A, model_type="nemotron", hidden_act="relu2", norm_eps=1e-5),
    "nemotron-nas": _c(_B, model_type="nemotron-nas", hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                       block_configs=[{"attention": {"n_heads_in_group": 2}, "ffn": {"ffn_mult": 2.0}},
                                      {"attention": {"no_op": True}, "ffn": {"ffn_mult": 2.0}}]),
    "olmo3": _c(_A, model_type="olmo3", sliding_window=SW, rope_theta=10000.0,
                layer_types=["sliding_attention", "full_attention"]),
    "openelm": _c(model_type="openelm", head_dim=8, num_transformer_layers=2, model_dim=32, vocab_size=V,
                  ffn_dim_divisor=8, num_query_heads=[4, 4], num_kv_heads=[2, 2], ffn_multipliers=[1.0, 2.0]),
    "phi": _c(model_type="phi", max_position_embeddings=4096, vocab_size=V, hidden_size=32, num_attention_heads=4,
              num_hidden_layers=2, num_key_value_heads=4, partial_rotary_factor=0.5, intermediate_size=64),
    "phi3small": _c(model_type="phi3small", hidden_size=32, dense_attention_every_n_layers=2,
                    ff_intermediate_size=64, gegelu_limit=20.0, num_hidden_layers=2, num_attention_heads=4,
                    layer_norm_epsilon=1e-5, vocab_size=V, num_key_value_heads=2, blocksparse_block_size=32,
                    blocksparse_num_local_blocks=1, blocksparse_vert_stride=2),
    "plamo": _c(_A, model_type="plamo", n_shared_head=2),
    "plamo3": _c(model_type="plamo3", hidden_size=32, num_hidden_layers=2, rms_norm_eps=1e-5,
                 tie_word_embeddings=False, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                 # a window past the tests' contexts: PLaMo 3's mask is one wider than its cache, so DFlash
                 # serves contexts up to the window only (`probe.mask_wider_than_cache`)
                 max_position_embeddings=4096, window_size=64, sliding_window_pattern=2, intermediate_size=64,
                 vocab_size=V),
    "qwen": _c(model_type="qwen", hidden_size=32, num_attention_heads=4, num_hidden_layers=2, kv_channels=8,
               max_position_embeddings=4096, intermediate_size=128, vocab_size=V),
    "seed_oss": _c(_A, model_type="seed_oss", head_dim=8, attention_bias=True, tie_word_embeddings=False),
    "spark2_5": _c(_A, model_type="spark2_5", head_dim=8, sliding_window=SW, tie_word_embeddings=False,
                   layer_types=["sliding_attention", "full_attention"],
                   rope_parameters={"sliding_attention": {"rope_theta": 10000.0},
                                    "full_attention": {"rope_theta": 10000.0, "partial_rotary_factor": 0.5}}),
    "stablelm": _c(_A, model_type="stablelm", rope_theta=10000.0, use_qkv_bias=True, partial_rotary_factor=0.5,
                   layer_norm_eps=1e-5),
    "talkie": _c(model_type="talkie", hidden_size=32, num_hidden_layers=2, num_attention_heads=4, head_dim=8,
                 intermediate_size=64, vocab_size=V, rope_theta=10000.0, max_position_embeddings=4096),
    "telechat3": _c(_A, model_type="telechat3", rope_theta=10000.0),
    "youtu_llm": _c(_A, **_MLA, model_type="youtu_llm", num_key_value_heads=4, tie_word_embeddings=False),
    "gear": _c(_A, model_type="gear", head_dim=8, num_hidden_layers=3, sliding_window=SW, tie_word_embeddings=False,
               layer_types=["sliding_attention", "conv_mixer", "full_attention"]),
    "llama4_text": _c(_A, model_type="llama4_text", intermediate_size_mlp=64, rope_theta=10000.0, head_dim=8,
                      tie_word_embeddings=False, no_rope_layers=[1, 0], use_qk_norm=True),
    "olmo": _c(model_type="olmo", d_model=32, n_layers=2, mlp_hidden_size=128, n_heads=4, vocab_size=V,
               embedding_size=V),
    "muse_glimmer": _c(model_type="muse_glimmer", hidden_size=32, num_hidden_layers=2, intermediate_size=64,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=V, sliding_window=SW,
                       layer_types=["sliding_attention", "full_attention"], max_position_embeddings=4096),
    # ---- MoE
    "Klear": _c(_A, model_type="Klear", attention_bias=False, mlp_only_layers=[], num_experts=4,
                num_experts_per_tok=2, decoder_sparse_step=1, n_shared_experts=1, moe_intermediate_size=16,
                rope_theta=10000.0, norm_topk_prob=True),
    "afm7": _c(model_type="afm7", vocab_size=V, hidden_dim=32, num_layers=3, num_kv_reuse_layers=1, num_heads=4,
               num_kv_heads=2),
    "afmoe": _c(_A, **_MOE, model_type="afmoe", head_dim=8, sliding_window=SW, num_shared_experts=1,
                num_dense_layers=1, layer_types=["sliding_attention", "full_attention"]),
    "bailing_moe": _c(_A, **_MOE, model_type="bailing_moe", num_shared_experts=1, norm_topk_prob=True,
                      rope_theta=10000.0, first_k_dense_replace=1, topk_group=1),
    "dbrx": _c(model_type="dbrx", vocab_size=V, d_model=32, n_layers=2, n_heads=4,
               attn_config={"kv_n_heads": 2, "clip_qkv": 8.0, "rope_theta": 10000.0},
               ffn_config={"ffn_hidden_size": 32, "moe_num_experts": 4, "moe_top_k": 2}),
    "deepseek": _c(_A, model_type="deepseek", moe_intermediate_size=16, n_shared_experts=1, n_routed_experts=4,
                   num_experts_per_tok=2, first_k_dense_replace=1),
    "dots1": _c(_A, model_type="dots1", first_k_dense_replace=1, moe_intermediate_size=16, n_routed_experts=4,
                n_shared_experts=1, norm_topk_prob=True, num_experts_per_tok=2, rope_theta=10000.0,
                routed_scaling_factor=1.0),
    "ernie4_5_moe": _c(_A, model_type="ernie4_5_moe", rope_theta=10000.0, use_bias=False, tie_word_embeddings=False,
                       moe_num_experts=4, moe_layer_start_index=1, moe_intermediate_size=16, moe_k=2,
                       moe_num_shared_experts=1),
    "exaone_moe": _c(_A, **_MOE, model_type="exaone_moe", head_dim=8, num_shared_experts=1, sliding_window=SW,
                     layer_types=["sliding_attention", "full_attention"], is_moe_layer=[False, True]),
    "hunyuan": _c(_A, model_type="hunyuan", attention_bias=False, moe_topk=2, num_experts=4, num_shared_expert=1,
                  use_mixed_mlp_moe=True, use_qk_norm=True, rope_theta=10000.0, use_cla=True, cla_share_factor=2,
                  moe_intermediate_size=16, rope_scaling={"alpha": 1.0, "factor": 1.0, "type": "dynamic"}),
    "laguna": _c(_A, **_MOE, model_type="laguna", head_dim=8, sliding_window=SW, shared_expert_intermediate_size=16,
                 layer_types=["sliding_attention", "full_attention"]),
    "lfm2_moe": _c(_A, **_MOE, model_type="lfm2_moe", norm_topk_prob=True, use_expert_bias=True, num_dense_layers=1,
                   norm_eps=1e-5, conv_bias=False, conv_L_cache=3, layer_types=["conv", "full_attention"]),
    "longcat_flash": _c(_B, **_MLA, model_type="longcat_flash", attention_method="MLA", zero_expert_type="identity",
                        hidden_size=32, ffn_hidden_size=64, moe_topk=2, expert_ffn_hidden_size=16,
                        n_routed_experts=4, zero_expert_num=2, num_layers=2, num_attention_heads=4,
                        routed_scaling_factor=1.0, rope_theta=10000.0, mla_scale_q_lora=True,
                        mla_scale_kv_lora=True, attention_bias=False),
    "longcat_flash_ngram": _c(_B, **_MLA, model_type="longcat_flash_ngram", hidden_size=32, ffn_hidden_size=64,
                              moe_topk=2, expert_ffn_hidden_size=16, n_routed_experts=4, zero_expert_num=2,
                              num_layers=2, num_attention_heads=4, routed_scaling_factor=1.0, rope_theta=10000.0,
                              mla_scale_q_lora=True, mla_scale_kv_lora=True, ngram_vocab_size_ratio=2,
                              emb_neighbor_num=2, emb_split_num=2),
    "mellum": _c(_A, **_MOE, model_type="mellum", head_dim=8, tie_word_embeddings=False, norm_topk_prob=True,
                 sliding_window=SW, layer_types=["sliding_attention", "full_attention"],
                 rope_parameters={"sliding_attention": {"rope_theta": 10000.0},
                                  "full_attention": {"rope_theta": 10000.0}}),
    "phixtral": _c(model_type="phixtral", num_vocab=V, model_dim=32, num_heads=4, num_layers=2, rotary_dim=4,
                   num_experts_per_tok=2, num_local_experts=4),
    "solar_open": _c(_A, model_type="solar_open", head_dim=8, n_shared_experts=1, n_routed_experts=4,
                     routed_scaling_factor=1.0, num_experts_per_tok=2, first_k_dense_replace=1,
                     norm_topk_prob=True, rope_theta=10000.0, tie_word_embeddings=False, partial_rotary_factor=0.5,
                     moe_intermediate_size=16),
    "step3p5": _c(_A, model_type="step3p5", num_attention_groups=2, head_dim=8, sliding_window=SW,
                  layer_types=["sliding_attention", "full_attention"], moe_num_experts=4, moe_top_k=2,
                  moe_intermediate_size=16, share_expert_dim=16, moe_layers_enum="1"),
    # ---- latent attention (MLA)
    "deepseek_v32": _c(_DSV3, model_type="deepseek_v32", index_head_dim=8, index_n_heads=2, index_topk=4),
    "mistral4": _c(_A, **_MLA, model_type="mistral4", moe_intermediate_size=16, num_key_value_heads=4,
                   n_shared_experts=1, n_routed_experts=4, routed_scaling_factor=1.0, norm_topk_prob=True,
                   topk_group=1, num_experts_per_tok=2, first_k_dense_replace=1, n_group=1,
                   rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "llama_4_scaling_beta": 0.1,
                                    "original_max_position_embeddings": 16}),
    # a window-only layer, then one that compresses groups of 4 and indexes them (and picks candidate
    # blocks), then one that reads both: a 20-token prompt closes groups, and its index keeps 3 of them
    "deepseek_v41": _c(model_type="deepseek_v41", vocab_size=V, hidden_size=32, num_hidden_layers=3,
                       num_attention_heads=4, head_dim=16, q_lora_rank=16, qk_rope_head_dim=8, o_groups=2,
                       o_lora_rank=16, moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2,
                       sliding_window=SW, index_n_heads=2, index_head_dim=8, index_topk=3, hc_mult=2,
                       hc_sinkhorn_iters=3, rms_norm_eps=1e-6, max_position_embeddings=4096,
                       compress_ratios=[0, 4, 4], kv_source_layer_ids=[1], index_source_layer_ids=[1, 2],
                       candidate_source_layer_id=1, candidate_topk_blocks=1, candidate_block_size=2),
    # ---- recurrent / hybrid
    "mamba": _c(model_type="mamba", vocab_size=V, hidden_size=32, intermediate_size=64, state_size=8,
                num_hidden_layers=2, conv_kernel=4, use_bias=False, use_conv_bias=True, time_step_rank=4,
                tie_word_embeddings=False),
    "bailing_moe_linear": _c(_A, **_MOE, model_type="bailing_moe_linear", num_shared_experts=1, norm_topk_prob=True,
                             rope_theta=10000.0, first_k_dense_replace=1, layer_group_size=2, group_norm_size=2,
                             topk_group=1),
    # a Prism pack: Qwen3.5 with 2-bit Hadamard-rotated projections (the smallest block is 512 wide)
    "prism_hadamard_qwen35": dict(
        model_type="prism_hadamard_qwen35", schema_version=1, tensor_namespace="mlx-lm-text",
        quantization={"bits": 2, "group_size": 128, "mode": "affine"},
        modules=[{"path": "model.layers.0.mlp.gate_proj", "embedding": False, "dtype": "float16", "block": 512}],
        text_config=dict(TINY_CONFIGS["qwen3_5"], hidden_size=512, num_hidden_layers=2, intermediate_size=64)),
    "bailing_moe_v3": _c(_A, **_MLA, model_type="bailing_hybrid", architectures=["BailingMoeV3ForCausalLM"],
                         num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                         moe_shared_expert_intermediate_size=16, n_group=1, topk_group=1, layer_group_size=2,
                         head_dim=8, rope_theta=10000.0),
}

_QWEN3 = _c(_A, model_type="qwen3", head_dim=8, rope_theta=10000.0, tie_word_embeddings=False)
_LLAMA = _c(_A, model_type="llama", rope_theta=10000.0)

# key -> a wrapper's config: its `model_type` and the `text_config` mlx-lm builds its language model from
WRAPPER_CONFIGS: Dict[str, dict] = {
    "gemma3": dict(model_type="gemma3", vocab_size=V, text_config=dict(
        TINY_CONFIGS["gemma3_text"], hidden_size=32, num_hidden_layers=2, intermediate_size=64, sliding_window=SW)),
    "gemma4": dict(model_type="gemma4", vocab_size=V, text_config=_c(  # as gemma-4-26B-A4B: MoE blocks
        ALL_ARCHS["gemma4_text_moe"][1], hidden_size=32, num_hidden_layers=2, sliding_window=SW,
        intermediate_size=32, moe_intermediate_size=16, num_experts=4)),
    "qwen2_vl": dict(model_type="qwen2_vl", text_config=_c(_A, model_type="qwen2", rope_theta=10000.0,
                                                               tie_word_embeddings=False)),
    "qwen3_vl": dict(model_type="qwen3_vl", text_config=_QWEN3),
    "qwen3_vl_moe": dict(model_type="qwen3_vl_moe", text_config=_c(
        _QWEN3, **_MOE, model_type="qwen3_moe", decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True)),
    "mistral3": dict(model_type="mistral3", text_config=_c(_LLAMA, model_type="mistral")),
    "mistral3+ministral3": dict(model_type="mistral3", text_config=_c(
        _A, model_type="ministral3", head_dim=8, sliding_window=SW,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "llama_4_scaling_beta": 0.1,
                         "original_max_position_embeddings": 16})),
    "mistral3+mistral4": dict(model_type="mistral3", text_config=TEXT_CONFIGS["mistral4"]),
    "pixtral": dict(model_type="pixtral", text_config=_LLAMA),
    "lfm2-vl": dict(model_type="lfm2-vl", text_config=_c(
        ALL_ARCHS["lfm2"][1], hidden_size=32, block_dim=32, block_ff_dim=64, num_hidden_layers=2,
        layer_types=["conv", "full_attention"])),
    "kimi_vl": dict(model_type="kimi_vl", text_config=_DSV3),
    "kimi_k3": dict(model_type="kimi_k3", text_config=_c(
        _B, model_type="kimi_linear", hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, intermediate_size=64, **_MLA, mla_use_nope=True,
        linear_attn_config={"kda_layers": [1], "full_attn_layers": [2], "num_heads": 4, "head_dim": 8,
                            "short_conv_kernel_size": 4},
        num_experts=4, num_experts_per_token=2, num_shared_experts=1, moe_intermediate_size=16,
        first_k_dense_replace=1, attn_res_block_size=1)),
    "llama4": dict(model_type="llama4", text_config=_c(
        _A, model_type="llama4_text", num_hidden_layers=4, attention_bias=False, attention_chunk_size=SW, head_dim=8,
        interleave_moe_layer_step=2, intermediate_size_mlp=64, num_local_experts=4, num_experts_per_tok=1,
        rope_scaling=None, rope_theta=10000.0, use_qk_norm=True, intermediate_size=16)),
    "minimax_m3_vl": dict(model_type="minimax_m3_vl", text_config=_c(
        _A, model_type="minimax_m3", intermediate_size=16, dense_intermediate_size=64, shared_intermediate_size=16,
        num_local_experts=4, num_experts_per_tok=2, head_dim=8, moe_layer_freq=[0, 1],
        sparse_attention_freq=[1, 0], index_n_heads=2, index_head_dim=8, index_block_size=4, index_topk_blocks=2)),
    "muse_spark": dict(model_type="muse_spark", text_config=_c(
        _B, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_hidden_layers=2,
        post_norm_eps=1e-8, rope_parameters={"rope_theta": 10000.0}, layer_rope_theta=[10000.0, 0.0],
        layer_types=["sliding_attention", "full_attention"], sliding_window=SW, final_logit_softcapping=20.0,
        output_multiplier=0.5, num_local_experts=4, num_experts_per_tok=2, moe_hidden_size=32,
        moe_intermediate_size=16)),
    "gemma3n": dict(model_type="gemma3n", text_config=_c(
        _B, model_type="gemma3n_text", hidden_size=32, num_hidden_layers=4, intermediate_size=64,
        num_attention_heads=4, head_dim=8, num_key_value_heads=2, num_kv_shared_layers=0,
        vocab_size_per_layer_input=V, sliding_window=SW, rope_local_base_freq=10000.0, rope_theta=10000.0,
        final_logit_softcapping=30.0, layer_types=["sliding_attention", "full_attention"] * 2,
        activation_sparsity_pattern=[0.0] * 4, hidden_size_per_layer_input=8, altup_num_inputs=2,
        altup_coef_clip=120.0, altup_correct_scale=True, altup_active_idx=0, laurel_rank=4)),
}

# Options of one architecture our tiny configs above did not hold, named "<key>/<option>": each
# once made DFlash's greedy output differ from mlx-lm's (issue 47; tests/test_option_variants.py).
OPTION_VARIANTS: Dict[str, dict] = {
    # chunks shorter than the prompt: the chunked layers' caches drop keys off their front
    "llama4/chunk4": _c(WRAPPER_CONFIGS["llama4"], text_config=_c(
        WRAPPER_CONFIGS["llama4"]["text_config"], attention_chunk_size=4, interleave_moe_layer_step=1)),
}

# Where these models keep their token embedding (scaled by EMBED_SCALE after init).
EMBEDDINGS = ("embed_tokens.weight", "embeddings.weight", "wte.weight", "embedding.weight", "embed.weight",
              "embed_in.weight", "tok_embeddings.weight", "token_embeddings.weight", "word_embeddings.weight")
# Knobs per key, so that the random model's greedy continuations are varied (a model that
# repeats one token tests nothing): seed offsets, embedding scales (default 4), parameter tweaks.
SEEDS: Dict[str, int] = {"gpt2": 2, "gpt_bigcode": 2, "openelm": 2, "afm7": 2, "hunyuan": 2, "lfm2_moe": 4,
                         "gemma4": 2, "lfm2-vl": 2, "glm4": 2, "qwen3": 4, "lille-130m": 1,
                         "gemma3n": 3}
EMBED_SCALE: Dict[str, float] = {"gpt2": 0.25, "gpt_bigcode": 0.25, "openelm": 0.05, "afm7": 0.1, "hunyuan": 0.25,
                                 "lfm2_moe": 0.1, "gemma4": 0.25, "lfm2-vl": 0.05, "glm4": 16.0,
                                 "qwen3": 0.25, "gemma4_text": 0.25, "gemma3n": 0.25}


def _packed(p):
    return mx.random.randint(0, 2**31 - 1, p.shape).astype(p.dtype) if p.dtype == mx.uint32 else p


def _normal(p):
    return mx.random.normal(p.shape) * 0.5


_SHARPER = {"q_proj.weight": _x3, "k_proj.weight": _x3}  # sharper random attention
# key -> {parameter path suffix: function applied to it after init}
TWEAKS: Dict[str, Dict[str, Callable]] = {
    "prism_hadamard_qwen35": {"gate_proj.weight": _packed},
    "talkie": {"lm_head": _normal},  # a bare parameter that starts at zeros
    "lille-130m": {"norm.weight": lambda p: mx.random.normal(p.shape)},  # (with norms of ones: one token forever)
    "qwen3": {"q_norm.weight": _x3, "k_norm.weight": _x3},  # (q/k are normalized per head)
    "lfm2_moe": _SHARPER,
    "lfm2-vl": _SHARPER,
    # Baichuan-M1's short convolutions of its keys and values start at zeros: zero keys and values,
    # no context (`arch_check.reads_context`)
    "baichuan_m1": {"conv_k": _uniform, "conv_v": _uniform},
}

# Keys this machine cannot run (Linux, MLX's CPU backend), and why; listed in the table, not checked.
NOT_RUN: Dict[str, str] = {
    "bitnet": "mlx-lm's BitNet runs its ternary matmul as a Metal kernel only",
    "muse_spark": "mlx-lm's Muse Spark runs its q/k norm and RoPE as Metal kernels only",
    "phi3small": "mlx-lm's Phi-3-small crashes MLX's CPU backend (heap corruption) on its own",
}

# Keys DFlash refuses when the target is built, with a fragment of the one line it gives.
REFUSED: Dict[str, str] = {
    "olmo": "mlx-lm.s own model fails on a prompt of two tokens",
}
