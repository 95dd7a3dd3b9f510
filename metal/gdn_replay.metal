// Rebuild a Gated DeltaNet state after the first `steps` steps of a verify
// block from the pre-verify state and the tape written by gdn_tape:
//   S = S * g_t ;  S = S + tape_t k_t^T      for t < steps
// Elementwise: one thread per state element, no reductions, no q/v reads.
// `steps` is a device scalar, so the accept length never needs a host sync.
//
// Inputs   state_in [B, Hv, Dv, Dk]; k [B, T, Hk, Dk];
//          g [B, T, Hv] or [B, T, Hv, Dk]; tape [B, T, Hv, Dv] float32;
//          steps int32 (0..T); T int32
// Output   state_out [B, Hv, Dv, Dk] StT
// Template StT, Dk, Dv, Hk, Hv, GVEC
// Grid (Dk, Dv, B * Hv), any threadgroup shape.

const uint dk = thread_position_in_grid.x;
const uint dv = thread_position_in_grid.y;
const uint n = thread_position_in_grid.z;
const uint b = n / Hv;
const uint hv = n % Hv;
const uint hk = hv / (Hv / Hk);
const size_t idx = (size_t(n) * Dv + dv) * Dk + dk;

float s = static_cast<float>(state_in[idx]);
const int n_steps = metal::min(int(steps), int(T));
for (int t = 0; t < n_steps; ++t) {
  const size_t vh = (size_t(b) * T + t) * Hv + hv;
  const float gi = GVEC ? static_cast<float>(g[vh * Dk + dk]) : static_cast<float>(g[vh]);
  // Same two roundings as the recording pass: decay, then the rank-1 update.
  s = s * gi;
  s = s + static_cast<float>(k[((size_t(b) * T + t) * Hk + hk) * Dk + dk]) * tape[vh * Dv + dv];
}
state_out[idx] = static_cast<StT>(s);
