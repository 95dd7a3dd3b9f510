// Minimal Metal Shading Language compatibility layer for running
// mx.fast.metal_kernel bodies as C++ on the CPU (g++ >= 9, C++17, glibc).
//
// What it provides:
//   * address-space / function qualifiers as macros (device, constant, thread,
//     threadgroup) -- `threadgroup` arrays become function-local statics, which
//     the dispatcher shares between all threads of the one threadgroup it runs
//     at a time (exactly Metal's visibility rule);
//   * vector types (float2/3/4, half2/4, int2/3/4, uint2/3/4) with elementwise
//     arithmetic, float16_t/half and bfloat16_t as 16-bit storage types with
//     round-to-nearest-even conversions (arithmetic happens in float);
//   * metal:: math (metal::, metal::fast::, metal::precise:: all map to the
//     libm float functions);
//   * SIMD-group collectives (simd_sum, simd_max, simd_min, simd_shuffle_xor,
//     simd_shuffle, simd_broadcast, simd_prefix_exclusive_sum) and
//     threadgroup_barrier / simdgroup_barrier, emulated faithfully: every GPU
//     thread of a threadgroup is a ucontext fiber, a collective parks the fiber
//     until every still-running thread of its SIMD-group (or threadgroup, for
//     barriers) has arrived, then all of them resume with the exchanged values.
//     simd_sum reduces with an xor butterfly (1, 2, 4, 8, 16).
//
// What it does not model: divergent control flow *inside* a SIMD-group around
// a collective (lanes that call simd_sum from different branches are treated as
// one collective), half-precision arithmetic (computed in float, rounded when
// stored), simdgroup_matrix, atomics, textures, the exact order of Apple's
// simd_sum tree, and memory-ordering bugs between threadgroups.

#pragma once

// Only light C headers: this file is compiled once per kernel instantiation.
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <type_traits>
#include <ucontext.h>

// ---------------------------------------------------------------- qualifiers
#define device
#define constant
#define thread
#define threadgroup static
#define METAL_FUNC inline

typedef unsigned int uint;
typedef unsigned short ushort;
typedef unsigned char uchar;

// ------------------------------------------------------------ 16-bit floats
namespace mcompat {

inline int imin(int a, int b) { return a < b ? a : b; }
inline uint32_t f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
inline float u2f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

inline uint16_t float_to_half_bits(float f) {
  uint32_t x = f2u(f);
  uint32_t sign = (x >> 16) & 0x8000u;
  uint32_t absx = x & 0x7fffffffu;
  if (absx >= 0x7f800000u) {  // inf or nan
    return sign | 0x7c00u | (absx > 0x7f800000u ? 0x200u : 0u);
  }
  if (absx >= 0x477ff000u) return sign | 0x7c00u;  // rounds to inf
  if (absx < 0x38800000u) {  // subnormal half (or zero)
    // value = absx as float; half subnormal unit is 2^-24
    float a = u2f(absx);
    float scaled = a * 16777216.0f;  // / 2^-24
    uint32_t q = (uint32_t)nearbyintf(scaled);  // default mode: RNE
    return sign | (uint16_t)q;
  }
  uint32_t mant = absx & 0x7fffffu;
  int32_t exp = (int32_t)(absx >> 23) - 127 + 15;
  uint32_t h = ((uint32_t)exp << 10) | (mant >> 13);
  uint32_t rem = mant & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) h += 1;
  return sign | (uint16_t)h;
}

inline float half_bits_to_float(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  if (exp == 0) {
    float v = (float)mant * (1.0f / 16777216.0f);
    return sign ? -v : v;
  }
  if (exp == 31) return u2f(sign | 0x7f800000u | (mant << 13));
  return u2f(sign | ((exp - 15 + 127) << 23) | (mant << 13));
}

inline uint16_t float_to_bf16_bits(float f) {
  uint32_t u = f2u(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}

inline float bf16_bits_to_float(uint16_t b) { return u2f((uint32_t)b << 16); }

}  // namespace mcompat

