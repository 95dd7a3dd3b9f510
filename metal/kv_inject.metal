// DFlash draft KV injection: k_norm + RoPE on the context keys of every draft
// layer, plus the values, written in cache layout -- one launch for all layers.
//
// Inputs
//   kv        [B, S, L, 2, Hkv, D]  stacked k_proj / v_proj outputs of all layers
//   k_weight  [L, D]                k_norm weights
//   inv_freq  [RD / 2] float32      inverse RoPE frequencies (any scaling folded in)
//   offset    int32                 absolute position of the first context token
//   eps       float32               RMSNorm epsilon
//   mscale    float32               YaRN-style pre-rotation scale (1 = none)
// Outputs
//   k_out, v_out  [L, B, Hkv, S, D]  OutT
// Template: OutT, L, Hkv, D, RD (rotary dims, even, <= D)
// Grid (32, L * Hkv, B * S), threadgroup (32, n, 1): one SIMD-group per
// (token, layer, head); lanes stride over the head dimension, so any D works.
// RoPE is the half-split (non-traditional) form used by Qwen3 / Llama.

const uint lane = thread_position_in_grid.x;
const uint row = thread_position_in_grid.y;
const uint tok = thread_position_in_grid.z;
const int B = kv_shape[0];
const int S = kv_shape[1];
const uint layer = row / Hkv;
const uint head = row % Hkv;
const uint b = tok / S;
const uint s = tok % S;
constexpr int half_rd = RD / 2;

auto krow = kv + ((size_t(tok) * L + layer) * 2 * Hkv + head) * D;
auto vrow = krow + Hkv * D;
auto w = k_weight + size_t(layer) * D;
const size_t out_off = (((size_t(layer) * B + b) * Hkv + head) * S + s) * D;
auto kdst = k_out + out_off;
auto vdst = v_out + out_off;

// RMSNorm statistics in float32 (as mx.fast.rms_norm accumulates).
float ss = 0.0f;
for (int j = lane; j < D; j += 32) {
  float x = static_cast<float>(krow[j]);
  ss += x * x;
}
ss = simd_sum(ss);
const float inv_rms = metal::precise::rsqrt(ss / float(D) + eps);
const float pos = float(offset + int(s));

// The normalized key is rounded to OutT before RoPE, exactly like the two-op
// reference (rms_norm returns OutT, rope reads it).
for (int j = lane; j < half_rd; j += 32) {
  OutT n1 = static_cast<OutT>(static_cast<float>(krow[j]) * inv_rms);
  OutT n2 = static_cast<OutT>(static_cast<float>(krow[j + half_rd]) * inv_rms);
  float x1 = static_cast<float>(static_cast<OutT>(static_cast<float>(w[j]) * static_cast<float>(n1)));
  float x2 = static_cast<float>(static_cast<OutT>(static_cast<float>(w[j + half_rd]) * static_cast<float>(n2)));
  if (mscale != 1.0f) {
    x1 = static_cast<float>(static_cast<OutT>(x1 * mscale));
    x2 = static_cast<float>(static_cast<OutT>(x2 * mscale));
  }
  const float theta = pos * inv_freq[j];
  const float c = metal::precise::cos(theta);
  const float sn = metal::precise::sin(theta);
  kdst[j] = static_cast<OutT>(x1 * c - x2 * sn);
  kdst[j + half_rd] = static_cast<OutT>(x1 * sn + x2 * c);
}
// Dimensions past the rotary part are only normalized.
for (int j = RD + lane; j < D; j += 32) {
  OutT n1 = static_cast<OutT>(static_cast<float>(krow[j]) * inv_rms);
  kdst[j] = static_cast<OutT>(static_cast<float>(w[j]) * static_cast<float>(n1));
}
for (int j = lane; j < D; j += 32) {
  vdst[j] = static_cast<OutT>(vrow[j]);
}
