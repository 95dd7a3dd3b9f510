// What every dflash-mlx CUDA kernel's header starts with (selection.cuda_header puts it first):
// conversions, the warp's sum as cooperative_groups reduces it (the order MLX's own gemv and qmv
// reduce in), and a tile of consecutive elements read in 16-byte loads.
// tests/cuda_compat gives the same names on the CPU.

#include <cooperative_groups/reduce.h>

namespace dflash {

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

__device__ __forceinline__ float warp_sum(float v) {
  auto warp = cooperative_groups::tiled_partition<32>(cooperative_groups::this_thread_block());
  return cooperative_groups::reduce(warp, v, cooperative_groups::plus<float>());
}

// E consecutive elements, read in vector loads where `p` is aligned to their size (a slice of an
// array may start anywhere), else one by one: the same values either way
template <typename T, int E>
struct alignas(sizeof(T) * E) Tile {
  T v[E];
};

template <typename T, int E>
__device__ __forceinline__ bool tiles_aligned(const T* base, int64_t row_elements) {
  return reinterpret_cast<uintptr_t>(base) % sizeof(Tile<T, E>) == 0 &&
      (row_elements * (int64_t)sizeof(T)) % (int64_t)sizeof(Tile<T, E>) == 0;
}

template <typename T, int E>
__device__ __forceinline__ Tile<T, E> load_tile(const T* p, bool aligned) {
  if (aligned) {
    return *reinterpret_cast<const Tile<T, E>*>(p);
  }
  Tile<T, E> t;
#pragma unroll
  for (int i = 0; i < E; ++i) {
    t.v[i] = p[i];
  }
  return t;
}

}  // namespace dflash
