// Device helpers of qmv_rows.cu (the `header` of its mx.fast.cuda_kernel).
//
// Each helper is one rounding step of MLX's CUDA qmv (mlx/backend/cuda/quantized/qmm/qmv.cu,
// MLX 0.32), so that a row of qmv_rows rounds as that row run alone through qmv does:
//   the weight    q * scale + bias, each step rounded to T (T = float: one fused multiply-add);
//   the products  accumulated per lane and element in T for 2- and 4-bit weights, in float for
//                 8-bit ones (float for T = float), one fused multiply-add a step;
//   the row       the lane's elements summed in float in order, then across the warp with
//                 cooperative_groups' reduce, rounded to T once.
// tests/cuda_compat/cuda_compat.h gives the same names on the CPU (indexing and arithmetic
// checked there); bit-equality with qmv is checked on a GPU (benchmarks/gpu, kernels part).

#include <cooperative_groups/reduce.h>

namespace dflash {

// E consecutive elements of x, read in 16-byte loads (a tile starts 32-byte aligned: K % 32 == 0)
template <typename T, int E>
struct alignas(sizeof(T) * E) Tile {
  T v[E];
};

template <typename T, int BITS>
struct Acc { using type = T; };
template <typename T>
struct Acc<T, 8> { using type = float; };

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

// q * scale + bias: the dequantized weight
__device__ __forceinline__ float dequant(uint32_t q, float scale, float bias) {
  return __fmaf_rn(float(q), scale, bias);
}
__device__ __forceinline__ __half dequant(uint32_t q, __half scale, __half bias) {
  return __hadd(__hmul(__uint2half_rn(q), scale), bias);
}
__device__ __forceinline__ __nv_bfloat16 dequant(uint32_t q, __nv_bfloat16 scale, __nv_bfloat16 bias) {
  return __hadd(__hmul(__uint2bfloat16_rn(q), scale), bias);
}

// acc + x * w, one rounding
__device__ __forceinline__ float fma_acc(float x, float w, float acc) { return __fmaf_rn(x, w, acc); }
__device__ __forceinline__ float fma_acc(__half x, __half w, float acc) {
  return __fmaf_rn(__half2float(x), __half2float(w), acc);
}
__device__ __forceinline__ float fma_acc(__nv_bfloat16 x, __nv_bfloat16 w, float acc) {
  return __fmaf_rn(__bfloat162float(x), __bfloat162float(w), acc);
}
__device__ __forceinline__ __half fma_acc(__half x, __half w, __half acc) { return __hfma(x, w, acc); }
__device__ __forceinline__ __nv_bfloat16 fma_acc(__nv_bfloat16 x, __nv_bfloat16 w, __nv_bfloat16 acc) {
  return __hfma(x, w, acc);
}

__device__ __forceinline__ float warp_sum(float v) {
  auto warp = cooperative_groups::tiled_partition<32>(cooperative_groups::this_thread_block());
  return cooperative_groups::reduce(warp, v, cooperative_groups::plus<float>());
}

}  // namespace dflash
