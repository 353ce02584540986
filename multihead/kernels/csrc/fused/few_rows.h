// Decoding's products (a few query rows, L <= kDecodeRows of plan.h): scores and values against the keys
// and values read in place, each key row loaded once for all the query rows, float32 or
// double keys as they are, bf16 keys widened as they are loaded or, where the CPU has them,
// through its bf16 dot products.

#pragma once

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "../simd.h"

namespace {

// how far ahead of its reads decoding fetches keys and values into L2
constexpr int64_t kAheadBytes = 4096;

// f(i, rows) for the rows [i, i + R) of m, 8 at a time and then the rest, with R a constant
// (std::integral_constant): decoding's row loops take their row count as a template argument,
// so their R accumulators stay in registers.
template <typename F>
inline void in_row_blocks(int64_t m, F&& f) {
  using std::integral_constant;
  for (int64_t i = 0; i < m; i += 8) {
    switch (std::min<int64_t>(8, m - i)) {
      case 1: f(i, integral_constant<int, 1>{}); break;
      case 2: f(i, integral_constant<int, 2>{}); break;
      case 3: f(i, integral_constant<int, 3>{}); break;
      case 4: f(i, integral_constant<int, 4>{}); break;
      case 5: f(i, integral_constant<int, 5>{}); break;
      case 6: f(i, integral_constant<int, 6>{}); break;
      case 7: f(i, integral_constant<int, 7>{}); break;
      default: f(i, integral_constant<int, 8>{}); break;
    }
  }
}

// C[R, n] = alpha * A B^T for R rows of A (T, row stride lda) and n rows of B (E, row stride
// ldb): decoding's scores. Each vector of a key row is loaded (and widened) once and serves
// all R query rows, whose sums over the vectors stay in R registers and are summed across
// lanes once per key; the k % lanes tail is added after, in order (so a row's sum is the same
// whatever R computes it).
template <typename T, typename E, int R>
void dots_rows(int64_t n, int64_t k, T alpha, const T* a, int64_t lda, const E* b, int64_t ldb,
               T* c, int64_t ldc, const char* next, int64_t next_ld, int64_t next_bytes) {
  using V = typename Vec<T>::type;
  constexpr int64_t lanes = kVecBytes / sizeof(T);
  const int64_t whole = k / lanes * lanes;
  for (int64_t j = 0; j < n; ++j) {
    const E* bj = b + j * ldb;
    if (next != nullptr)  // the value row of this key, for the product with V that follows
      for (int64_t off = 0; off < next_bytes; off += 64)
        prefetch_l2(next + j * next_ld + off);
    V acc[R];
    for (int r = 0; r < R; ++r) acc[r] = V{};
    for (int64_t p = 0; p < whole; p += lanes) {
      // the key rows ahead, into L2: one stream of a few KiB per call is too short for the
      // hardware prefetcher to reach the read bandwidth
      prefetch_l2(reinterpret_cast<const char*>(bj + p) + kAheadBytes);
      const V y = load_as<T>(bj + p);
      for (int r = 0; r < R; ++r) {
        V x;
        std::memcpy(&x, a + r * lda + p, sizeof(V));
        acc[r] += x * y;
      }
    }
    for (int r = 0; r < R; ++r) {
      T total = tree_sum(acc[r]);
      for (int64_t p = whole; p < k; ++p) total += a[r * lda + p] * static_cast<T>(bj[p]);
      c[r * ldc + j] = alpha * total;
    }
  }
}

// C[m, n] = alpha * A B^T for few rows of A (decoding): B's rows are read once per 8 rows of A,
// in place, and every entry is a dot product over whole vectors.
template <typename T, typename E>
void gemm_nt(int64_t m, int64_t n, int64_t k, T alpha, const T* a, int64_t lda, const E* b,
             int64_t ldb, T* c, int64_t ldc, const E* next = nullptr, int64_t next_ld = 0,
             int64_t next_n = 0) {
  const int64_t ld = next_ld * sizeof(E), bytes = next_n * sizeof(E);
  in_row_blocks(m, [&](int64_t i, auto rows) {
    // the values are fetched once, with the first rows
    const char* nx = i == 0 ? reinterpret_cast<const char*>(next) : nullptr;
    constexpr int R = decltype(rows)::value;
    dots_rows<T, E, R>(n, k, alpha, a + i * lda, lda, b, ldb, c + i * ldc, ldc, nx, ld, bytes);
  });
}

// C[R, u .. u + lanes) += A B for R rows of A (T, row stride lda) over k rows of B (E, row
// stride ldb; widened as loaded): decoding's product with V, one vector of columns at a time.
// Each vector of a value row is loaded once and serves all R rows; two sets of accumulators
// (even and odd keys) keep consecutive keys from waiting on each other.
template <typename T, typename E, int R>
void values_rows(int64_t n, int64_t k, const T* a, int64_t lda, const E* b, int64_t ldb, T* c,
                 int64_t ldc) {
  using V = typename Vec<T>::type;
  constexpr int64_t lanes = kVecBytes / sizeof(T);
  for (int64_t u = 0; u < n; u += lanes) {
    V even[R], odd[R];
    for (int r = 0; r < R; ++r) even[r] = odd[r] = V{};
    int64_t p = 0;
    for (; p + 2 <= k; p += 2) {  // dots_rows fetched these rows while it made the scores
      const V y0 = load_as<T>(b + p * ldb + u), y1 = load_as<T>(b + (p + 1) * ldb + u);
      for (int r = 0; r < R; ++r) {
        even[r] += a[r * lda + p] * y0;
        odd[r] += a[r * lda + p + 1] * y1;
      }
    }
    if (p < k) {
      const V y0 = load_as<T>(b + p * ldb + u);
      for (int r = 0; r < R; ++r) even[r] += a[r * lda + p] * y0;
    }
    for (int r = 0; r < R; ++r) {
      V old;
      std::memcpy(&old, c + r * ldc + u, sizeof(V));
      old += even[r] + odd[r];
      std::memcpy(c + r * ldc + u, &old, sizeof(V));
    }
  }
}

// C[m, n] += A B for a few rows of A (decoding's product with V), n a whole number of vectors:
// B's rows read in place, once per 8 rows of A
template <typename T, typename E>
void gemm_few(int64_t m, int64_t n, int64_t k, const T* a, int64_t lda, const E* b, int64_t ldb,
              T* c, int64_t ldc) {
  in_row_blocks(m, [&](int64_t i, auto rows) {
    constexpr int R = decltype(rows)::value;
    values_rows<T, E, R>(n, k, a + i * lda, lda, b, ldb, c + i * ldc, ldc);
  });
}

#if defined(__AVX512BF16__)
// Decoding's scores from bf16 query rows and bf16 keys as they are stored, with the CPU's bf16
// dot-product instruction: each instruction multiplies 16 pairs of bf16 values and adds both
// products of a pair to a float32 lane (a bf16 product is exact in float32; the sums round as
// float sums do, denormal bf16 inputs count as 0). No value is widened, so a key row costs a
// quarter of the instructions of the widening loop (dots_rows). R rows of A at a time, R
// accumulators per key; a row's lanes are summed by tree_sum. k a multiple of 32.
template <int R>
void dots_rows_bf16(int64_t n, int64_t k, float alpha, const at::BFloat16* a, int64_t lda,
                    const at::BFloat16* b, int64_t ldb, float* c, int64_t ldc, const char* next,
                    int64_t next_ld, int64_t next_bytes) {
  for (int64_t j = 0; j < n; ++j) {
    const at::BFloat16* bj = b + j * ldb;
    if (next != nullptr)  // the value row of this key, for the product with V that follows
      for (int64_t off = 0; off < next_bytes; off += 64)
        prefetch_l2(next + j * next_ld + off);
    __m512 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t p = 0; p < k; p += 32) {
      prefetch_l2(reinterpret_cast<const char*>(bj + p) + kAheadBytes);
      const __m512bh y = (__m512bh)_mm512_loadu_si512(bj + p);
      for (int r = 0; r < R; ++r)
        acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_loadu_si512(a + r * lda + p), y);
    }
    for (int r = 0; r < R; ++r) c[r * ldc + j] = alpha * tree_sum(acc[r]);
  }
}