struct float16_t {
  uint16_t bits;
  float16_t() = default;
  template <class T, class = std::enable_if_t<std::is_arithmetic<T>::value>>
  float16_t(T v) : bits(mcompat::float_to_half_bits((float)v)) {}
  operator float() const { return mcompat::half_bits_to_float(bits); }
};

struct bfloat16_t {
  uint16_t bits;
  bfloat16_t() = default;
  template <class T, class = std::enable_if_t<std::is_arithmetic<T>::value>>
  bfloat16_t(T v) : bits(mcompat::float_to_bf16_bits((float)v)) {}
  bfloat16_t(float16_t v) : bfloat16_t((float)v) {}
  operator float() const { return mcompat::bf16_bits_to_float(bits); }
};

typedef float16_t half;
typedef bfloat16_t bfloat;

// -------------------------------------------------------------- vector types
template <class T, int N>
struct mvec;

#define MCOMPAT_VEC_OPS(N)                                                    \
  T& operator[](int i) { return v[i]; }                                       \
  const T& operator[](int i) const { return v[i]; }                           \
  mvec& operator+=(const mvec& o) { for (int i = 0; i < N; ++i) v[i] += o.v[i]; return *this; } \
  mvec& operator-=(const mvec& o) { for (int i = 0; i < N; ++i) v[i] -= o.v[i]; return *this; } \
  mvec& operator*=(const mvec& o) { for (int i = 0; i < N; ++i) v[i] *= o.v[i]; return *this; } \
  mvec& operator*=(T s) { for (int i = 0; i < N; ++i) v[i] *= s; return *this; }

template <class T>
struct mvec<T, 2> {
  union { struct { T x, y; }; T v[2]; };
  mvec() : x(), y() {}
  mvec(T s) : x(s), y(s) {}
  mvec(T a, T b) : x(a), y(b) {}
  template <class U> explicit mvec(const mvec<U, 2>& o) : x(T(o.x)), y(T(o.y)) {}
  MCOMPAT_VEC_OPS(2)
};

template <class T>
struct mvec<T, 3> {
  union { struct { T x, y, z; }; T v[3]; };
  mvec() : x(), y(), z() {}
  mvec(T s) : x(s), y(s), z(s) {}
  mvec(T a, T b, T c) : x(a), y(b), z(c) {}
  template <class U> explicit mvec(const mvec<U, 3>& o) : x(T(o.x)), y(T(o.y)), z(T(o.z)) {}
  MCOMPAT_VEC_OPS(3)
};

template <class T>
struct mvec<T, 4> {
  union { struct { T x, y, z, w; }; T v[4]; };
  mvec() : x(), y(), z(), w() {}
  mvec(T s) : x(s), y(s), z(s), w(s) {}
  mvec(T a, T b, T c, T d) : x(a), y(b), z(c), w(d) {}
  template <class U> explicit mvec(const mvec<U, 4>& o) : x(T(o.x)), y(T(o.y)), z(T(o.z)), w(T(o.w)) {}
  MCOMPAT_VEC_OPS(4)
};

#define MCOMPAT_VEC_BINOP(op)                                                          \
  template <class T, int N> mvec<T, N> operator op(mvec<T, N> a, const mvec<T, N>& b) { \
    for (int i = 0; i < N; ++i) a.v[i] = a.v[i] op b.v[i]; return a; }                 \
  template <class T, int N> mvec<T, N> operator op(mvec<T, N> a, T s) {                 \
    for (int i = 0; i < N; ++i) a.v[i] = a.v[i] op s; return a; }                      \
  template <class T, int N> mvec<T, N> operator op(T s, mvec<T, N> a) {                 \
    for (int i = 0; i < N; ++i) a.v[i] = s op a.v[i]; return a; }
MCOMPAT_VEC_BINOP(+)
MCOMPAT_VEC_BINOP(-)
MCOMPAT_VEC_BINOP(*)
MCOMPAT_VEC_BINOP(/)

typedef mvec<float, 2> float2;
typedef mvec<float, 3> float3;
typedef mvec<float, 4> float4;
typedef mvec<half, 2> half2;
typedef mvec<half, 4> half4;
typedef mvec<int, 2> int2;
typedef mvec<int, 3> int3;
typedef mvec<int, 4> int4;
typedef mvec<uint, 2> uint2;
typedef mvec<uint, 3> uint3;
typedef mvec<uint, 4> uint4;

