// The NaN rule's scans: whether a block of values holds NaN or +-inf, over float and double
// values, or over the bits of bf16 and fp16 storage.

#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "../simd.h"

namespace {

// True when any of rows x cols entries (row stride ld) is NaN or infinite: x * 0 is 0 exactly
// for finite x and NaN otherwise. Run on blocks the kernel has just read, so the NaN rule needs
// no separate pass over q, k and v (at decode that pass would double the bytes read). Four
// accumulators: one would chain every add of the block behind the one before.
template <typename T>
bool any_nonfinite(const T* x, int64_t rows, int64_t cols, int64_t ld) {
  using V = typename Vec<T>::type;
  constexpr int lanes = kVecBytes / sizeof(T);
  V acc[4] = {};
  T tail = 0;
  for (int64_t i = 0; i < rows; ++i) {
    const T* r = x + i * ld;
    int64_t j = 0;
    for (; j + 4 * lanes <= cols; j += 4 * lanes)
      for (int u = 0; u < 4; ++u) {
        V v;
        std::memcpy(&v, r + j + u * lanes, sizeof(V));
        acc[u] += v * T(0);
      }
    for (; j + lanes <= cols; j += lanes) {
      V v;
      std::memcpy(&v, r + j, sizeof(V));
      acc[0] += v * T(0);
    }
    for (; j < cols; ++j) tail += r[j] * T(0);
  }
  const V all = (acc[0] + acc[1]) + (acc[2] + acc[3]);
  for (int l = 0; l < lanes; ++l) tail += all[l];
  return tail != T(0);
}

// The exponent bits of 16-bit storage (bf16: 0x7f80, fp16: 0x7c00): a value is NaN or infinite
// exactly when all of them are set.
template <typename E>
constexpr uint16_t kExponentBits = std::is_same_v<E, at::Half> ? 0x7c00 : 0x7f80;

// The same for 16-bit storage, on the bits (kExponentBits). Whole vectors of 16-bit words are
// compared at once (decoding over a bf16 cache checks every key it reads).
template <uint16_t kExponent, typename E>
bool any_nonfinite_bits(const E* x, int64_t rows, int64_t cols, int64_t ld) {
  typedef uint16_t Words __attribute__((vector_size(kVecBytes)));
  constexpr int64_t lanes = kVecBytes / 2;
  Words acc = {};
  uint16_t tail = 0;
  for (int64_t i = 0; i < rows; ++i) {
    const E* r = x + i * ld;
    int64_t j = 0;
    for (; j + lanes <= cols; j += lanes) {
      Words w;
      std::memcpy(&w, r + j, sizeof(w));
      acc |= (Words)((w & kExponent) == kExponent);
    }
    for (; j < cols; ++j) {
      uint16_t w;
      std::memcpy(&w, r + j, sizeof(w));
      tail |= (w & kExponent) == kExponent;
    }
  }
  for (int64_t l = 0; l < lanes; ++l) tail |= acc[l];
  return tail != 0;
}
inline bool any_nonfinite(const at::BFloat16* x, int64_t rows, int64_t cols, int64_t ld) {
  return any_nonfinite_bits<kExponentBits<at::BFloat16>>(x, rows, cols, ld);
}
inline bool any_nonfinite(const at::Half* x, int64_t rows, int64_t cols, int64_t ld) {
  return any_nonfinite_bits<kExponentBits<at::Half>>(x, rows, cols, ld);
}

}  // namespace
