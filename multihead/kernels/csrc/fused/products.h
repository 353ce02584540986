// The block products of the fused kernel: C (+)= A B for the tile sizes attention needs, on
// torch's brgemm microkernel or a register-blocked loop, and tiled transposes.

#pragma once

#include <torch/version.h>

#include <ATen/native/CPUBlas.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "../simd.h"
#include "few_rows.h"

namespace {

// GEMM for the tile sizes attention needs, written for the compiler: a block of rows by 2
// vectors of accumulators stays in registers (GCC/Clang vector extensions map onto SSE, AVX2,
// AVX-512 or NEON, whatever -march allows). It serves float64 (gradcheck), decoding's few
// rows, and torch builds without the float brgemm. Every other float block runs on torch's
// own microkernel (block_gemm below), a JIT kernel tuned for the CPU at hand, which gets
// closer to the core's peak at these tile sizes than this portable loop. (A GEMM through
// ATen's tensor ops is no option inside the intra-op pool: each would cost a thread-pool
// round trip per tile.)
//
// C[m, n] = alpha * A B (+ C when accumulating), with A(i, p) = a[i * ars + p * acs] (any
// strides, so a transposed A costs nothing), B row-major with row stride ldb, C row-major.

// Rows of A per register block: 2 * rows vector accumulators plus 3 working registers must fit
// the register file (32 vector registers with AVX-512, 16 with AVX2 or SSE; NEON has 32).
#if defined(__AVX512F__) || defined(__aarch64__)
constexpr int kBlockRows = 12;
#else
constexpr int kBlockRows = 6;
#endif

template <typename T>
inline void put(T* dst, typename Vec<T>::type x, T alpha, bool accumulate) {
  using V = typename Vec<T>::type;
  x = alpha * x;
  if (accumulate) {
    V old;
    std::memcpy(&old, dst, sizeof(V));
    x += old;
  }
  std::memcpy(dst, &x, sizeof(V));
}

// C[rows, 2 vectors] for one register block; accumulators are plain locals (never addressed),
// so they stay in registers
template <typename T, int rows>
inline void gemm_block(int64_t k, T alpha, const T* a, int64_t ars, int64_t acs, const T* b,
                       int64_t ldb, bool accumulate, T* c, int64_t ldc) {
  using V = typename Vec<T>::type;
  constexpr int lanes = kVecBytes / sizeof(T);
  V s0[rows], s1[rows];
  for (int r = 0; r < rows; ++r) s0[r] = s1[r] = V{};
  for (int64_t p = 0; p < k; ++p) {
    V b0, b1;
    std::memcpy(&b0, b + p * ldb, sizeof(V));
    std::memcpy(&b1, b + p * ldb + lanes, sizeof(V));
    const T* ap = a + p * acs;
#pragma GCC unroll 16
    for (int r = 0; r < rows; ++r) {
      const T ar = ap[r * ars];
      s0[r] += ar * b0;
      s1[r] += ar * b1;
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < rows; ++r) {
    put(c + r * ldc, s0[r], alpha, accumulate);
    put(c + r * ldc + lanes, s1[r], alpha, accumulate);
  }
}

template <typename T>
void gemm_edge(int64_t m, int64_t n, int64_t k, T alpha, const T* a, int64_t ars, int64_t acs,
               const T* b, int64_t ldb, bool accumulate, T* c, int64_t ldc) {
  for (int64_t i = 0; i < m; ++i) {
    T* ci = c + i * ldc;
    if (!accumulate) std::fill(ci, ci + n, T(0));
    for (int64_t p = 0; p < k; ++p) {
      const T ap = alpha * a[i * ars + p * acs];
      const T* bp = b + p * ldb;
      for (int64_t j = 0; j < n; ++j) ci[j] += ap * bp[j];
    }
  }
}

// rows [i, i + rows) of C in register blocks of `rows`, the columns past the last full pair
// of vectors by the plain loop
template <typename T, int rows>
int64_t gemm_rows(int64_t i, int64_t m, int64_t n, int64_t k, T alpha, const T* a, int64_t ars,
                  int64_t acs, const T* b, int64_t ldb, bool accumulate, T* c, int64_t ldc) {
  constexpr int64_t cols = 2 * kVecBytes / sizeof(T);
  for (; i + rows <= m; i += rows) {
    int64_t j = 0;
    for (; j + cols <= n; j += cols)
      gemm_block<T, rows>(k, alpha, a + i * ars, ars, acs, b + j, ldb, accumulate,
                          c + i * ldc + j, ldc);
    if (j < n)
      gemm_edge<T>(rows, n - j, k, alpha, a + i * ars, ars, acs, b + j, ldb, accumulate,
                   c + i * ldc + j, ldc);
  }
  return i;
}

template <typename T>
void gemm(int64_t m, int64_t n, int64_t k, T alpha, const T* a, int64_t ars, int64_t acs,
          const T* b, int64_t ldb, bool accumulate, T* c, int64_t ldc) {
  constexpr int64_t lanes = kVecBytes / sizeof(T);
  if (m <= kBlockRows && accumulate && alpha == T(1) && acs == 1 && n % lanes == 0) {
    return gemm_few<T, T>(m, n, k, a, ars, b, ldb, c, ldc);  // decoding's V products
  }
  int64_t i = gemm_rows<T, kBlockRows>(0, m, n, k, alpha, a, ars, acs, b, ldb, accumulate, c, ldc);
  i = gemm_rows<T, 4>(i, m, n, k, alpha, a, ars, acs, b, ldb, accumulate, c, ldc);
  if (i < m)
    gemm_edge<T>(m - i, n, k, alpha, a + i * ars, ars, acs, b, ldb, accumulate, c + i * ldc,
                 ldc);
}

// The block GEMM every tile runs: C[m, n] = A B, or C += A B when accumulating, with A [m, k]
// and B [k, n] row-major (row strides lda, ldb) and C row stride ldc. In float it is torch's
// own microkernel, at::native::cpublas::brgemm (exported since torch 2.6): oneDNN's JIT
// BRGEMM on x86 with AVX2 or later, else torch's BLAS (MKL, OpenBLAS) or its reference GEMM.
// It runs on the calling thread (safe inside at::parallel_for), caches one generated kernel
// per shape per thread, and gives the same bits for the same shape and inputs, so results
// stay reproducible. float64 (gradcheck) keeps the register-blocked loop above.
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 6)
#define MULTIHEAD_BRGEMM 1
#endif

inline void block_gemm(int64_t m, int64_t n, int64_t k, const double* a, int64_t lda,
                       const double* b, int64_t ldb, bool accumulate, double* c, int64_t ldc) {
  gemm<double>(m, n, k, 1.0, a, lda, 1, b, ldb, accumulate, c, ldc);
}

inline void block_gemm(int64_t m, int64_t n, int64_t k, const float* a, int64_t lda,
                       const float* b, int64_t ldb, bool accumulate, float* c, int64_t ldc) {
  if (m <= 0 || n <= 0) return;
#ifdef MULTIHEAD_BRGEMM
  if (k > 0) {
    at::native::cpublas::brgemm(m, n, k, lda, ldb, ldc, accumulate, a, b, c, false);
    return;
  }
#endif
  gemm<float>(m, n, k, 1.0f, a, lda, 1, b, ldb, accumulate, c, ldc);
}

// The half-precision block products: C[m, n] (+)= A B with A [m, k] bf16 row-major and B given
// in VNNI form ([k / 2, n, 2]: pairs along k interleaved, row-pair stride 2 * ldb), k even;
// products exact in float32 and accumulated there.
inline void block_gemm_vnni(int64_t m, int64_t n, int64_t k, const at::BFloat16* a, int64_t lda,
                            const at::BFloat16* b, int64_t ldb, bool accumulate, float* c,
                            int64_t ldc) {
#ifdef MULTIHEAD_BRGEMM
  if (m > 0 && n > 0 && k > 0)
    at::native::cpublas::brgemm(m, n, k, lda, ldb, ldc, accumulate, a, b, c, true);
#endif
}

// dst [cols, rows] (row stride ldd) = src [rows, cols] (row stride ld) transposed, in tiles
// that stay in L1 on both sides
template <typename T>
void transpose(const T* src, int64_t rows, int64_t cols, int64_t ld, T* dst, int64_t ldd) {
  constexpr int64_t tile = 16;
  for (int64_t i0 = 0; i0 < rows; i0 += tile) {
    const int64_t i1 = std::min(rows, i0 + tile);
    for (int64_t j0 = 0; j0 < cols; j0 += tile) {
      const int64_t j1 = std::min(cols, j0 + tile);
      for (int64_t j = j0; j < j1; ++j)
        for (int64_t i = i0; i < i1; ++i) dst[j * ldd + i] = src[i * ld + j];
    }
  }
}

}  // namespace