// ------------------------------------------------------------------ math
namespace metal {
#define MCOMPAT_UNARY(name, expr) \
  inline float name(float x) { return expr; }
#define MCOMPAT_MATH_SET                                  \
  MCOMPAT_UNARY(exp, expf(x))                         \
  MCOMPAT_UNARY(exp2, exp2f(x))                       \
  MCOMPAT_UNARY(log, logf(x))                         \
  MCOMPAT_UNARY(log2, log2f(x))                       \
  MCOMPAT_UNARY(sqrt, sqrtf(x))                       \
  MCOMPAT_UNARY(rsqrt, 1.0f / sqrtf(x))               \
  MCOMPAT_UNARY(cos, cosf(x))                         \
  MCOMPAT_UNARY(sin, sinf(x))                         \
  MCOMPAT_UNARY(tanh, tanhf(x))                       \
  MCOMPAT_UNARY(abs, fabsf(x))                        \
  MCOMPAT_UNARY(fabs, fabsf(x))                       \
  MCOMPAT_UNARY(floor, floorf(x))                     \
  MCOMPAT_UNARY(ceil, ceilf(x))                       \
  inline float pow(float a, float b) { return powf(a, b); } \
  inline float fma(float a, float b, float c) { return fmaf(a, b, c); } \
  inline float max(float a, float b) { return fmaxf(a, b); } \
  inline float min(float a, float b) { return fminf(a, b); }
MCOMPAT_MATH_SET
inline int max(int a, int b) { return a > b ? a : b; }
inline int min(int a, int b) { return a < b ? a : b; }
inline uint max(uint a, uint b) { return a > b ? a : b; }
inline uint min(uint a, uint b) { return a < b ? a : b; }
namespace fast { MCOMPAT_MATH_SET }
namespace precise { MCOMPAT_MATH_SET }
template <int N>
inline float dot(const mvec<float, N>& a, const mvec<float, N>& b) {
  float s = 0.0f;
  for (int i = 0; i < N; ++i) s += a.v[i] * b.v[i];
  return s;
}
enum class mem_flags { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4 };
inline mem_flags operator|(mem_flags a, mem_flags b) { return mem_flags(int(a) | int(b)); }
}  // namespace metal

