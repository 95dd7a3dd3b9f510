// qmv_rows: out[m, n] = sum_k x[m, k] * dequant(w[n, k]) for the M <= 16 rows of a verify.
//
// MLX's CUDA qmv runs each of M rows as its own pass over the weights (M warps a weight row,
// M reads of it); at M >= 8 MLX switches to a tiled qmm that rounds otherwise. Here one warp
// takes one weight row n and every x row: each tile of w is dequantized once a pass of ROWS
// x rows (a later pass finds it in L1) and used for ROWS rows, whose products are accumulated
// in qmv's own order (qmv_rows.cuh). Row m of the result is then what qmv gives for row m
// alone, bit for bit, whatever M is.
//
// Template: T (x, scales, biases, out), BITS (2, 4, 8), GS (group size 32, 64, 128), ROWS
// (x rows a pass). Shapes: x [M, K], w [N, K * BITS / 32] uint32, scales and biases [N, K / GS],
// out [M, N]. Launch: threadgroup (32, 8, 1), grid (32 * ceil(N / 8), 8, 1): a warp a row n.
using A = typename dflash::Acc<T, BITS>::type;  // the accumulator: float for 8-bit weights, else T
constexpr int E = (sizeof(T) <= 2 && BITS <= 4) ? 16 : 8;  // elements a lane takes a tile
constexpr int PER_WARP = 32 * E;
constexpr int PER_WORD = 32 / BITS;
// the words a tile spans (a tile of 8 2-bit weights is half a word: it starts at bit 0 or 16)
constexpr int TILE_WORDS = (E * BITS + 31) / 32;
constexpr uint32_t MASK = (1u << BITS) - 1u;

const int M = x_shape[0];
const int K = x_shape[1];
const int N = w_shape[0];
const int lane = threadIdx.x;
const int n = blockIdx.x * 8 + threadIdx.y;
if (n >= N) {
  return;  // (the whole warp: n is the warp's)
}
const uint32_t* w_row = w + (int64_t)n * (K / PER_WORD);
const T* scale_row = scales + (int64_t)n * (K / GS);
const T* bias_row = biases + (int64_t)n * (K / GS);
const bool x_aligned = dflash::tiles_aligned<T, E>(x, K);  // (x may be a slice starting anywhere)
const int rest = K % PER_WARP;
const int rest_idx = lane * E + K - rest;  // this lane's tile past the whole ones, if < K

for (int m0 = 0; m0 < M; m0 += ROWS) {
  A acc[ROWS][E];
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
#pragma unroll
    for (int i = 0; i < E; ++i) {
      acc[r][i] = dflash::from_float<A>(0.0f);
    }
  }
  for (int t = 0; t <= K / PER_WARP; ++t) {
    const int idx = (t < K / PER_WARP) ? lane * E + t * PER_WARP : rest_idx;
    if (t == K / PER_WARP && (rest == 0 || idx >= K)) {
      break;
    }
    const T scale = scale_row[idx / GS];
    const T bias = bias_row[idx / GS];
    uint32_t words[TILE_WORDS];
#pragma unroll
    for (int v = 0; v < TILE_WORDS; ++v) {
      words[v] = w_row[idx / PER_WORD + v];
    }
    const int lead = (E * BITS) % 32 == 0 ? 0 : idx % PER_WORD;  // (a constant 0 but for part-word tiles)
    T wdq[E];
#pragma unroll
    for (int i = 0; i < E; ++i) {
      const int j = lead + i;
      wdq[i] = dflash::dequant((words[j / PER_WORD] >> ((j % PER_WORD) * BITS)) & MASK, scale, bias);
    }
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      if (m0 + r < M) {
        const auto x_tile = dflash::load_tile<T, E>(x + (int64_t)(m0 + r) * K + idx, x_aligned);
#pragma unroll
        for (int i = 0; i < E; ++i) {
          acc[r][i] = dflash::fma_acc(x_tile.v[i], wdq[i], acc[r][i]);
        }
      }
    }
  }
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    float sum = 0.0f;
#pragma unroll
    for (int i = 0; i < E; ++i) {
      sum += dflash::to_float(acc[r][i]);
    }
    sum = dflash::warp_sum(sum);
    if (lane == 0 && m0 + r < M) {
      out[(int64_t)(m0 + r) * N + n] = dflash::from_float<T>(sum);
    }
  }
}
