// The vectors both C++ kernels compute with (fused_attention.cpp, rows_linear.cpp): GCC/Clang
// vector extensions, which map onto SSE, AVX2, AVX-512 or NEON, whatever -march allows, their
// loads and stores, bf16 rounding and widening, and sums and maxima across their lanes.
//
// Two widths: the CPU's own (VF, kLanes floats: the fused kernel's rows) and 16 float lanes on
// every CPU (VF16: the few-row products sum each output in 16 lanes whatever the width, so
// their bits are the same everywhere).
//
// Each kernel is one translation unit that includes this header: everything here is internal
// to it (an anonymous namespace), as it would be in the kernel's own file.

#pragma once

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#if defined(__AVX__)
#include <immintrin.h>
#endif

namespace {

#if defined(__AVX512F__)
constexpr int kVecBytes = 64;
#elif defined(__AVX__)
constexpr int kVecBytes = 32;
#else
constexpr int kVecBytes = 16;
#endif

// A vector of T: the CPU's width, or kBytes
template <typename T, int kBytes = kVecBytes>
struct Vec {
  typedef T type __attribute__((vector_size(kBytes)));
};

struct IntVec {
  typedef int32_t type __attribute__((vector_size(kVecBytes)));
};

using VF = Vec<float>::type;
using VI = IntVec::type;
constexpr int kLanes = kVecBytes / sizeof(float);

inline VF load(const float* p) {
  VF v;
  std::memcpy(&v, p, sizeof(VF));
  return v;
}
inline void store(float* p, VF v) { std::memcpy(p, &v, sizeof(VF)); }
// the first `count` lanes from p, the rest `fill` (row tails run through the same vector code);
// with AVX-512 one masked load (a memcpy of a variable count is a library call)
inline VF load_part(const float* p, int64_t count, float fill) {
#if defined(__AVX512F__)
  const __m512 v = _mm512_mask_loadu_ps(_mm512_set1_ps(fill),
                                        static_cast<__mmask16>((1u << count) - 1), p);
  VF r;
  std::memcpy(&r, &v, sizeof(r));
  return r;
#else
  VF v = VF{} + fill;
  std::memcpy(&v, p, count * sizeof(float));
  return v;
#endif
}

// the first `count` lanes of v to p
inline void store_part(float* p, VF v, int64_t count) {
#if defined(__AVX512F__)
  _mm512_mask_storeu_ps(p, static_cast<__mmask16>((1u << count) - 1),
                        reinterpret_cast<const __m512&>(v));
#else
  std::memcpy(p, &v, count * sizeof(float));
#endif
}

// Whether any lane of a comparison's result is set
inline bool any_lane(VI mask) {
#if defined(__AVX512F__)
  const __m512i m = reinterpret_cast<const __m512i&>(mask);
  return _mm512_test_epi32_mask(m, m) != 0;
#else
  int32_t folded = 0;
  for (int l = 0; l < kLanes; ++l) folded |= mask[l];
  return folded != 0;
#endif
}

// Row reductions over whole vectors: without -ffast-math (which would break -inf) compilers
// vectorize neither a float sum nor a max, so the lanes are spelled out.
inline float hmax(VF v, float init) {
  for (int l = 0; l < kLanes; ++l) init = std::max(init, v[l]);
  return init;
}
inline float hsum(VF v) {
  float total = 0;
  for (int l = 0; l < kLanes; ++l) total += v[l];
  return total;
}

// The sum of a vector's lanes by halving: each step adds the upper half of the lanes left onto
// the lower (a shuffle and an add), log2(lanes) steps deep. Summing the lanes one by one would
// be a chain of dependent adds per key, bounding decoding's score loop by its latency.
template <typename V>
inline auto tree_sum(V x) {
  constexpr int lanes = sizeof(V) / sizeof(x[0]);
  if constexpr (lanes == 16)
    x += __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  if constexpr (lanes >= 8) {
    if constexpr (lanes == 16)
      x += __builtin_shufflevector(x, x, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3);
    else
      x += __builtin_shufflevector(x, x, 4, 5, 6, 7, 0, 1, 2, 3);
  }
  if constexpr (lanes >= 4) {
    if constexpr (lanes == 16)
      x += __builtin_shufflevector(x, x, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1);
    else if constexpr (lanes == 8)
      x += __builtin_shufflevector(x, x, 2, 3, 0, 1, 2, 3, 0, 1);
    else
      x += __builtin_shufflevector(x, x, 2, 3, 0, 1);
  }
  if constexpr (lanes == 16)
    x += __builtin_shufflevector(x, x, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0);
  else if constexpr (lanes == 8)
    x += __builtin_shufflevector(x, x, 1, 0, 1, 0, 1, 0, 1, 0);
  else if constexpr (lanes == 4)
    x += __builtin_shufflevector(x, x, 1, 0, 1, 0);
  else
    x += __builtin_shufflevector(x, x, 1, 0);
  return x[0];
}

// kLanes 16-bit words
typedef uint16_t VH __attribute__((vector_size(kLanes * 2)));

// bf16(v) lane by lane, rounded to nearest even (finite inputs)
inline VH round_bf16(VF v) {
  typedef uint32_t Bits __attribute__((vector_size(kVecBytes)));
  Bits bits;
  std::memcpy(&bits, &v, sizeof(bits));
  bits = (bits + 0x7fff + ((bits >> 16) & 1)) >> 16;
  return __builtin_convertvector(bits, VH);
}

// dst[j] = bf16(src[j]), rounded to nearest even (finite inputs)
inline void to_bf16(c10::BFloat16* dst, const float* src, int64_t n) {
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    const VH narrow = round_bf16(load(src + j));
    std::memcpy(dst + j, &narrow, sizeof(narrow));
  }
  for (; j < n; ++j) dst[j] = c10::BFloat16(src[j]);
}