// ----------------------------------------------------------- the dispatcher
namespace mcompat {

enum WaitKind { RUNNABLE = 0, WAIT_SIMD = 1, WAIT_TG = 2, DONE = 3 };

struct ThreadInfo {
  uint3 thread_position_in_grid;
  uint3 thread_position_in_threadgroup;
  uint3 threadgroup_position_in_grid;
  uint3 threads_per_grid;
  uint3 threads_per_threadgroup;
  uint3 threadgroups_per_grid;
  uint3 grid_size;
  uint3 grid_origin;
  uint3 dispatch_threads_per_threadgroup;
  uint thread_index_in_threadgroup;
  uint thread_index_in_simdgroup;
  uint simdgroup_index_in_threadgroup;
  uint simdgroups_per_threadgroup;
  uint dispatch_simdgroups_per_threadgroup;
  uint threads_per_simdgroup;
  uint thread_execution_width;
  uint thread_index_in_quadgroup;
  uint quadgroup_index_in_threadgroup;
  uint quadgroups_per_threadgroup;
  uint dispatch_quadgroups_per_threadgroup;
};

constexpr int kSimdWidth = 32;
constexpr int kSlotBytes = 16;  // largest exchanged value (float4)
constexpr size_t kStackBytes = 256 * 1024;

struct Fiber {
  ucontext_t ctx;
  int state = RUNNABLE;
  unsigned coll_seq = 0;  // collectives issued so far (selects the buffer)
  int wait_buf = 0;
  ThreadInfo ti;
};

struct SimdGroup {
  // Double-buffered exchange slots: a lane can be at most one collective
  // ahead of the slowest lane of its group, so two buffers never collide.
  unsigned char slot[2][kSimdWidth][kSlotBytes];
  bool active[2][kSimdWidth];
};

typedef void (*ThreadFn)(void* ctx, const ThreadInfo& ti);

struct Group {
  ucontext_t sched;
  Fiber* fibers = nullptr;      // one per thread of the current threadgroup
  SimdGroup* simd = nullptr;
  char** stacks = nullptr;
  int n = 0, nsimd = 0, capacity = 0;
  ThreadFn body = nullptr;
  void* ctx = nullptr;
  char error[512] = {0};
};

inline Group*& cur_group() { static Group* g = nullptr; return g; }
inline Fiber*& cur_fiber() { static Fiber* f = nullptr; return f; }

inline void fail(const char* msg) {
  Group* g = cur_group();
  if (g && !g->error[0]) snprintf(g->error, sizeof(g->error), "%s", msg);
}

inline void park(int kind) {
  Fiber* f = cur_fiber();
  f->state = kind;
  swapcontext(&f->ctx, &cur_group()->sched);
}

inline void trampoline() {
  Group* g = cur_group();
  Fiber* f = cur_fiber();
  g->body(g->ctx, f->ti);
  f->state = DONE;
  // uc_link returns to the scheduler.
}

// Exchange `x` with the other running lanes of this SIMD-group; returns the
// buffer holding every lane's value and which lanes took part.
template <class T>
inline int simd_exchange(const T& x) {
  static_assert(sizeof(T) <= kSlotBytes, "value too large for a SIMD exchange");
  Fiber* f = cur_fiber();
  SimdGroup& sg = cur_group()->simd[f->ti.simdgroup_index_in_threadgroup];
  int buf = f->coll_seq++ & 1;
  memcpy(sg.slot[buf][f->ti.thread_index_in_simdgroup], &x, sizeof(T));
  f->wait_buf = buf;
  park(WAIT_SIMD);
  return buf;
}

template <class T>
inline T simd_get(int buf, int lane) {
  Fiber* f = cur_fiber();
  SimdGroup& sg = cur_group()->simd[f->ti.simdgroup_index_in_threadgroup];
  T v;
  memcpy(&v, sg.slot[buf][lane], sizeof(T));
  return v;
}

inline bool simd_active(int buf, int lane) {
  Fiber* f = cur_fiber();
  return lane >= 0 && lane < kSimdWidth &&
      cur_group()->simd[f->ti.simdgroup_index_in_threadgroup].active[buf][lane];
}

// Prepares fibers, SIMD-group exchange slots and stacks for `n` threads.
inline void setup_threadgroup(Group& g, int n) {
  if (n > g.capacity) {
    delete[] g.fibers;
    delete[] g.simd;
    g.fibers = new Fiber[n];
    g.simd = new SimdGroup[(n + kSimdWidth - 1) / kSimdWidth];
    char** stacks = new char*[n];
    for (int i = 0; i < n; ++i) stacks[i] = i < g.capacity ? g.stacks[i] : (char*)malloc(kStackBytes);
    delete[] g.stacks;
    g.stacks = stacks;
    g.capacity = n;
  }
  g.n = n;
  g.nsimd = (n + kSimdWidth - 1) / kSimdWidth;
  for (int i = 0; i < n; ++i) g.fibers[i] = Fiber();
  memset(g.simd, 0, sizeof(SimdGroup) * g.nsimd);
}

// Runs the prepared threadgroup to completion. Returns false (with g.error
// set) on deadlock.
inline bool schedule(Group& g) {
  int n = g.n;
  for (int i = 0; i < n; ++i) {
    Fiber& f = g.fibers[i];
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = g.stacks[i];
    f.ctx.uc_stack.ss_size = kStackBytes;
    f.ctx.uc_link = &g.sched;
    makecontext(&f.ctx, (void (*)())trampoline, 0);
  }
  int nsimd = g.nsimd;
  while (true) {
    bool ran = false;
    for (int i = 0; i < n; ++i) {
      Fiber& f = g.fibers[i];
      if (f.state != RUNNABLE) continue;
      cur_fiber() = &f;
      swapcontext(&g.sched, &f.ctx);
      ran = true;
      if (g.error[0]) return false;
    }
    // Release SIMD-groups whose running lanes all wait at a collective.
    bool released = false;
    for (int s = 0; s < nsimd; ++s) {
      int lo = s * kSimdWidth, hi = mcompat::imin(n, lo + kSimdWidth);
      int waiting = 0, alive = 0;
      for (int i = lo; i < hi; ++i) {
        if (g.fibers[i].state == DONE) continue;
        ++alive;
        if (g.fibers[i].state == WAIT_SIMD) ++waiting;
      }
      if (alive > 0 && waiting == alive) {
        int buf = g.fibers[lo].wait_buf;
        for (int i = lo; i < hi; ++i)
          if (g.fibers[i].state == WAIT_SIMD) buf = g.fibers[i].wait_buf;
        for (int l = 0; l < kSimdWidth; ++l) g.simd[s].active[buf][l] = false;
        for (int i = lo; i < hi; ++i) {
          if (g.fibers[i].state != WAIT_SIMD) continue;
          if (g.fibers[i].wait_buf != buf) {
            fail("SIMD-group lanes reached different collectives (divergent control flow)");
            return false;
          }
          g.simd[s].active[buf][i - lo] = true;
          g.fibers[i].state = RUNNABLE;
        }
        released = true;
      }
    }
    // Release the threadgroup barrier once every running thread is there.
    int waiting_tg = 0, alive = 0;
    for (int i = 0; i < n; ++i) {
      if (g.fibers[i].state == DONE) continue;
      ++alive;
      if (g.fibers[i].state == WAIT_TG) ++waiting_tg;
    }
    if (alive == 0) return true;
    if (waiting_tg == alive) {
      for (int i = 0; i < n; ++i)
        if (g.fibers[i].state == WAIT_TG) g.fibers[i].state = RUNNABLE;
      released = true;
    }
    if (!ran && !released) {
      fail("deadlock: threads wait at barriers/collectives that can never complete");
      return false;
    }
  }
}

// Dispatches `grid` threads in threadgroups of `tg` (non-uniform edge groups,
// like dispatchThreads), one threadgroup at a time.
inline int dispatch(const int* grid, const int* tg, ThreadFn body, void* ctx,
                    char* err, int errlen) {
  Group g;
  cur_group() = &g;
  g.body = body;
  g.ctx = ctx;
  int ngx = (grid[0] + tg[0] - 1) / tg[0];
  int ngy = (grid[1] + tg[1] - 1) / tg[1];
  int ngz = (grid[2] + tg[2] - 1) / tg[2];
  int rc = 0;
  for (int gz = 0; gz < ngz && rc == 0; ++gz)
    for (int gy = 0; gy < ngy && rc == 0; ++gy)
      for (int gx = 0; gx < ngx && rc == 0; ++gx) {
        int ax = mcompat::imin(tg[0], grid[0] - gx * tg[0]);
        int ay = mcompat::imin(tg[1], grid[1] - gy * tg[1]);
        int az = mcompat::imin(tg[2], grid[2] - gz * tg[2]);
        int n = ax * ay * az;
        setup_threadgroup(g, n);
        for (int i = 0; i < n; ++i) {
          ThreadInfo& t = g.fibers[i].ti;
          uint lx = i % ax, ly = (i / ax) % ay, lz = i / (ax * ay);
          t.thread_position_in_threadgroup = uint3(lx, ly, lz);
          t.threadgroup_position_in_grid = uint3(gx, gy, gz);
          t.thread_position_in_grid = uint3(gx * tg[0] + lx, gy * tg[1] + ly, gz * tg[2] + lz);
          t.threads_per_grid = uint3(grid[0], grid[1], grid[2]);
          t.grid_size = t.threads_per_grid;
          t.grid_origin = uint3(0, 0, 0);
          t.threads_per_threadgroup = uint3(ax, ay, az);
          t.dispatch_threads_per_threadgroup = uint3(tg[0], tg[1], tg[2]);
          t.threadgroups_per_grid = uint3(ngx, ngy, ngz);
          t.thread_index_in_threadgroup = i;
          t.thread_index_in_simdgroup = i % kSimdWidth;
          t.simdgroup_index_in_threadgroup = i / kSimdWidth;
          t.simdgroups_per_threadgroup = (n + kSimdWidth - 1) / kSimdWidth;
          t.dispatch_simdgroups_per_threadgroup = (tg[0] * tg[1] * tg[2] + kSimdWidth - 1) / kSimdWidth;
          t.threads_per_simdgroup = kSimdWidth;
          t.thread_execution_width = kSimdWidth;
          t.thread_index_in_quadgroup = i % 4;
          t.quadgroup_index_in_threadgroup = i / 4;
          t.quadgroups_per_threadgroup = (n + 3) / 4;
          t.dispatch_quadgroups_per_threadgroup = (tg[0] * tg[1] * tg[2] + 3) / 4;
        }
        if (!schedule(g)) {
          snprintf(err, errlen, "threadgroup (%d,%d,%d): %s", gx, gy, gz, g.error);
          rc = 1;
        }
      }
  for (int i = 0; i < g.capacity; ++i) free(g.stacks[i]);
  delete[] g.stacks;
  delete[] g.fibers;
  delete[] g.simd;
  cur_group() = nullptr;
  return rc;
}

}  // namespace mcompat

