// Device helpers of qmv_rows.cu (after common.cuh in the kernel's header).
//
// Each helper is one rounding step of MLX's CUDA qmv (mlx/backend/cuda/quantized/qmm/qmv.cu,
// MLX 0.32), so that a row of qmv_rows rounds as that row run alone through qmv does:
//   the weight    q * scale + bias, each step rounded to T (T = float: one fused multiply-add);
//   the products  accumulated per lane and element in T for 2- and 4-bit weights, in float for
//                 8-bit ones (float for T = float), one fused multiply-add a step;
//   the row       the lane's elements summed in float in order, then across the warp with
//                 cooperative_groups' reduce, rounded to T once.
// tests/cuda_compat/cuda_compat.h gives the same names on the CPU (indexing and arithmetic
// checked there); bit-equality with qmv is checked on a GPU (tests/test_kernels_cuda_gpu.py).

namespace dflash {

template <typename T, int BITS>
struct Acc { using type = T; };
template <typename T>
struct Acc<T, 8> { using type = float; };

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

}  // namespace dflash
