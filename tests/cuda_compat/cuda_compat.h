// Minimal CUDA compatibility layer for running mx.fast.cuda_kernel bodies (and their
// headers) as C++ on the CPU, on top of tests/metal_compat/metal_compat.h's fibers: every
// GPU thread of a block is a fiber, a warp is a SIMD-group of 32, warp collectives park until
// the warp has arrived.
//
// What it provides: __device__ / __global__ / __forceinline__ as nothing; __half and
// __nv_bfloat16 as 16-bit storage types (round to nearest even on store); the cuda_fp16 /
// cuda_bf16 intrinsics the kernels here use; __shfl_xor_sync; cooperative_groups' block,
// tiled_partition<32> and reduce (include/cooperative_groups/reduce.h).
//
// What it does not model: half-precision arithmetic (a product or sum is computed in float
// and rounded once: a 16-bit fused multiply-add is then rounded twice, float then 16-bit,
// where the GPU rounds once), the order of cooperative_groups' reduce tree (an xor butterfly
// here), shared memory, atomics, and memory ordering between blocks. So it checks indexing,
// launch geometry and arithmetic up to those roundings; bit-equality with MLX's own kernels
// is a GPU check.

#pragma once

#include "metal_compat.h"

#define __device__
#define __global__
#define __forceinline__
#define __host__

typedef float16_t __half;
typedef bfloat16_t __nv_bfloat16;

inline float __half2float(__half v) { return float(v); }
inline float __bfloat162float(__nv_bfloat16 v) { return float(v); }
inline __half __float2half_rn(float v) { return __half(v); }
inline __nv_bfloat16 __float2bfloat16_rn(float v) { return __nv_bfloat16(v); }
inline __half __uint2half_rn(unsigned int v) { return __half(float(v)); }
inline __nv_bfloat16 __uint2bfloat16_rn(unsigned int v) { return __nv_bfloat16(float(v)); }
inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }

template <class T>
inline T __hmul(T a, T b) { return T(float(a) * float(b)); }
template <class T>
inline T __hadd(T a, T b) { return T(float(a) + float(b)); }
template <class T>
inline T __hfma(T a, T b, T c) { return T(fmaf(float(a), float(b), float(c))); }

template <class T>
inline T __shfl_xor_sync(unsigned /*mask*/, T v, int lane_mask) { return simd_shuffle_xor(v, ushort(lane_mask)); }