// ------------------------------------------------------ Metal collectives
template <class T>
inline T simd_sum(T x) {
  int buf = mcompat::simd_exchange(x);
  T v[mcompat::kSimdWidth];
  for (int l = 0; l < mcompat::kSimdWidth; ++l)
    v[l] = mcompat::simd_active(buf, l) ? mcompat::simd_get<T>(buf, l) : T(0);
  // xor butterfly: the reduction tree a shuffle-based simd_sum performs.
  for (int off = 1; off < mcompat::kSimdWidth; off <<= 1) {
    T nv[mcompat::kSimdWidth];
    for (int l = 0; l < mcompat::kSimdWidth; ++l) nv[l] = v[l] + v[l ^ off];
    for (int l = 0; l < mcompat::kSimdWidth; ++l) v[l] = nv[l];
  }
  return v[mcompat::cur_fiber()->ti.thread_index_in_simdgroup];
}

template <class T, class Op>
inline T mcompat_simd_fold(T x, Op op) {
  int buf = mcompat::simd_exchange(x);
  bool first = true;
  T r = x;
  for (int l = 0; l < mcompat::kSimdWidth; ++l) {
    if (!mcompat::simd_active(buf, l)) continue;
    T v = mcompat::simd_get<T>(buf, l);
    r = first ? v : op(r, v);
    first = false;
  }
  return r;
}