// Lanes of V (VF unless given) from stored values, as float: float as they are, bf16 widened
// (the top half of a float32), int8 converted (exactly). 16 lanes with AVX-512 take one
// widening instruction each: GCC's generic conversions split the bf16 words in halves and
// convert int8 lane by lane.
template <typename V = VF>
inline V load_float(const float* p) {
  V v;
  std::memcpy(&v, p, sizeof(V));
  return v;
}
template <typename V = VF>
inline V load_float(const c10::BFloat16* p) {
#if defined(__AVX512F__)
  if constexpr (sizeof(V) == 64) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
#endif
  using Words = typename Vec<uint16_t, sizeof(V) / 2>::type;
  using Bits = typename Vec<uint32_t, sizeof(V)>::type;
  Words narrow;
  std::memcpy(&narrow, p, sizeof(narrow));
  const Bits bits = __builtin_convertvector(narrow, Bits) << 16;
  V v;
  std::memcpy(&v, &bits, sizeof(v));
  return v;
}
template <typename V = VF>
inline V load_float(const int8_t* p) {
#if defined(__AVX512F__)
  if constexpr (sizeof(V) == 64) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
  }
#endif
  V v;
  for (size_t l = 0; l < sizeof(V) / sizeof(float); ++l) v[l] = static_cast<float>(p[l]);
  return v;
}

// A vector of T from lanes stored values: float and double as they are, bf16 widened.
template <typename T>
inline typename Vec<T>::type load_as(const T* p) {
  typename Vec<T>::type v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
template <typename T>
inline VF load_as(const c10::BFloat16* p) {
  return load_float(p);
}

// 16 float lanes on every CPU (two or four registers where vectors are narrower)
using VF16 = Vec<float, 64>::type;

// acc + a * b in every lane, rounded once (a fused multiply-add) where the CPU has one: with
// AVX-512 by its instruction, elsewhere as the compiler contracts the expression for -march
inline VF16 mul_add(VF16 a, VF16 b, VF16 acc) {
#if defined(__AVX512F__)
  return _mm512_fmadd_ps(a, b, acc);
#else
  return acc + a * b;
#endif
}

// The cache line at p fetched into L2 for reading, ahead of its use: a stream of a few KiB is
// too short for the hardware prefetcher to ramp up
inline void prefetch_l2(const void* p) { __builtin_prefetch(p, 0, 2); }

}  // namespace
