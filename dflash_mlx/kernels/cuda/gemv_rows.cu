// gemv_rows: out[m, n] = sum_k x[m, k] * w[n, k] for the M <= 16 rows of a dense verify.
//
// MLX's CUDA backend runs a one-row product x @ w.T as its gemv (a warp a row n: each lane takes
// NPT consecutive elements a step, 32 * NPT apart, and accumulates x * w into one float with a
// fused multiply-add; the warp's sum by cooperative_groups' reduce; one rounding to T), and a
// wider one through cuBLAS, which rounds otherwise. Here one warp takes one row n of w and every
// x row, reading each step's weights once a pass of ROWS x rows (a later pass finds them in L1),
// each row accumulated in gemv's order: row m of the result is what gemv gives for row m alone.
//
// Template: T (x, w, out), NPT (4 where K % 128 == 0, 2 where K % 64 == 0, else 1: as MLX picks
// for aligned operands), ROWS (x rows a pass). Shapes: x [M, K], w [N, K], out [M, N].
// Launch: threadgroup (32, 8, 1), grid (32 * ceil(N / 8), 8, 1): a warp a row n.
const int M = x_shape[0];
const int K = x_shape[1];
const int N = w_shape[0];
const int lane = threadIdx.x;
const int n = blockIdx.x * 8 + threadIdx.y;
if (n >= N) {
  return;  // (the whole warp: n is the warp's)
}
const T* w_row = w + (int64_t)n * K;
// (x or w may be a slice starting anywhere: vector loads only where both allow them)
const bool aligned = dflash::tiles_aligned<T, NPT>(x, K) && dflash::tiles_aligned<T, NPT>(w, K);

for (int m0 = 0; m0 < M; m0 += ROWS) {
  float acc[ROWS];
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    acc[r] = 0.0f;
  }
  for (int col = NPT * lane; col < K; col += 32 * NPT) {
    const auto w_tile = dflash::load_tile<T, NPT>(w_row + col, aligned);
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      if (m0 + r < M) {
        const auto x_tile = dflash::load_tile<T, NPT>(x + (int64_t)(m0 + r) * K + col, aligned);
#pragma unroll
        for (int j = 0; j < NPT; ++j) {
          acc[r] = __fmaf_rn(dflash::to_float(w_tile.v[j]), dflash::to_float(x_tile.v[j]), acc[r]);
        }
      }
    }
  }
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    const float sum = dflash::warp_sum(acc[r]);
    if (lane == 0 && m0 + r < M) {
      out[(int64_t)(m0 + r) * N + n] = dflash::from_float<T>(sum);
    }
  }
}