template <class T>
inline T simd_max(T x) { return mcompat_simd_fold(x, [](T a, T b) { return a > b ? a : b; }); }
template <class T>
inline T simd_min(T x) { return mcompat_simd_fold(x, [](T a, T b) { return a < b ? a : b; }); }

template <class T>
inline T simd_shuffle(T x, ushort lane) {
  int buf = mcompat::simd_exchange(x);
  // Reading an inactive lane is undefined in Metal; return our own value.
  return mcompat::simd_active(buf, lane) ? mcompat::simd_get<T>(buf, lane) : x;
}
template <class T>
inline T simd_broadcast(T x, ushort lane) { return simd_shuffle(x, lane); }
template <class T>
inline T simd_shuffle_xor(T x, ushort mask) {
  int lane = (int)mcompat::cur_fiber()->ti.thread_index_in_simdgroup ^ (int)mask;
  return simd_shuffle(x, (ushort)lane);
}
template <class T>
inline T simd_prefix_exclusive_sum(T x) {
  int buf = mcompat::simd_exchange(x);
  int me = (int)mcompat::cur_fiber()->ti.thread_index_in_simdgroup;
  T s = T(0);
  for (int l = 0; l < me; ++l)
    if (mcompat::simd_active(buf, l)) s = s + mcompat::simd_get<T>(buf, l);
  return s;
}

inline void threadgroup_barrier(metal::mem_flags) { mcompat::park(mcompat::WAIT_TG); }
inline void simdgroup_barrier(metal::mem_flags) {
  mcompat::simd_exchange(0);
}