// C[m, n] = alpha * A B^T over bf16 rows by dots_rows_bf16, 8 rows of A at a time
inline void gemm_nt_bf16(int64_t m, int64_t n, int64_t k, float alpha, const at::BFloat16* a,
                         int64_t lda, const at::BFloat16* b, int64_t ldb, float* c, int64_t ldc,
                         const at::BFloat16* next, int64_t next_ld, int64_t next_n) {
  const int64_t ld = next_ld * 2, bytes = next_n * 2;
  in_row_blocks(m, [&](int64_t i, auto rows) {
    const char* nx = i == 0 ? reinterpret_cast<const char*>(next) : nullptr;
    constexpr int R = decltype(rows)::value;
    dots_rows_bf16<R>(n, k, alpha, a + i * lda, lda, b, ldb, c + i * ldc, ldc, nx, ld, bytes);
  });
}
#endif

// Decoding over bf16 keys and values read in place (no float copy of the cache): the query
// rows are widened once per key block, the keys and values as each vector is loaded; sums in
// float32. C[m, n] = alpha * A B^T, A [m, k] and B [n, k] bf16 rows (strides lda, ldb). Where
// the CPU has bf16 dot products, the scores come from them instead (gemm_nt_bf16).
inline void gemm_nt_widened(int64_t m, int64_t n, int64_t k, float alpha, const at::BFloat16* a,
                            int64_t lda, const at::BFloat16* b, int64_t ldb, float* c,
                            int64_t ldc, const at::BFloat16* next, int64_t next_ld,
                            int64_t next_n) {
#if defined(__AVX512BF16__)
  if (k % 32 == 0)
    return gemm_nt_bf16(m, n, k, alpha, a, lda, b, ldb, c, ldc, next, next_ld, next_n);
#endif
  thread_local std::vector<float> rows;
  rows.resize(m * k);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t p = 0; p < k; ++p) rows[i * k + p] = static_cast<float>(a[i * lda + p]);
  gemm_nt<float, at::BFloat16>(m, n, k, alpha, rows.data(), k, b, ldb, c, ldc, next, next_ld,
                               next_n);
}

