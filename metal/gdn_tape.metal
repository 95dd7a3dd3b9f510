// Gated DeltaNet recurrence for a verify block that also records a tape.
// Per head and step t (state S is [Dv, Dk]):
//   S     = S * g_t                        (scalar or per-Dk gate)
//   delta = (v_t - S k_t) * beta_t         -> tape[t]  (float32, [Dv])
//   S     = S + delta k_t^T
//   y_t   = S q_t
// The tape lets gdn_replay rebuild the state after any accepted prefix with
// elementwise work only (no reductions, no q/v), instead of a second forward.
//
// Inputs   q, k [B, T, Hk, Dk]; v [B, T, Hv, Dv]; g [B, T, Hv] or [B, T, Hv, Dk];
//          beta [B, T, Hv]; state_in [B, Hv, Dv, Dk]; T int32
// Outputs  y [B, T, Hv, Dv] InT; state_out [B, Hv, Dv, Dk] StT;
//          tape [B, T, Hv, Dv] float32
// Template InT, StT, Dk, Dv, Hk, Hv, GVEC (true: per-Dk gate)
// Grid (32, Dv, B * Hv), threadgroup (32, n, 1): one SIMD-group per state row
// (b, hv, dv); lanes own Dk elements lane, lane + 32, ... (any Dk works).

constexpr int NPL = (Dk + 31) / 32;
const uint lane = thread_position_in_grid.x;
const uint dv = thread_position_in_grid.y;
const uint n = thread_position_in_grid.z;
const uint b = n / Hv;
const uint hv = n % Hv;
const uint hk = hv / (Hv / Hk);

auto s_in = state_in + (size_t(n) * Dv + dv) * Dk;
float st[NPL];
for (int i = 0; i < NPL; ++i) {
  const int dk = lane + 32 * i;
  st[i] = dk < Dk ? static_cast<float>(s_in[dk]) : 0.0f;
}

for (int t = 0; t < T; ++t) {
  const size_t qk = ((size_t(b) * T + t) * Hk + hk) * Dk;
  const size_t vh = (size_t(b) * T + t) * Hv + hv;
  float kv_mem = 0.0f;
  for (int i = 0; i < NPL; ++i) {
    const int dk = lane + 32 * i;
    if (dk < Dk) {
      const float gi = GVEC ? static_cast<float>(g[vh * Dk + dk]) : static_cast<float>(g[vh]);
      st[i] = st[i] * gi;
      kv_mem += st[i] * static_cast<float>(k[qk + dk]);
    }
  }
  kv_mem = simd_sum(kv_mem);
  const float delta = (static_cast<float>(v[vh * Dv + dv]) - kv_mem) * static_cast<float>(beta[vh]);
  float out = 0.0f;
  for (int i = 0; i < NPL; ++i) {
    const int dk = lane + 32 * i;
    if (dk < Dk) {
      st[i] = st[i] + static_cast<float>(k[qk + dk]) * delta;
      out += st[i] * static_cast<float>(q[qk + dk]);
    }
  }
  out = simd_sum(out);
  if (lane == 0) {
    y[vh * Dv + dv] = static_cast<InT>(out);
    tape[vh * Dv + dv] = delta;
  }
}

auto s_out = state_out + (size_t(n) * Dv + dv) * Dk;
for (int i = 0; i < NPL; ++i) {
  const int dk = lane + 32 * i;
  if (dk < Dk) {
    s_out[dk] = static_cast<StT>(st[i]);
  }
}
