// Small-M affine-quantized matmul for verify widths (M = 1..16 rows):
//   out[m, n] = sum_k x[m, k] * (scales[n, g] * q[n, k] + biases[n, g]),  g = k / GS
// i.e. mx.quantized_matmul(x, w, scales, biases, transpose=True, GS, BITS).
//
// Inputs
//   x       [M, K]                T
//   w       [N, K * BITS / 32]    uint32, BITS-bit values packed from the low bits up
//   scales  [N, K / GS]           T
//   biases  [N, K / GS]           T
// Output
//   out     [M, N]                T
// Template: T, M, N, K, BITS (2, 4 or 8), GS (32, 64 or 128), ROWS
// Grid (32, ceil(N / ROWS), 1), threadgroup (32, n, 1): each SIMD-group owns
// ROWS weight rows and all M input rows: every weight word is read and
// dequantized once per launch and reused for all M rows (M separate qmv
// launches would read it M times), and every x value is read once per ROWS rows.
// Lanes stride over the packed words of a row; a word never straddles groups
// because GS >= 32 >= 32 / BITS values.

constexpr int VPW = 32 / BITS;          // values per packed word
constexpr int WPR = K / VPW;            // words per weight row
constexpr int GPR = K / GS;             // groups per weight row
constexpr uint MASK = (1u << BITS) - 1u;

const uint lane = thread_position_in_grid.x;
const uint n0 = thread_position_in_grid.y * ROWS;

float acc[M][ROWS];
for (int m = 0; m < M; ++m)
  for (int r = 0; r < ROWS; ++r)
    acc[m][r] = 0.0f;

for (int wi = lane; wi < WPR; wi += 32) {
  const int k0 = wi * VPW;
  const int grp = k0 / GS;
  // Dequantize this word of each owned row once (rows past N read as zero)...
  float wv[ROWS][VPW];
  for (int r = 0; r < ROWS; ++r) {
    const uint n = n0 + r;
    const bool valid = n < uint(N);
    const uint32_t word = valid ? w[size_t(n) * WPR + wi] : 0u;
    const float sc = valid ? static_cast<float>(scales[size_t(n) * GPR + grp]) : 0.0f;
    const float bi = valid ? static_cast<float>(biases[size_t(n) * GPR + grp]) : 0.0f;
    for (int j = 0; j < VPW; ++j) {
      wv[r][j] = sc * float((word >> (j * BITS)) & MASK) + bi;
    }
  }
  // ...then stream each input row's matching VPW values past all of them.
  for (int m = 0; m < M; ++m) {
    auto xr = x + size_t(m) * K + k0;
    float xv[VPW];
    for (int j = 0; j < VPW; ++j) {
      xv[j] = static_cast<float>(xr[j]);
    }
    for (int r = 0; r < ROWS; ++r) {
      float d = 0.0f;
      for (int j = 0; j < VPW; ++j) {
        d += xv[j] * wv[r][j];
      }
      acc[m][r] += d;
    }
  }
}

// Every lane takes part in every reduction (uniform control flow); the owner
// lane of each output writes it.
for (int m = 0; m < M; ++m) {
  for (int r = 0; r < ROWS; ++r) {
    const float total = simd_sum(acc[m][r]);
    const uint n = n0 + r;
    if (lane == uint((m * ROWS + r) % 32) && n < uint(N)) {
      out[size_t(m) * N + n] = static_cast<T>(total);
    }
  }
}