#if defined(__AVX512BF16__)
// C[R, n] += P V for R rows of bf16 weights P (row stride ldp) over k value rows of V (bf16, row
// stride ldb), n a multiple of 16, by the CPU's bf16 dot products: two consecutive value rows
// are interleaved into pairs (one permute serves all R rows), and each instruction adds both
// keys' products to 16 columns. An odd last key is widened and added on its own.
template <int R>
void values_rows_bf16(int64_t n, int64_t k, const at::BFloat16* pb, int64_t ldp,
                      const at::BFloat16* b, int64_t ldb, float* c, int64_t ldc) {
  alignas(64) static constexpr uint16_t kPairs[32] = {
      0, 32, 1, 33, 2,  34, 3,  35, 4,  36, 5,  37, 6,  38, 7,  39,
      8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};  // row p, row p + 1
  const __m512i pairs = _mm512_load_si512(kPairs);
  const int64_t even = k / 2 * 2;
  for (int64_t u = 0; u < n; u += 16) {
    __m512 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t p = 0; p < even; p += 2) {
      const __m512i first = _mm512_castsi256_si512(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + p * ldb + u)));
      const __m512i second = _mm512_castsi256_si512(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + (p + 1) * ldb + u)));
      const __m512bh y = (__m512bh)_mm512_permutex2var_epi16(first, pairs, second);
      for (int r = 0; r < R; ++r) {
        int32_t w;  // the weights of keys p and p + 1, one pair
        std::memcpy(&w, pb + r * ldp + p, sizeof(w));
        acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_set1_epi32(w), y);
      }
    }
    if (even < k) {
      const __m512 y = load_float(b + even * ldb + u);
      for (int r = 0; r < R; ++r) {
        const __m512 w = _mm512_set1_ps(static_cast<float>(pb[r * ldp + even]));
        acc[r] = _mm512_fmadd_ps(w, y, acc[r]);
      }
    }
    for (int r = 0; r < R; ++r) {
      float* cr = c + r * ldc + u;
      _mm512_storeu_ps(cr, _mm512_add_ps(_mm512_loadu_ps(cr), acc[r]));
    }
  }
}

// C[m, n] += round_bf16(A) V for decoding's product with a bf16 cache: the weights are rounded
// to bf16 (as the block products of longer calls round them, and as the naive formula in bf16
// does), then values_rows_bf16 8 rows at a time
inline void gemm_bf16(int64_t m, int64_t n, int64_t k, const float* a, int64_t lda,
                      const at::BFloat16* b, int64_t ldb, float* c, int64_t ldc) {
  thread_local std::vector<at::BFloat16> rounded;
  rounded.resize(m * k);
  for (int64_t i = 0; i < m; ++i) to_bf16(rounded.data() + i * k, a + i * lda, k);
  in_row_blocks(m, [&](int64_t i, auto rows) {
    constexpr int R = decltype(rows)::value;
    values_rows_bf16<R>(n, k, rounded.data() + i * k, k, b, ldb, c + i * ldc, ldc);
  });
}
#endif

inline void gemm_widened(int64_t m, int64_t n, int64_t k, const float* a, int64_t lda,
                         const at::BFloat16* b, int64_t ldb, float* c, int64_t ldc) {
#if defined(__AVX512BF16__)
  if (n % 16 == 0) return gemm_bf16(m, n, k, a, lda, b, ldb, c, ldc);
#endif
  if (n % kLanes == 0) return gemm_few<float, at::BFloat16>(m, n, k, a, lda, b, ldb, c, ldc);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t p = 0; p < k; ++p) {
      const float w = a[i * lda + p];
      for (int64_t d = 0; d < n; ++d) c[i * ldc + d] += w * static_cast<float>(b[p * ldb + d]);
    }
}

}  // namespace
