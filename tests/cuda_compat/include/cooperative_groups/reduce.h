// cooperative_groups for cuda_compat.h: a block, its 32-thread tiles, and reduce over a tile
// (an xor butterfly through the fibers' SIMD-group exchange; the GPU's tree order may differ).
#pragma once

namespace cooperative_groups {

struct thread_block {};
inline thread_block this_thread_block() { return {}; }

template <unsigned Size>
struct thread_block_tile {
  static_assert(Size == 32, "cuda_compat: tiles of a whole warp only");
};
template <unsigned Size>
inline thread_block_tile<Size> tiled_partition(const thread_block&) { return {}; }

template <class T>
struct plus {
  T operator()(T a, T b) const { return a + b; }
};

template <class T, class Op>
inline T reduce(const thread_block_tile<32>&, T v, Op op) {
  for (int offset = 16; offset > 0; offset /= 2) {
    v = op(v, simd_shuffle_xor(v, ushort(offset)));
  }
  return v;
}

}  // namespace cooperative_groups
