// The fused CPU attention kernel behind backend="fused".
//
// The kernel only loops: Python hands it a work list built from the mask's own tile answers
// (query tiles, each with its key chunks and, for partly visible chunks, a small keep block),
// and it never knows which mask produced it. Per block of query rows it walks the key blocks
// of every chunk with an online softmax (FlashAttention's recipe): scores by one GEMM, each
// row finished in one vector pass (soft cap, additive terms, keep bits, maximum), exp and row
// sums in a second (which also applies the scale when there is neither cap nor terms, and
// writes the bf16 weights of a half-precision product directly), output by another GEMM; sink
// logits join each row's denominator at the end. Softmax statistics and accumulators are
// float32 (float64 for float64 inputs). bf16 inputs run their block products in bf16 where
// this CPU's bf16 microkernel is faster (half_products), else they are widened once per call;
// both keep the 2x error rule. Keys and values are packed for those products, and checked
// for NaN and inf, in one pass per block (pack_half). With
// weights, a task keeps its rows' scores over their key span in cache and writes every weight
// once (attend_weights).
//
// Work is spread over torch's intra-op pool (at::parallel_for), so torch.set_num_threads
// governs it. Every output row, and in the backward pass every key's gradient, is written by
// exactly one task in a fixed order: results are bitwise reproducible for a thread count.

// ATen's per-operator headers and torch's pybind casters rather than torch/extension.h, which
// pulls in the whole C++ frontend (autograd, nn, optim) and doubles the compile time
#include <torch/csrc/utils/pybind.h>
#include <torch/version.h>

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/TensorOperators.h>
#include <ATen/core/Tensor.h>
#include <ATen/native/CPUBlas.h>
#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/full.h>
#include <ATen/ops/isfinite.h>
#include <ATen/ops/scalar_tensor.h>
#include <ATen/ops/where.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <ctime>
#include <tuple>
#if defined(__linux__)
#include <sys/mman.h>
#endif
#if defined(__AVX__)
#include <immintrin.h>
#endif
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <mutex>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

// Block sizes: 256 query rows by 512 keys. The scores of a block (512 KiB in float32) stay in
// L2, and every online-softmax update and block product covers 512 keys at once, so the
// per-block work (the GEMM calls, each row's rescaling) is spread over many scores. Forward
// tasks get fewer rows (down to kMinRows) when 256-row tasks would leave threads idle.
constexpr int64_t kRows = 256;  // query rows per task and per backward block
constexpr int64_t kMinRows = 64;
constexpr int64_t kKeys = 512;  // keys per block
// how far ahead of its reads decoding fetches keys and values into L2
constexpr int64_t kAheadBytes = 4096;
constexpr int64_t kDecodeRows = 16;  // L up to this is decoding: keys read in place, split

// ---------------------------------------------------------------------------------------
// exp for x <= 0 that the compiler vectorizes (std::exp is a libm call per element).
// exp(x) = 2^n exp(r) with n = round(x / ln2) and |r| <= ln2 / 2, Cephes' degree-6 polynomial
// for exp(r) (under 2 ulp). n is rounded by adding 1.5 * 2^23, which leaves n in the low bits
// of the sum: no float-int conversions, and 2^n is one shift of those bits. Inputs below -87
// (and -inf, NaN) give exactly 0, so hidden keys weigh exactly nothing.

constexpr float kRound = 12582912.0f;  // 1.5 * 2^23: x + kRound rounds x to an integer

inline float exp_nonpositive(float x) {
  const bool dead = !(x > -87.0f);
  x = dead ? -87.0f : x;
  const float t = x * 1.44269504088896341f + kRound;
  const float n = t - kRound;
  float r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  const float z = r * r;
  float y = 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * z + r + 1.0f;
  int32_t bits;
  std::memcpy(&bits, &t, sizeof(bits));
  bits = (bits + 127) << 23;  // the low bits of t hold n; shifting drops kRound's own bits
  float two_n;
  std::memcpy(&two_n, &bits, sizeof(two_n));
  return dead ? 0.0f : y * two_n;
}

inline double exp_nonpositive(double x) { return x > -745.0 ? std::exp(x) : 0.0; }

template <typename T>
constexpr T neg_inf() {
  return -std::numeric_limits<T>::infinity();
}

// ---------------------------------------------------------------------------------------
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

#if defined(__AVX512F__)
constexpr int kVecBytes = 64;
#elif defined(__AVX__)
constexpr int kVecBytes = 32;
#else
constexpr int kVecBytes = 16;
#endif

template <typename T>
struct Vec {
  typedef T type __attribute__((vector_size(kVecBytes)));
};

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

template <typename T, typename E>
void gemm_few(int64_t m, int64_t n, int64_t k, const T* a, int64_t lda, const E* b, int64_t ldb,
              T* c, int64_t ldc);  // below, with the vector helpers it uses

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

// Row reductions, exp and tanh over whole vectors: without -ffast-math (which would break -inf)
// compilers vectorize neither a float sum nor a max, so the lanes are spelled out.

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

// exp_nonpositive for a vector of floats: the same steps, lane by lane
inline VF exp_vec(VF x) {
  const VF floor_x = VF{} - 87.0f;
  const VI dead = !(x > floor_x);
  x = dead ? floor_x : x;
  const VF t = x * 1.44269504088896341f + kRound;
  const VF n = t - kRound;
  VF r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  const VF z = r * r;
  VF p = VF{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * z + r + 1.0f;
  VI bits;
  std::memcpy(&bits, &t, sizeof(bits));
  bits = (bits + 127) << 23;
  VF two_n;
  std::memcpy(&two_n, &bits, sizeof(two_n));
  return dead ? VF{} : p * two_n;
}

// 1 / d for d in [1, 2]: the hardware estimate refined by one Newton step (within an ulp or
// two of the quotient; a division costs several times as much)
inline VF reciprocal(VF d) {
#if defined(__AVX512F__)
  VF r;
  const __m512 estimate = _mm512_rcp14_ps(reinterpret_cast<const __m512&>(d));
  std::memcpy(&r, &estimate, sizeof(r));
  return r * (2.0f - d * r);
#else
  return 1.0f / d;
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

// tanh for a vector of floats (Cephes' tanhf, under 2 ulp): x + x^3 P(x^2) for |x| < 0.625,
// else 2 / (1 + e) - 1 with e = exp(-2|x|), which has no cancellation there; the sign is put
// back by its bit. The exp is computed only for vectors with a lane past 0.625: a soft cap
// sits well above most scores (Gemma's 50), so most vectors take the polynomial alone.
// NaN stays NaN (it takes the polynomial).
inline VF tanh_vec(VF x) {
  VI bits;
  std::memcpy(&bits, &x, sizeof(bits));
  const VI sign = bits & static_cast<int32_t>(0x80000000u);
  const VI abs_bits = bits & 0x7fffffff;
  VF a;
  std::memcpy(&a, &abs_bits, sizeof(a));
  const VF z = a * a;
  VF p = VF{} - 5.70498872745e-3f;
  p = p * z + 2.06390887954e-2f;
  p = p * z - 5.37397155531e-2f;
  p = p * z + 1.33314422036e-1f;
  p = p * z - 3.33332819422e-1f;
  VF r = a + a * z * p;
  const VI large = a >= 0.625f;
  if (any_lane(large)) {
    const VF e = exp_vec(-2.0f * a);
    r = large ? 2.0f * reciprocal(1.0f + e) - 1.0f : r;
  }
  VI r_bits;
  std::memcpy(&r_bits, &r, sizeof(r_bits));
  r_bits |= sign;
  std::memcpy(&r, &r_bits, sizeof(r));
  return r;
}

inline float hmax(VF v, float init) {
  for (int l = 0; l < kLanes; ++l) init = std::max(init, v[l]);
  return init;
}
inline float hsum(VF v) {
  float total = 0;
  for (int l = 0; l < kLanes; ++l) total += v[l];
  return total;
}

// x[j] = exp(x[j] - shift) in place; returns the sum. With `moment`, also
// *moment = sum_j x[j] (x[j] - shift) over the entries that stay above 0 (a row's entropy,
// see put_stats): hidden keys (-inf) add nothing.
template <typename T>
T exp_shifted(T* x, int64_t n, T shift, T* moment = nullptr) {
  int64_t j = 0;
  T total = 0, first = 0;
  if constexpr (std::is_same_v<T, float>) {
    VF sum = {}, mom = {};
    if (moment == nullptr) {
      for (; j + kLanes <= n; j += kLanes) {
        const VF v = exp_vec(load(x + j) - shift);
        store(x + j, v);
        sum += v;
      }
    } else {
      for (; j + kLanes <= n; j += kLanes) {
        const VF d = load(x + j) - shift;
        const VF v = exp_vec(d);
        store(x + j, v);
        sum += v;
        mom += v > 0.0f ? v * d : VF{};
      }
    }
    total = hsum(sum);
    first = hsum(mom);
  }
  for (; j < n; ++j) {
    const T d = x[j] - shift;
    x[j] = exp_nonpositive(d);
    total += x[j];
    if (x[j] > T(0)) first += x[j] * d;
  }
  if (moment != nullptr) *moment = first;
  return total;
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
inline void to_bf16(at::BFloat16* dst, const float* src, int64_t n) {
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    const VH narrow = round_bf16(load(src + j));
    std::memcpy(dst + j, &narrow, sizeof(narrow));
  }
  for (; j < n; ++j) dst[j] = at::BFloat16(src[j]);
}

// Which of the `count` keys from keep on a row may be seen (a keep byte that is not 0), as a
// lane mask; lanes past count are not. With AVX-512 one masked byte load (a memcpy of a
// variable count is a library call).
inline VI keep_lanes(const uint8_t* keep, int64_t count) {
  typedef uint8_t Bytes __attribute__((vector_size(kLanes)));
  Bytes bits = {};
  if (count == kLanes) {
    std::memcpy(&bits, keep, sizeof(bits));
  } else {
#if defined(__AVX512BW__) && defined(__AVX512VL__)
    const __m128i part = _mm_maskz_loadu_epi8(static_cast<__mmask16>((1u << count) - 1), keep);
    std::memcpy(&bits, &part, sizeof(bits));
#else
    std::memcpy(&bits, keep, count);
#endif
  }
  return __builtin_convertvector(bits, VI) != 0;
}

// The softmax steps of a call with neither soft cap nor additive terms ("plain", float
// statistics): a block's raw scores are only masked and maxed, and the scale joins the exp.

// The larger of `best` and scale * max_j row[j] (scale > 0), with the keep bits applied in
// place first when given (hidden keys become -inf). NaN never wins. A row's tail runs through
// the vector code too (rows as short as a sentence spend much of their time in it).
inline float scaled_row_max(float* row, int64_t n, float scale, const uint8_t* keep,
                            float best) {
  const float inf = std::numeric_limits<float>::infinity();
  VF top = VF{} - inf;
  for (int64_t j = 0; j < n; j += kLanes) {
    const int64_t count = std::min<int64_t>(kLanes, n - j);
    VF x = count == kLanes ? load(row + j) : load_part(row + j, count, -inf);
    if (keep != nullptr) {
      x = keep_lanes(keep + j, count) ? x : VF{} - inf;
      if (count == kLanes)
        store(row + j, x);
      else
        store_part(row + j, x, count);
    }
    top = x > top ? x : top;
  }
  const float raw = hmax(top, -inf);
  return raw == -inf ? best : std::max(best, scale * raw);
}

// dst[j] = exp(scale * x[j] - shift) (dst may be x), as float or as bf16 rounded to nearest
// even (the weights the half-precision value product reads, made in the same pass); returns
// the sum of the unrounded exps
template <typename Out>
inline float exp_scaled(const float* x, int64_t n, float scale, float shift, Out* dst) {
  const float inf = std::numeric_limits<float>::infinity();
  VF sum = {};
  for (int64_t j = 0; j < n; j += kLanes) {
    const int64_t count = std::min<int64_t>(kLanes, n - j);
    const bool whole = count == kLanes;
    const VF e = exp_vec((whole ? load(x + j) : load_part(x + j, count, -inf)) * scale - shift);
    sum += e;  // lanes past the row hold exp(-inf) = 0
    if constexpr (std::is_same_v<Out, float>) {
      if (whole)
        store(dst + j, e);
      else
        store_part(dst + j, e, count);
    } else {
      const VH narrow = round_bf16(e);
      if (whole) {
        std::memcpy(dst + j, &narrow, sizeof(narrow));
      } else {
#if defined(__AVX512BW__) && defined(__AVX512VL__)
        _mm256_mask_storeu_epi16(dst + j, static_cast<__mmask16>((1u << count) - 1),
                                 reinterpret_cast<const __m256i&>(narrow));
#else
        std::memcpy(dst + j, &narrow, count * 2);
#endif
      }
    }
  }
  return tree_sum(sum);
}

// kLanes bf16 values widened to float (bf16 is the top half of a float32)
inline VF load_widened(const at::BFloat16* p) {
  typedef uint32_t Bits __attribute__((vector_size(kVecBytes)));
  VH narrow;
  std::memcpy(&narrow, p, sizeof(narrow));
  const Bits bits = __builtin_convertvector(narrow, Bits) << 16;
  VF v;
  std::memcpy(&v, &bits, sizeof(v));
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
inline VF load_as(const at::BFloat16* p) {
  return load_widened(p);
}

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
        __builtin_prefetch(next + j * next_ld + off, 0, 2);
    V acc[R];
    for (int r = 0; r < R; ++r) acc[r] = V{};
    for (int64_t p = 0; p < whole; p += lanes) {
      // the key rows ahead, into L2: one stream of a few KiB per call is too short for the
      // hardware prefetcher to reach the read bandwidth
      __builtin_prefetch(reinterpret_cast<const char*>(bj + p) + kAheadBytes, 0, 2);
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
        __builtin_prefetch(next + j * next_ld + off, 0, 2);
    __m512 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t p = 0; p < k; p += 32) {
      __builtin_prefetch(reinterpret_cast<const char*>(bj + p) + kAheadBytes, 0, 2);
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
      const __m512 y = load_widened(b + even * ldb + u);
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

// x[j] *= factor
template <typename T>
void scale_row(T* x, int64_t n, T factor) {
  for (int64_t j = 0; j < n; ++j) x[j] *= factor;
}

// ---------------------------------------------------------------------------------------
// The work list (see fused.py: _flatten).

struct Plan {
  const int64_t* items;   // [n, 6]: b0, b1, q0, q1, first chunk, end chunk (b0 = -1: all)
  int64_t n_items;
  const int64_t* chunks;  // [m, 6]: k0, k1, keep offset (-1: fully visible), keep strides b, h, row
  const uint8_t* keep;    // every keep block, flattened
  int64_t n_chunks;
};

Plan make_plan(const at::Tensor& items, const at::Tensor& chunks, const at::Tensor& keep) {
  TORCH_CHECK(items.dtype() == at::kLong && items.is_contiguous() && items.size(1) == 6);
  TORCH_CHECK(chunks.dtype() == at::kLong && chunks.is_contiguous() && chunks.size(1) == 6);
  TORCH_CHECK(keep.dtype() == at::kBool && keep.is_contiguous());
  return Plan{items.data_ptr<int64_t>(), items.size(0), chunks.data_ptr<int64_t>(),
              reinterpret_cast<const uint8_t*>(keep.data_ptr<bool>()), chunks.size(0)};
}

// Which blocks of kKeys keys some chunk of the plan reads (one flag per block, for every batch
// entry and head alike). The others are never read, so they are neither packed nor checked: a
// call whose rows see a few keys of a long sequence (a window's rows, auto's proxy of a call)
// prepares only those.
std::vector<uint8_t> read_blocks(const Plan& plan, int64_t S) {
  std::vector<uint8_t> read((S + kKeys - 1) / kKeys, 0);
  for (int64_t c = 0; c < plan.n_chunks; ++c) {
    const int64_t k0 = plan.chunks[6 * c], k1 = std::min(plan.chunks[6 * c + 1], S);
    if (k1 > k0) std::fill(read.begin() + k0 / kKeys, read.begin() + (k1 - 1) / kKeys + 1, 1);
  }
  return read;
}

inline bool unread(const std::vector<uint8_t>* read, int64_t block) {
  return read != nullptr && !(*read)[block];
}

// The end of the key block starting at kb: the next multiple of kKeys, or the chunk's end.
inline int64_t next_block(int64_t kb, int64_t stop) {
  return std::min(stop, (kb / kKeys + 1) * kKeys);
}

// A query-row block of one item, for one batch entry and one head.
struct Task {
  int64_t item, b, h, r0, r1;
};

// Query rows per forward task: kRows, halved (down to kMinRows) while there would be fewer
// than four tasks per thread. Depends on the plan and the thread count only.
int64_t task_rows(const Plan& plan, int64_t batch, int64_t heads, int64_t threads) {
  int64_t rows = kRows;
  for (; rows > kMinRows; rows /= 2) {
    int64_t count = 0;
    for (int64_t n = 0; n < plan.n_items; ++n) {
      const int64_t* it = plan.items + 6 * n;
      const int64_t batches = it[0] < 0 ? batch : it[1] - it[0];
      count += batches * heads * ((it[3] - it[2] + rows - 1) / rows);
    }
    if (count >= 4 * threads) break;
  }
  return rows;
}

std::vector<Task> forward_tasks(const Plan& plan, int64_t batch, int64_t heads, int64_t rows) {
  std::vector<Task> tasks;
  for (int64_t n = 0; n < plan.n_items; ++n) {
    const int64_t* it = plan.items + 6 * n;
    const int64_t b0 = it[0] < 0 ? 0 : it[0], b1 = it[0] < 0 ? batch : it[1];
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t h = 0; h < heads; ++h)
        for (int64_t r = it[2]; r < it[3]; r += rows)
          tasks.push_back({n, b, h, r, std::min(r + rows, it[3])});
  }
  return tasks;
}

// What turns a block's raw scores into the softmax's input, row by row: the soft cap
// (cap * tanh(s / cap), before everything else), the additive terms (a dense tensor with
// broadcast strides and/or a table over the distance j - i: a relative modifier such as
// ALiBi or T5 buckets, never materialized as L x S), then the keep bits. The sink logits
// join each row's finished softmax (finish_rows).
template <typename T>
struct Terms {
  T scale = 1;  // the scores' scale where the queries did not take it (half-precision products)
  T cap = 0, inv_cap = 0;  // soft cap; 0: none
  const T* dense = nullptr;
  int64_t sb = 0, sh = 0, sl = 0, ss = 0;
  const T* table = nullptr;
  int64_t th = 0, tlen = 0, shift = 0;  // value(h, i, j) = table[h * th + j - i - shift]
  const T* sinks = nullptr;  // [H] or null

  Terms(const at::Tensor& d, const at::Tensor& t, int64_t table_shift, double softcap,
        const at::Tensor& s) {
    if (softcap > 0) cap = static_cast<T>(softcap), inv_cap = static_cast<T>(1.0 / softcap);
    if (d.defined() && d.numel() > 0) {
      dense = d.data_ptr<T>();
      sb = d.stride(0), sh = d.stride(1), sl = d.stride(2), ss = d.stride(3);
    }
    if (t.defined() && t.numel() > 0) {
      table = t.data_ptr<T>();
      th = t.size(0) == 1 ? 0 : t.stride(0);
      tlen = t.size(1);
      shift = table_shift;
    }
    if (s.defined() && s.numel() > 0) sinks = s.data_ptr<T>();
  }
};

// Per key block of one task: where the keep bits start, or null when every key is visible.
// Returns false when no (row, key) pair of the block is visible (the block is skipped).
inline bool keep_block(const Plan& plan, const int64_t* ch, int64_t b_rel, int64_t h,
                       int64_t row0, int64_t rows, int64_t k_rel, int64_t cols,
                       const uint8_t** out, int64_t* row_stride) {
  *out = nullptr;
  if (ch[2] < 0) return true;
  const uint8_t* p = plan.keep + ch[2] + b_rel * ch[3] + h * ch[4] + row0 * ch[5] + k_rel;
  bool any = false, all = true;
  for (int64_t i = 0; i < rows; ++i) {
    const uint8_t* r = p + i * ch[5];
    int64_t seen = 0;
    for (int64_t j = 0; j < cols; ++j) seen += r[j];
    any |= seen > 0;
    all &= seen == cols;
  }
  if (!all) *out = p;
  *row_stride = ch[5];
  return any;
}

// One row of raw scores (query row i, keys j0 .. j0 + n) finished in place: capped, the
// additive terms added, -inf where hidden, in one pass over the row. Returns the larger of
// `best` and the row's maximum. With `th`, tanh(s / cap) is kept there (the backward pass's
// cap derivative 1 - tanh^2).
inline float finish_row(float* row, int64_t n, const Terms<float>& terms, int64_t b, int64_t h,
                        int64_t i, int64_t j0, const uint8_t* keep, float* th, float best) {
  const float* dense =
      terms.dense == nullptr
          ? nullptr
          : terms.dense + b * terms.sb + h * terms.sh + i * terms.sl + j0 * terms.ss;
  const float* table = terms.table == nullptr
                           ? nullptr
                           : terms.table + h * terms.th + (j0 - i - terms.shift);
  const float inf = std::numeric_limits<float>::infinity();
  VF top = VF{} - inf;
  for (int64_t j = 0; j < n; j += kLanes) {
    const int64_t count = std::min<int64_t>(kLanes, n - j);
    const bool whole = count == kLanes;
    VF x = (whole ? load(row + j) : load_part(row + j, count, 0.0f)) * terms.scale;
    if (terms.cap > 0) {
      const VF t = tanh_vec(x * terms.inv_cap);
      if (th != nullptr) std::memcpy(th + j, &t, count * sizeof(float));
      x = terms.cap * t;
    }
    if (dense != nullptr) {
      if (terms.ss == 1) {
        x += whole ? load(dense + j) : load_part(dense + j, count, 0.0f);
      } else {
        float part[kLanes] = {};
        for (int64_t l = 0; l < count; ++l) part[l] = dense[(j + l) * terms.ss];
        x += load(part);
      }
    }
    if (table != nullptr) x += whole ? load(table + j) : load_part(table + j, count, 0.0f);
    if (keep != nullptr) x = keep_lanes(keep + j, count) ? x : VF{} - inf;
    if (!whole) {
      store_part(row + j, x, count);
      float pad[kLanes];
      store(pad, x);
      for (int64_t l = 0; l < count; ++l) best = std::max(best, pad[l]);
      break;
    }
    store(row + j, x);
    top = x > top ? x : top;
  }
  return hmax(top, best);
}

// float64 (gradcheck): the same steps, plainly
inline double finish_row(double* row, int64_t n, const Terms<double>& terms, int64_t b,
                         int64_t h, int64_t i, int64_t j0, const uint8_t* keep, double* th,
                         double best) {
  for (int64_t j = 0; j < n; ++j) {
    double x = row[j] * terms.scale;
    if (terms.cap > 0) {
      const double t = std::tanh(x * terms.inv_cap);
      if (th != nullptr) th[j] = t;
      x = terms.cap * t;
    }
    if (terms.dense != nullptr)
      x += terms.dense[b * terms.sb + h * terms.sh + i * terms.sl + (j0 + j) * terms.ss];
    if (terms.table != nullptr) x += terms.table[h * terms.th + (j0 + j) - i - terms.shift];
    if (keep != nullptr && !keep[j]) x = neg_inf<double>();
    row[j] = x;
    best = std::max(best, x);
  }
  return best;
}

#if defined(__linux__) && defined(MADV_HUGEPAGE)
// Whether a mapping marked for transparent huge pages is faster to touch first than one of small
// pages on this machine: timed once per process on 16 MiB each way (in some virtual machines a
// huge page's first touch costs several times the small pages it replaces).
inline double first_touch_seconds(bool huge) {
  constexpr size_t kBytes = size_t(16) << 20, kAlign = size_t(1) << 21;
  void* raw = mmap(nullptr, kBytes + kAlign, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
                   -1, 0);
  if (raw == MAP_FAILED) return 0.0;
  char* start = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(raw) + kAlign - 1) &
                                        ~uintptr_t(kAlign - 1));
  if (huge) madvise(start, kBytes, MADV_HUGEPAGE);
  const auto t0 = std::chrono::steady_clock::now();
  std::memset(start, 1, kBytes);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  munmap(raw, kBytes + kAlign);
  return seconds;
}

inline bool huge_pages_pay() {
  static const bool pays = [] {
    first_touch_seconds(false);  // the first mapping of a process pays for more than its pages
    return first_touch_seconds(true) < first_touch_seconds(false);
  }();
  return pays;
}

// Large buffers (the weights, the output, packed keys and values, gradients) live in mappings
// of their own, marked for transparent huge pages where that makes a first touch faster
// (huge_pages_pay), so a first touch faults in 2 MiB instead of 4 KiB: allocations this large
// come fresh from the system at every call otherwise, and faulting in the weights of a long
// input 4 KiB at a time can cost more than computing them. A freed mapping waits in a small
// pool (at most kPoolEntries, kPoolBytes in all) for the next buffer of about its size, which
// then skips the system's zeroing of new pages too: calls of one shape, as a model's layers
// make them, reuse each other's memory. A full pool makes room for the newest buffer by
// unmapping its oldest ones: the shapes a process uses now are the ones it asks for next (a
// pool that kept its first buffers would serve none of a later shape).
class LargeBuffers {
 public:
  static constexpr size_t kHuge = size_t(1) << 21;
  static constexpr size_t kPoolBytes = size_t(1) << 30;
  static constexpr size_t kPoolEntries = 8;

  // a huge-page-aligned mapping of at least `bytes` (its length in *length), or null
  void* take(size_t bytes, size_t* length) {
    const size_t need = (bytes + kHuge - 1) / kHuge * kHuge;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto best = free_.end();
      for (auto it = free_.begin(); it != free_.end(); ++it)
        if (it->second >= need && it->second <= 2 * need &&
            (best == free_.end() || it->second < best->second))
          best = it;
      if (best != free_.end()) {
        void* p = best->first;
        *length = best->second;
        held_ -= best->second;
        free_.erase(best);
        ++hits_;
        return p;
      }
      ++misses_;
    }
    // one huge page more than needed, then the unaligned ends unmapped
    void* raw = mmap(nullptr, need + kHuge, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
                     -1, 0);
    if (raw == MAP_FAILED) return nullptr;
    const uintptr_t at = reinterpret_cast<uintptr_t>(raw);
    const uintptr_t start = (at + kHuge - 1) & ~uintptr_t(kHuge - 1);
    if (start > at) munmap(raw, start - at);
    if (start + need < at + need + kHuge)
      munmap(reinterpret_cast<void*>(start + need), at + need + kHuge - (start + need));
    if (huge_pages_pay()) madvise(reinterpret_cast<void*>(start), need, MADV_HUGEPAGE);
    *length = need;
    return reinterpret_cast<void*>(start);
  }

  void give(void* p, size_t length) {
    std::vector<std::pair<void*, size_t>> evicted;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (length <= kPoolBytes) {
        // free_ is in the order buffers came back: the oldest first
        while (!free_.empty() && (free_.size() >= kPoolEntries || held_ + length > kPoolBytes)) {
          evicted.push_back(free_.front());
          held_ -= free_.front().second;
          free_.erase(free_.begin());
        }
        free_.emplace_back(p, length);
        held_ += length;
        p = nullptr;
      }
    }
    for (const auto& e : evicted) munmap(e.first, e.second);
    if (p != nullptr) munmap(p, length);
  }

  // (buffers waiting, their bytes, takes served from the pool, takes that mapped new memory)
  std::tuple<int64_t, int64_t, int64_t, int64_t> stats() {
    std::lock_guard<std::mutex> lock(mutex_);
    return {int64_t(free_.size()), int64_t(held_), hits_, misses_};
  }

 private:
  std::mutex mutex_;
  std::vector<std::pair<void*, size_t>> free_;
  size_t held_ = 0;
  int64_t hits_ = 0, misses_ = 0;
};

// never destroyed: tensors freed while the process exits still return their buffers
LargeBuffers& large_buffers() {
  static LargeBuffers* pool = new LargeBuffers();
  return *pool;
}
#endif

std::tuple<int64_t, int64_t, int64_t, int64_t> pool_stats() {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  return large_buffers().stats();
#else
  return {0, 0, 0, 0};
#endif
}

// A new tensor for a large buffer (see LargeBuffers); elsewhere, and for small buffers,
// at::empty. Its contents are undefined: every caller writes each entry.
at::Tensor empty_large(at::IntArrayRef sizes, const at::TensorOptions& options) {
  int64_t bytes = c10::elementSize(options.dtype().toScalarType());
  for (const int64_t s : sizes) bytes *= s;
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  if (bytes >= int64_t(4 * LargeBuffers::kHuge)) {
    size_t length = 0;
    void* p = large_buffers().take(static_cast<size_t>(bytes), &length);
    if (p != nullptr)
      return at::from_blob(
          p, sizes, [p, length](void*) { large_buffers().give(p, length); }, options);
  }
#endif
  return at::empty(sizes, options);
}

// [B, H_kv, S, d] -> [B, H_kv, ceil(S / kKeys), d, kKeys]: every block of kKeys keys transposed
// on its own (zero-padded), so a GEMM walking a block's columns reads rows kKeys apart. Rows S
// apart would alias in L1 when S is a multiple of 1024 (every row in the same few cache sets).
// One task per block, in parallel: the copy is a pass over every key, spread over the threads
// like the attention itself.
template <typename T>
at::Tensor blocked_transpose(const at::Tensor& x, const std::vector<uint8_t>* read = nullptr) {
  const int64_t B = x.size(0), H = x.size(1), S = x.size(2), d = x.size(3);
  const int64_t n = (S + kKeys - 1) / kKeys;
  at::Tensor out = empty_large({B, H, n, d, kKeys}, x.options());
  const T* src = x.data_ptr<T>();
  T* dst = out.data_ptr<T>();
  const int64_t sb = x.stride(0), sh = x.stride(1), sr = x.stride(2);
  at::parallel_for(0, B * H * n, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t u = lo; u < hi; ++u) {
      if (unread(read, u % n)) continue;
      const int64_t b = u / (H * n), h = (u / n) % H, blk = u % n;
      const int64_t j0 = blk * kKeys, cols = std::min(kKeys, S - j0);
      T* block = dst + u * d * kKeys;
      transpose(src + b * sb + h * sh + j0 * sr, cols, d, sr, block, kKeys);
      if (cols < kKeys)
        for (int64_t p = 0; p < d; ++p)
          std::fill(block + p * kKeys + cols, block + (p + 1) * kKeys, T(0));
    }
  });
  return out;
}

// Keys and values for the half-precision block products, packed in one pass over both (one
// task per block of kKeys keys, which packs its keys and values while they are in cache).
//
// Keys: [B, H_kv, blocks, D2 / 2, kKeys, 2] with D2 the head dim rounded up to even: each
// block of kKeys keys as the columns of K^T, pairs of consecutive dims interleaved (the VNNI
// form the bf16 microkernel reads), zero-padded. Where the head dim is even and every row
// starts on a 4-byte boundary, a pair of dims is one 32-bit unit and a block is a transpose of
// (keys x pairs) such units.
//
// Values: [B, H_kv, blocks, kKeys / 2, Dv, 2], pairs of consecutive keys interleaved (VNNI):
// entry c of a pair of rows is one 32-bit unit, the first row's bits low. Zero-padded.
// Non-finite values become 0 here: a row that may see one is flagged (the NaN rule runs it
// again), and a key next to a chunk's edge, read with a weight of 0 to keep the pairs aligned,
// must not turn that 0 into NaN. The test reads the bits (kExponentBits).
//
// With kflags and vflags, each block's flag (see block_flags) is set in the same pass.
template <typename E>
std::pair<at::Tensor, at::Tensor> pack_half(const at::Tensor& k, const at::Tensor& v,
                                            const std::vector<uint8_t>* read,
                                            std::vector<uint8_t>* kflags,
                                            std::vector<uint8_t>* vflags) {
  static_assert(sizeof(E) == 2, "pairs of 16-bit values");
  constexpr uint16_t exponent = kExponentBits<E>;
  const int64_t B = k.size(0), H = k.size(1), S = k.size(2), d = k.size(3), dv = v.size(3);
  const int64_t n = (S + kKeys - 1) / kKeys, pairs = (d + 1) / 2;
  at::Tensor kt = empty_large({B, H, n, pairs, kKeys, 2}, k.options());
  at::Tensor vt = empty_large({B, H, n, kKeys / 2, dv, 2}, v.options());
  if (kflags != nullptr) kflags->assign(B * H * n, 0), vflags->assign(B * H * n, 0);
  const E* ksrc = k.data_ptr<E>();
  const auto* vsrc = reinterpret_cast<const uint16_t*>(v.data_ptr<E>());
  E* kdst = kt.data_ptr<E>();
  auto* vdst = reinterpret_cast<uint32_t*>(vt.data_ptr<E>());
  const int64_t ksb = k.stride(0), ksh = k.stride(1), ksr = k.stride(2);
  const int64_t vsb = v.stride(0), vsh = v.stride(1), vsr = v.stride(2);
  const bool units = d % 2 == 0 && ksb % 2 == 0 && ksh % 2 == 0 && ksr % 2 == 0 &&
                     reinterpret_cast<uintptr_t>(ksrc) % 4 == 0;
  at::parallel_for(0, B * H * n, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t u = lo; u < hi; ++u) {
      if (unread(read, u % n)) continue;
      const int64_t b = u / (H * n), h = (u / n) % H, j0 = (u % n) * kKeys;
      const int64_t cols = std::min(kKeys, S - j0);
      // the keys
      E* block = kdst + u * pairs * kKeys * 2;
      const E* first = ksrc + b * ksb + h * ksh + j0 * ksr;
      if (units) {
        auto* out32 = reinterpret_cast<uint32_t*>(block);
        transpose(reinterpret_cast<const uint32_t*>(first), cols, pairs, ksr / 2, out32, kKeys);
        if (cols < kKeys)
          for (int64_t p = 0; p < pairs; ++p)
            std::fill(out32 + p * kKeys + cols, out32 + (p + 1) * kKeys, uint32_t(0));
      } else {
        for (int64_t j = 0; j < kKeys; ++j) {
          const E* row = first + j * ksr;
          const bool real = j < cols;
          for (int64_t p = 0; p < 2 * pairs; ++p)
            block[(p / 2) * kKeys * 2 + j * 2 + p % 2] = real && p < d ? row[p] : E(0);
        }
      }
      if (kflags != nullptr) (*kflags)[u] = any_nonfinite(first, cols, d, ksr);  // in cache
      // the values, a pair of rows at a time
      uint32_t* out = vdst + u * (kKeys / 2) * dv;
      const uint16_t* vfirst = vsrc + b * vsb + h * vsh + j0 * vsr;
      uint32_t seen = 0;  // any non-finite value
      for (int64_t j = 0; j < kKeys; j += 2, out += dv) {
        const uint16_t* r0 = vfirst + j * vsr;
        if (j + 1 < cols) {
          const uint16_t* r1 = r0 + vsr;
          for (int64_t c = 0; c < dv; ++c) {
            const uint32_t x0 = r0[c], x1 = r1[c];
            const bool bad0 = (x0 & exponent) == exponent, bad1 = (x1 & exponent) == exponent;
            seen |= bad0 | bad1;
            out[c] = (bad0 ? 0u : x0) | (bad1 ? 0u : x1 << 16);
          }
        } else if (j < cols) {
          for (int64_t c = 0; c < dv; ++c) {
            const uint32_t x0 = r0[c];
            const bool bad0 = (x0 & exponent) == exponent;
            seen |= bad0;
            out[c] = bad0 ? 0u : x0;
          }
        } else {
          std::fill(out, out + dv, 0u);
        }
      }
      if (vflags != nullptr) (*vflags)[u] = seen != 0;
    }
  });
  return {kt, vt};
}

// Per (batch entry, key/value head, block of kKeys keys): whether the block holds NaN or +-inf
// anywhere. A task reading part of a flagged block checks its exact rows (keys past a mask's
// lengths may hold anything); unflagged blocks need no check of their own.
template <typename E>
std::vector<uint8_t> block_flags(const at::Tensor& x, const std::vector<uint8_t>* read = nullptr) {
  const int64_t B = x.size(0), H = x.size(1), S = x.size(2), d = x.size(3);
  const int64_t n = (S + kKeys - 1) / kKeys;
  std::vector<uint8_t> flags(B * H * n, 0);
  const E* src = x.data_ptr<E>();
  const int64_t sb = x.stride(0), sh = x.stride(1), sr = x.stride(2);
  at::parallel_for(0, B * H * n, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t u = lo; u < hi; ++u) {
      if (unread(read, u % n)) continue;
      const int64_t b = u / (H * n), h = (u / n) % H, j0 = (u % n) * kKeys;
      flags[u] = any_nonfinite(src + b * sb + h * sh + j0 * sr, std::min(kKeys, S - j0), d, sr);
    }
  });
  return flags;
}

// q, k and v as the kernel reads them. T is the arithmetic type (float, double); E the
// storage of q, k and v: T itself (keys, and for the backward pass values, transposed block
// by block: the score GEMMs read them as row-major B operands along
// the keys, and rows S apart would alias in L1 when S is a multiple of 1024), or bf16 with
// float arithmetic (the half-precision block products: keys and values packed for the bf16
// microkernel, the scale applied to the float scores). Key blocks never cross a multiple of
// kKeys (see next_block), so each lies inside one packed block.
template <typename T, typename E = T>
struct Inputs {
  static constexpr bool kHalf = !std::is_same_v<T, E>;
  at::Tensor kt_, vt_;
  std::vector<uint8_t> kflags, vflags;  // see block_flags; empty: every block is checked
  const E *q, *k, *v, *kt, *vt;
  int64_t qsb, qsh, qsr, ksb, ksh, ksr, vsb, vsh, vsr;
  int64_t B, H, Hkv, L, S, D, Dv, D2, blocks;

  // blocked false: no packed keys (decoding reads each key row once, checking it as it reads;
  // a packed copy of the whole cache would cost more than the attention itself). backward:
  // values transposed too, no flags (the forward pass has checked)
  Inputs(const at::Tensor& q_, const at::Tensor& k_, const at::Tensor& v_, bool blocked,
         bool backward, const std::vector<uint8_t>* read = nullptr)
      : q(q_.data_ptr<E>()), k(k_.data_ptr<E>()), v(v_.data_ptr<E>()), kt(nullptr), vt(nullptr),
        qsb(q_.stride(0)), qsh(q_.stride(1)), qsr(q_.stride(2)),
        ksb(k_.stride(0)), ksh(k_.stride(1)), ksr(k_.stride(2)),
        vsb(v_.stride(0)), vsh(v_.stride(1)), vsr(v_.stride(2)),
        B(q_.size(0)), H(q_.size(1)), Hkv(k_.size(1)), L(q_.size(2)), S(k_.size(2)),
        D(q_.size(3)), Dv(v_.size(3)), D2((q_.size(3) + 1) / 2 * 2),
        blocks((k_.size(2) + kKeys - 1) / kKeys) {
    if (!blocked) return;
    if constexpr (kHalf) {
      std::tie(kt_, vt_) = pack_half<E>(k_, v_, read, backward ? nullptr : &kflags,
                                        backward ? nullptr : &vflags);
    } else {
      kt_ = blocked_transpose<T>(k_, read);
      if (backward) vt_ = blocked_transpose<T>(v_, read);
      if (!backward) kflags = block_flags<E>(k_, read), vflags = block_flags<E>(v_, read);
    }
    kt = kt_.data_ptr<E>();
    if (vt_.defined()) vt = vt_.data_ptr<E>();
  }

  const E* qrow(int64_t b, int64_t h, int64_t i) const { return q + b * qsb + h * qsh + i * qsr; }
  const E* krow(int64_t b, int64_t h, int64_t j) const {
    return k + b * ksb + (h / (H / Hkv)) * ksh + j * ksr;
  }
  const E* vrow(int64_t b, int64_t h, int64_t j) const {
    return v + b * vsb + (h / (H / Hkv)) * vsh + j * vsr;
  }
  int64_t block_of(int64_t b, int64_t h, int64_t j) const {
    return (b * Hkv + h / (H / Hkv)) * blocks + j / kKeys;
  }
  // column j of the transposed or packed keys (row stride kKeys, or kKeys pairs)
  const E* ktcol(int64_t b, int64_t h, int64_t j) const {
    if constexpr (kHalf) return kt + block_of(b, h, j) * D2 * kKeys + (j % kKeys) * 2;
    return kt + block_of(b, h, j) * D * kKeys + j % kKeys;
  }
  // column j of the transposed values (backward)
  const E* vtcol(int64_t b, int64_t h, int64_t j) const {
    return vt + block_of(b, h, j) * Dv * kKeys + j % kKeys;
  }
  // packed value rows j, j + 1 (j even within its block; half-precision products)
  const E* vpair(int64_t b, int64_t h, int64_t j) const {
    return vt + block_of(b, h, j) * kKeys * Dv + (j % kKeys) / 2 * Dv * 2;
  }
  bool flagged(int64_t b, int64_t h, int64_t j) const {
    return kflags.empty() || kflags[block_of(b, h, j)] || vflags[block_of(b, h, j)];
  }
};

// Where the blocks have no flags (decoding reads the keys and values in place), the
// products screen them, a pass over a few values instead of over every key and value, and
// only a block the screen flags is read again to be checked. With finite queries (checked
// before) a raw score is non-finite whenever its key holds NaN or +-inf (inf times a nonzero
// query term stays infinite or meets another to make NaN, times 0 it is NaN), and a row's
// output sums weight * value over every key of a span, weights of 0 included (0 times NaN or
// inf is NaN), so a non-finite value leaves it non-finite through any later rescaling. Scores
// or outputs that overflow from finite inputs pass the second check: the signal stays "a key
// or value read holds NaN or +-inf".
template <typename T, typename E>
bool checked_by_results(const Inputs<T, E>& in) {
  return in.kflags.empty();
}

// Whether keys [kb, kb + n) or their values hold NaN or +-inf (the NaN rule's signal)
template <typename T, typename E>
bool block_nonfinite(const Inputs<T, E>& in, const Task& task, int64_t kb, int64_t n) {
  if (!in.flagged(task.b, task.h, kb)) return false;
  return any_nonfinite(in.krow(task.b, task.h, kb), n, in.D, in.ksr) ||
         any_nonfinite(in.vrow(task.b, task.h, kb), n, in.Dv, in.vsr);
}

// ---------------------------------------------------------------------------------------
// Forward: out [B, H, L, Dv], lse [B, H, L] and, when asked, the weights [B, H, L, S].

// The scores of a block of m query rows against keys [kb, kb + n): C = Q K^T (row stride ldc)
template <typename T, typename E>
void block_scores(const Inputs<T, E>& in, const Task& task, int64_t m, int64_t kb, int64_t n,
                  const E* qt, T* c, int64_t ldc) {
  if constexpr (Inputs<T, E>::kHalf) {
    if (in.kt == nullptr)  // decoding: the bf16 keys in place
      gemm_nt_widened(m, n, in.D, 1.0f, qt, in.qsr, in.krow(task.b, task.h, kb), in.ksr, c, ldc,
                      in.vrow(task.b, task.h, kb), in.vsr, in.Dv);
    else
      block_gemm_vnni(m, n, in.D2, qt, in.qsr, in.ktcol(task.b, task.h, kb), kKeys, false, c,
                      ldc);
  } else if (in.kt != nullptr) {
    block_gemm(m, n, in.D, qt, in.qsr, in.ktcol(task.b, task.h, kb), kKeys, false, c, ldc);
  } else {
    gemm_nt<T, T>(m, n, in.D, T(1), qt, in.qsr, in.krow(task.b, task.h, kb), in.ksr, c, ldc,
                  in.vrow(task.b, task.h, kb), in.vsr, in.Dv);
  }
}

// acc [m, Dv] += W V over keys [kb, kb + n) for half-precision products against the packed
// values: write(i, dst) puts row i's n weights in bf16 at dst, in a buffer whose pairs of
// columns line up with the packed values (a key block starting at an odd offset gets a
// leading column of 0).
template <typename T, typename E, typename Write>
void paired_values(const Inputs<T, E>& in, const Task& task, int64_t m, int64_t kb, int64_t n,
                   T* acc, Write&& write) {
  thread_local std::vector<E> rounded;
  const int64_t lead = (kb % kKeys) % 2, width = (lead + n + 1) / 2 * 2;
  rounded.resize(m * width);
  for (int64_t i = 0; i < m; ++i) {
    E* r = rounded.data() + i * width;
    r[0] = E(0);
    r[width - 1] = E(0);
    write(i, r + lead);
  }
  block_gemm_vnni(m, in.Dv, width, rounded.data(), width, in.vpair(task.b, task.h, kb - lead),
                  in.Dv, true, acc, in.Dv);
}

// acc [m, Dv] += P V over keys [kb, kb + n), P row stride ldp. Half-precision products round
// P to bf16 (as the naive formula in bf16 rounds its weights; paired_values).
template <typename T, typename E>
void block_values(const Inputs<T, E>& in, const Task& task, int64_t m, int64_t kb, int64_t n,
                  const T* p, int64_t ldp, T* acc) {
  if constexpr (Inputs<T, E>::kHalf) {
    if (in.vt == nullptr) {  // decoding: the bf16 values in place (gemm_widened)
      gemm_widened(m, in.Dv, n, p, ldp, in.vrow(task.b, task.h, kb), in.vsr, acc, in.Dv);
      return;
    }
    paired_values(in, task, m, kb, n, acc,
                  [&](int64_t i, E* dst) { to_bf16(dst, p + i * ldp, n); });
  } else {
    const T* vr = in.vrow(task.b, task.h, kb);
    if (in.kt != nullptr)
      block_gemm(m, in.Dv, n, p, ldp, vr, in.vsr, true, acc, in.Dv);
    else  // decoding: bound by reading V; a JIT kernel per cache length would cost more
      gemm<T>(m, in.Dv, n, T(1), p, ldp, 1, vr, in.vsr, true, acc, in.Dv);
  }
}

// One task's online softmax over its key blocks numbered [first, last) (counted across its
// chunks): acc [m, Dv] unnormalized, mx and sum the running row maximum and sum. Consecutive
// key blocks, across chunks, gather into one span of up to kKeys keys (scores row stride
// kKeys) before the softmax update and the product with V: a band's small chunks (a
// triangle, a full run, a triangle) cost one update and one V product per task, not three.
template <typename T, typename E>
void attend(const Inputs<T, E>& in, const Plan& plan, const Terms<T>& terms, const Task& task,
            int64_t first, int64_t last, T* scores, T* acc, T* mx, T* sum, uint8_t* bad) {
  const int64_t* it = plan.items + 6 * task.item;
  const int64_t b_rel = it[0] < 0 ? task.b : task.b - it[0];
  const int64_t m = task.r1 - task.r0, D = in.D, Dv = in.Dv;
  std::fill(acc, acc + m * Dv, T(0));
  std::fill(mx, mx + m, neg_inf<T>());
  std::fill(sum, sum + m, T(0));
  const E* qt = in.qrow(task.b, task.h, task.r0);
  *bad |= any_nonfinite(qt, m, D, in.qsr);
  T top[kRows];  // each row's maximum over the running maximum and the span
  int64_t span0 = 0, width = 0;  // the span: keys [span0, span0 + width)
  // plain (see scaled_row_max): a span's rows hold raw scores, the scale joins the exp
  constexpr bool kFloat = std::is_same_v<T, float>;
  const bool plain = kFloat && terms.cap == 0 && terms.dense == nullptr &&
                     terms.table == nullptr && terms.scale > 0;
  const T exp_scale = plain ? terms.scale : T(1);
  auto flush = [&] {
    if (width == 0) return;
    // row i's online-softmax update over the span: its weights made by exp (which returns
    // their sum), the running sum and accumulator rescaled to the new maximum; false (and
    // nothing done) for a row that sees nothing yet, whose weights are 0
    const auto update = [&](int64_t i, auto&& exp) {
      if (top[i] == neg_inf<T>()) return false;
      const T alpha = exp_nonpositive(mx[i] - top[i]);
      sum[i] = sum[i] * alpha + exp(scores + i * kKeys);
      mx[i] = top[i];
      if (alpha != T(1)) scale_row(acc + i * Dv, Dv, alpha);
      return true;
    };
    bool paired = false;
    if constexpr (Inputs<T, E>::kHalf) {
      if (in.vt != nullptr) {  // the weights exp'd straight into bf16 for the packed values
        paired_values(in, task, m, span0, width, acc, [&](int64_t i, E* dst) {
          const auto exp = [&](const T* row) {
            return exp_scaled(row, width, exp_scale, top[i], dst);
          };
          if (!update(i, exp)) std::fill(dst, dst + width, E(0));
        });
        paired = true;
      }
    }
    if (!paired) {
      for (int64_t i = 0; i < m; ++i) {
        const auto exp = [&](T* row) {
          if constexpr (kFloat)
            return exp_scaled(row, width, exp_scale, top[i], row);
          else
            return exp_shifted(row, width, top[i]);
        };
        if (!update(i, exp)) std::fill(scores + i * kKeys, scores + i * kKeys + width, T(0));
      }
      block_values(in, task, m, span0, width, scores, kKeys, acc);
    }
    if (checked_by_results(in) && !*bad && any_nonfinite(acc, m, Dv, Dv))
      *bad |= block_nonfinite(in, task, span0, width);
    width = 0;
  };
  int64_t index = 0;
  for (int64_t c = it[4]; c < it[5] && index < last; ++c) {
    const int64_t* ch = plan.chunks + 6 * c;
    for (int64_t kb = ch[0]; kb < ch[1] && index < last; kb = next_block(kb, ch[1])) {
      if (index++ < first) continue;
      const int64_t n = next_block(kb, ch[1]) - kb;
      const uint8_t* keep;
      int64_t keep_rs = 0;
      if (!keep_block(plan, ch, b_rel, task.h, task.r0 - it[2], m, kb - ch[0], n, &keep,
                      &keep_rs)) {
        flush();  // keys no row sees are never read
        continue;
      }
      if (width > 0 && (kb != span0 + width || width + n > kKeys)) flush();
      if (width == 0) {
        span0 = kb;
        std::copy(mx, mx + m, top);
      }
      T* part = scores + width;
      block_scores(in, task, m, kb, n, qt, part, kKeys);
      // checked after the product has brought the keys and values into cache: the check
      // reads them there, not from memory
      if (!checked_by_results(in) || any_nonfinite(part, m, n, kKeys))
        *bad |= block_nonfinite(in, task, kb, n);
      for (int64_t i = 0; i < m; ++i) {
        T* row = part + i * kKeys;
        const uint8_t* row_keep = keep == nullptr ? nullptr : keep + i * keep_rs;
        if constexpr (kFloat) {
          if (plain) {
            top[i] = scaled_row_max(row, n, terms.scale, row_keep, top[i]);
            continue;
          }
        }
        top[i] = finish_row(row, n, terms, task.b, task.h, task.r0 + i, kb, row_keep, nullptr,
                            top[i]);
      }
      width += n;
    }
  }
  flush();
}

int64_t key_blocks(const Plan& plan, const Task& task) {
  const int64_t* it = plan.items + 6 * task.item;
  int64_t count = 0;
  for (int64_t c = it[4]; c < it[5]; ++c) {
    const int64_t* ch = plan.chunks + 6 * c;
    for (int64_t kb = ch[0]; kb < ch[1]; kb = next_block(kb, ch[1])) ++count;
  }
  return count;
}

// Normalized output and log-sum-exp of a task's rows; rows that saw nothing get 0 and -inf.
// A head's sink logit joins the denominator here: lse' = log(exp(lse) + exp(sink)), and the
// output shrinks by exp(lse - lse'). `norm` (optional) receives each row's factor from the
// unnormalized sums exp(s - mx) to the weights exp(s - lse').
template <typename T, typename E>
void finish_rows(const Inputs<T, E>& in, const Terms<T>& terms, const Task& task, const T* acc,
                 const T* mx, const T* sum, T* out, T* lse, T* norm) {
  const int64_t Dv = in.Dv;
  for (int64_t i = 0; i < task.r1 - task.r0; ++i) {
    const int64_t row = (task.b * in.H + task.h) * in.L + task.r0 + i;
    T* o = out + row * Dv;
    T factor = 0, l = neg_inf<T>();
    if (sum[i] > T(0)) {
      factor = T(1) / sum[i];
      l = mx[i] + std::log(sum[i]);
      if (terms.sinks != nullptr) {
        const T sink = terms.sinks[task.h], top = std::max(l, sink);
        const T joined = top + std::log(std::exp(l - top) + std::exp(sink - top));
        factor *= std::exp(l - joined);
        l = joined;
      }
    }
    const T* a = acc + i * Dv;
    for (int64_t d = 0; d < Dv; ++d) o[d] = a[d] * factor;
    lse[row] = l;
    if (norm != nullptr) norm[i] = factor;
  }
}

// Finished weights stored in the caller's dtype: dst[j] = src[j] * factor. float32 rows go
// out with non-temporal stores where aligned: the weights are written once and not read
// back, so their cache lines need not be read first (half the memory traffic).
template <typename T, typename W>
void put_weights(W* dst, const T* src, int64_t n, T factor) {
  int64_t j = 0;
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, float> && std::is_same_v<W, float>) {
    for (; j < n && (reinterpret_cast<uintptr_t>(dst + j) & 63) != 0; ++j)
      dst[j] = src[j] * factor;
    for (; j + 16 <= n; j += 16)
      _mm512_stream_ps(dst + j, _mm512_mul_ps(_mm512_loadu_ps(src + j), _mm512_set1_ps(factor)));
  }
#endif
  for (; j < n; ++j) dst[j] = static_cast<W>(src[j] * factor);
}

// dst[0 .. n) = 0, non-temporal like put_weights
template <typename W>
void zero_weights(W* dst, int64_t n) {
  int64_t j = 0;
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<W, float>) {
    for (; j < n && (reinterpret_cast<uintptr_t>(dst + j) & 63) != 0; ++j) dst[j] = 0;
    for (; j + 16 <= n; j += 16) _mm512_stream_ps(dst + j, _mm512_setzero_ps());
  }
#endif
  std::fill(dst + j, dst + n, W(0));
}

// non-temporal stores are weakly ordered: fenced before a task's rows count as written
inline void fence_stores() {
#if defined(__AVX__)
  _mm_sfence();
#endif
}

// The weights asked for: [B, heads, L, S] for the query heads chosen (all of them, or a list:
// heads that no one looks at cost no weights), slot[h] the place of query head h among them
// or -1.
template <typename W>
struct Weights {
  W* data = nullptr;
  int64_t heads = 0;
  std::vector<int64_t> slot;

  W* row(int64_t b, int64_t h, int64_t L, int64_t S, int64_t i) const {
    return data + ((b * heads + slot[h]) * L + i) * S;
  }
};

// The softmax statistics asked for instead of the weights (stats.py's attention_stats), for
// the query heads in `slot` (place among the chosen heads, or -1). Each is zeroed by the caller
// and only added to: key_mass [B, heads, S] sums a key's weights over the query rows,
// window_mass [B, heads, S] over rows >= window_row, entropy [B, heads, L] is each row's
// -sum w log w, head_mean [B, L, S] the mean of the chosen heads' weights.
template <typename T>
struct Stats {
  T* key_mass = nullptr;
  T* window_mass = nullptr;
  T* entropy = nullptr;
  T* head_mean = nullptr;
  int64_t heads = 0, window_row = 0;
  std::vector<int64_t> slot;
};

// One task's rows over the item's key span [*lo, *hi) with their final maxima: the scores are
// kept in `scratch` (row stride hi - lo; small enough to stay in L2), exponentiated once from
// each row's final maximum (keys the rows do not see: 0) and multiplied by V from there; out
// and lse are finished, norm[i] is each row's factor to its weights and, with `moment`,
// moment[i] = sum_j e_j (s_j - max) for its entropy. The caller reads the weights,
// scratch[i, j] * norm[i], before the next task overwrites them.
template <typename T, typename E>
void attend_span(const Inputs<T, E>& in, const Plan& plan, const Terms<T>& terms,
                 const Task& task, T* scratch, T* acc, T* mx, T* sum, T* norm, T* moment, T* out,
                 T* lse, int64_t* lo_out, int64_t* hi_out, uint8_t* bad) {
  const int64_t* it = plan.items + 6 * task.item;
  const int64_t b_rel = it[0] < 0 ? task.b : task.b - it[0];
  const int64_t m = task.r1 - task.r0, D = in.D, Dv = in.Dv;
  const int64_t lo = plan.chunks[6 * it[4]], hi = plan.chunks[6 * (it[5] - 1) + 1];
  const int64_t width = hi - lo;
  *lo_out = lo, *hi_out = hi;
  std::fill(acc, acc + m * Dv, T(0));
  std::fill(mx, mx + m, neg_inf<T>());
  const E* qt = in.qrow(task.b, task.h, task.r0);
  *bad |= any_nonfinite(qt, m, D, in.qsr);
  auto hide = [&](int64_t k0, int64_t k1) {  // keys no row of the task sees: weight 0
    for (int64_t i = 0; i < m; ++i)
      std::fill(scratch + i * width + k0 - lo, scratch + i * width + k1 - lo, neg_inf<T>());
  };
  std::vector<std::pair<int64_t, int64_t>> seen;  // the key blocks read, for the V products
  int64_t done = lo;
  for (int64_t c = it[4]; c < it[5]; ++c) {
    const int64_t* ch = plan.chunks + 6 * c;
    for (int64_t kb = ch[0]; kb < ch[1]; kb = next_block(kb, ch[1])) {
      const int64_t n = next_block(kb, ch[1]) - kb;
      if (kb > done) hide(done, kb);
      done = kb + n;
      const uint8_t* keep;
      int64_t keep_rs = 0;
      if (!keep_block(plan, ch, b_rel, task.h, task.r0 - it[2], m, kb - ch[0], n, &keep,
                      &keep_rs)) {
        hide(kb, kb + n);
        continue;
      }
      *bad |= block_nonfinite(in, task, kb, n);
      seen.emplace_back(kb, n);
      T* block = scratch + (kb - lo);
      block_scores(in, task, m, kb, n, qt, block, width);
      for (int64_t i = 0; i < m; ++i)
        mx[i] = finish_row(block + i * width, n, terms, task.b, task.h, task.r0 + i, kb,
                           keep == nullptr ? nullptr : keep + i * keep_rs, nullptr, mx[i]);
    }
  }
  for (int64_t i = 0; i < m; ++i) {
    T* row = scratch + i * width;
    if (mx[i] == neg_inf<T>()) {
      std::fill(row, row + width, T(0));
      sum[i] = 0;
      if (moment != nullptr) moment[i] = 0;
    } else {
      sum[i] = exp_shifted(row, width, mx[i], moment == nullptr ? nullptr : moment + i);
    }
  }
  for (const auto& [kb, n] : seen)
    block_values(in, task, m, kb, n, scratch + (kb - lo), width, acc);
  finish_rows(in, terms, task, acc, mx, sum, out, lse, norm);
}

// One task with its weights, each written once: the span's weights normalized, the rest of
// each weights row 0, in the same pass.
template <typename T, typename E, typename W>
void attend_weights(const Inputs<T, E>& in, const Plan& plan, const Terms<T>& terms,
                    const Task& task, T* scratch, T* acc, T* mx, T* sum, T* norm, T* out, T* lse,
                    const Weights<W>& weights, uint8_t* bad) {
  int64_t lo, hi;
  attend_span(in, plan, terms, task, scratch, acc, mx, sum, norm, static_cast<T*>(nullptr), out,
              lse, &lo, &hi, bad);
  const int64_t width = hi - lo;
  for (int64_t i = 0; i < task.r1 - task.r0; ++i) {
    W* w = weights.row(task.b, task.h, in.L, in.S, task.r0 + i);
    zero_weights(w, lo);
    put_weights(w + lo, scratch + i * width, width, norm[i]);
    zero_weights(w + hi, in.S - hi);
  }
  fence_stores();
}

// dst[j] += src[j] * factor
template <typename T>
void add_scaled(T* dst, const T* src, int64_t n, T factor) {
  for (int64_t j = 0; j < n; ++j) dst[j] += src[j] * factor;
}

// One task folded into the statistics. A row's weights are w_j = e_j * norm with
// e_j = exp(x_j), x_j = s_j - max, so its entropy is
//   -sum_j w_j log w_j = -norm * sum_j e_j x_j - log(norm) * norm * sum_j e_j
// (the sink's share, when a head has one, is outside the keys' weights and outside the sum).
template <typename T, typename E>
void attend_stats(const Inputs<T, E>& in, const Plan& plan, const Terms<T>& terms,
                  const Task& task, T* scratch, T* acc, T* mx, T* sum, T* norm, T* moment,
                  T* out, T* lse, const Stats<T>& st, uint8_t* bad) {
  int64_t lo, hi;
  attend_span(in, plan, terms, task, scratch, acc, mx, sum, norm,
              st.entropy == nullptr ? nullptr : moment, out, lse, &lo, &hi, bad);
  const int64_t width = hi - lo, S = in.S, unit = task.b * st.heads + st.slot[task.h];
  for (int64_t i = 0; i < task.r1 - task.r0; ++i) {
    const int64_t r = task.r0 + i;
    const T f = norm[i];
    if (f == T(0)) continue;  // the row sees nothing: it adds nothing, its entropy stays 0
    const T* e = scratch + i * width;
    if (st.entropy != nullptr)
      st.entropy[unit * in.L + r] = -f * moment[i] - std::log(f) * f * sum[i];
    if (st.key_mass != nullptr) add_scaled(st.key_mass + unit * S + lo, e, width, f);
    if (st.window_mass != nullptr && r >= st.window_row)
      add_scaled(st.window_mass + unit * S + lo, e, width, f);
    if (st.head_mean != nullptr)
      add_scaled(st.head_mean + (task.b * in.L + r) * S + lo, e, width,
                 f / static_cast<T>(st.heads));
  }
}

// Query rows per weights task: the forward's, halved (down to kMinRows / 4) until the rows'
// scores over the widest item's key span fit `budget` bytes (kScratchBytes for the weights;
// the statistics keep to the plain forward's scores block, so that asking for them adds
// only their own size to the memory a forward holds).
constexpr int64_t kScratchBytes = int64_t(1) << 20;

int64_t weight_rows(const Plan& plan, int64_t rows, int64_t elem,
                    int64_t budget = kScratchBytes) {
  int64_t span = 1;
  for (int64_t n = 0; n < plan.n_items; ++n) {
    const int64_t* it = plan.items + 6 * n;
    if (it[5] > it[4])
      span = std::max(span, plan.chunks[6 * (it[5] - 1) + 1] - plan.chunks[6 * it[4]]);
  }
  while (rows > kMinRows / 4 && rows * span * elem > budget) rows /= 2;
  return rows;
}

// Rows [B, H, L, width] that no item reaches (rows a mask hides from every key) are 0: the
// output, the weights and dq start unfilled.
template <typename W>
void zero_unreached_rows(const Plan& plan, int64_t B, int64_t H, int64_t L, int64_t S,
                         W* weights) {
  std::vector<uint8_t> reached(B * L, 0);
  for (int64_t n = 0; n < plan.n_items; ++n) {
    const int64_t* it = plan.items + 6 * n;
    const int64_t b0 = it[0] < 0 ? 0 : it[0], b1 = it[0] < 0 ? B : it[1];
    for (int64_t b = b0; b < b1; ++b)
      std::fill(reached.begin() + b * L + it[2], reached.begin() + b * L + it[3], 1);
  }
  at::parallel_for(0, B * H, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t u = lo; u < hi; ++u)
      for (int64_t i = 0; i < L; ++i)
        if (!reached[(u / H) * L + i]) zero_weights(weights + (u * L + i) * S, S);
    fence_stores();
  });
}

// Decoding (L <= kDecodeRows) with fewer tasks than threads splits each task's key blocks into
// parts run in parallel; the parts merge through their (max, sum) in a fixed order.
template <typename T, typename E, typename W>
bool forward_impl(const Inputs<T, E>& in, const Plan& plan, const Terms<T>& terms, T* out, T* lse,
                  const Weights<W>* weights) {
  const int64_t threads = at::get_num_threads();
  int64_t rows = task_rows(plan, in.B, in.H, threads);
  if (weights != nullptr) rows = weight_rows(plan, rows, sizeof(T));
  const std::vector<Task> tasks = forward_tasks(plan, in.B, in.H, rows);
  const int64_t n_tasks = static_cast<int64_t>(tasks.size());
  const int64_t Dv = in.Dv;
  int64_t parts = 1;
  if (weights == nullptr && in.L <= kDecodeRows && n_tasks > 0 && n_tasks < 2 * threads) {
    int64_t most = 0;
    for (const Task& task : tasks) most = std::max(most, key_blocks(plan, task));
    parts = std::min(most, (2 * threads + n_tasks - 1) / n_tasks);
  }
  parts = std::max<int64_t>(parts, 1);
  std::vector<uint8_t> bad(n_tasks * parts, 0);  // per unit of work: no shared writes
  zero_unreached_rows(plan, in.B, in.H, in.L, Dv, out);
  // each thread's scratch holds the tallest task's rows: one row for a decoding call, whose
  // scratch is then a few KiB to clear instead of kRows rows (which would also push the keys
  // and values out of the core's cache)
  int64_t tallest = 1;
  for (const Task& task : tasks) tallest = std::max(tallest, task.r1 - task.r0);
  if (parts > 1) {
    const int64_t stride = kDecodeRows * Dv;
    std::vector<T> accs(n_tasks * parts * stride), mxs(n_tasks * parts * kDecodeRows),
        sums(n_tasks * parts * kDecodeRows);
    at::parallel_for(0, n_tasks * parts, 1, [&](int64_t lo, int64_t hi) {
      std::vector<T> scores(tallest * kKeys);
      for (int64_t u = lo; u < hi; ++u) {
        const Task& task = tasks[u / parts];
        const int64_t part = u % parts, blocks = key_blocks(plan, task);
        attend(in, plan, terms, task, blocks * part / parts, blocks * (part + 1) / parts,
               scores.data(), accs.data() + u * stride, mxs.data() + u * kDecodeRows,
               sums.data() + u * kDecodeRows, &bad[u]);
      }
    });
    for (int64_t t = 0; t < n_tasks; ++t) {  // merge the parts, always in part order
      const int64_t m = tasks[t].r1 - tasks[t].r0;
      std::vector<T> acc(m * Dv, T(0)), mx(m, neg_inf<T>()), sum(m, T(0));
      for (int64_t i = 0; i < m; ++i) {
        for (int64_t p = 0; p < parts; ++p)
          mx[i] = std::max(mx[i], mxs[(t * parts + p) * kDecodeRows + i]);
        if (mx[i] == neg_inf<T>()) continue;
        for (int64_t p = 0; p < parts; ++p) {
          const int64_t u = t * parts + p;
          const T w = exp_nonpositive(mxs[u * kDecodeRows + i] - mx[i]);
          sum[i] += sums[u * kDecodeRows + i] * w;
          const T* a = accs.data() + u * stride + i * Dv;
          for (int64_t d = 0; d < Dv; ++d) acc[i * Dv + d] += a[d] * w;
        }
      }
      finish_rows(in, terms, tasks[t], acc.data(), mx.data(), sum.data(), out, lse,
                  static_cast<T*>(nullptr));
    }
    return std::any_of(bad.begin(), bad.end(), [](uint8_t x) { return x != 0; });
  }
  if (weights != nullptr)
    zero_unreached_rows(plan, in.B, weights->heads, in.L, in.S, weights->data);
  int64_t widest = kKeys;  // the widest key span of an item: the weights path's scratch rows
  if (weights != nullptr)
    for (const Task& task : tasks) {
      const int64_t* it = plan.items + 6 * task.item;
      widest = std::max(widest, plan.chunks[6 * (it[5] - 1) + 1] - plan.chunks[6 * it[4]]);
    }
  // tasks are handed out one at a time (a mask's tasks differ in cost: documents of different
  // lengths, causal rows); each task writes only its own rows, so which thread runs it does
  // not change a bit of the result
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min(threads, n_tasks), 1, [&](int64_t, int64_t) {
    std::vector<T> scores(weights == nullptr ? tallest * kKeys : rows * widest),
        acc(tallest * Dv), mx(tallest), sum(tallest), norm(tallest);
    for (int64_t t = next++; t < n_tasks; t = next++) {
      const Task& task = tasks[t];
      if (weights != nullptr && weights->slot[task.h] >= 0) {
        attend_weights(in, plan, terms, task, scores.data(), acc.data(), mx.data(), sum.data(),
                       norm.data(), out, lse, *weights, &bad[t]);
        continue;
      }
      attend(in, plan, terms, task, 0, std::numeric_limits<int64_t>::max(), scores.data(),
             acc.data(), mx.data(), sum.data(), &bad[t]);
      finish_rows(in, terms, task, acc.data(), mx.data(), sum.data(), out, lse,
                  static_cast<T*>(nullptr));
    }
  });
  return std::any_of(bad.begin(), bad.end(), [](uint8_t x) { return x != 0; });
}

// The forward with statistics instead of weights. A statistic is a sum that several tasks add
// to, so the tasks are grouped into units that one thread runs in a fixed order: per (batch
// entry, head) when a key statistic is asked (every task adding to that head's keys), else
// per block of rows, over the heads in order (head_mean adds every head to those rows; an
// entropy row belongs to one task). No two units touch the same memory, so the result is the
// same bit for bit whichever thread runs a unit. Key statistics and head_mean are not asked
// together (stats.py runs them as two passes). The row blocks are listed once (without the
// heads), so the work list stays a few KiB however many heads there are.
template <typename T, typename E>
bool stats_impl(const Inputs<T, E>& in, const Plan& plan, const Terms<T>& terms, T* out, T* lse,
                const Stats<T>& st) {
  const int64_t threads = at::get_num_threads();
  const int64_t rows = weight_rows(plan, task_rows(plan, in.B, in.H, threads), sizeof(T),
                                   kRows * kKeys * int64_t(sizeof(T)));
  const std::vector<Task> blocks = forward_tasks(plan, in.B, 1, rows);  // h = 0 in each
  const bool by_head = st.key_mass != nullptr || st.window_mass != nullptr;
  TORCH_CHECK(!(by_head && st.head_mean != nullptr),
              "key statistics and head_mean run as separate passes");
  const int64_t n_units = by_head ? in.B * in.H : static_cast<int64_t>(blocks.size());
  int64_t widest = kKeys;
  for (const Task& task : blocks) {
    const int64_t* it = plan.items + 6 * task.item;
    widest = std::max(widest, plan.chunks[6 * (it[5] - 1) + 1] - plan.chunks[6 * it[4]]);
  }
  std::vector<uint8_t> bad(std::max<int64_t>(n_units, 1), 0);
  zero_unreached_rows(plan, in.B, in.H, in.L, in.Dv, out);
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min(threads, n_units), 1, [&](int64_t, int64_t) {
    std::vector<T> scores(rows * widest), acc(rows * in.Dv), mx(rows), sum(rows), norm(rows),
        moment(rows);
    auto run = [&](const Task& task, uint8_t* flag) {
      if (st.slot[task.h] >= 0) {
        attend_stats(in, plan, terms, task, scores.data(), acc.data(), mx.data(), sum.data(),
                     norm.data(), moment.data(), out, lse, st, flag);
        return;
      }
      attend(in, plan, terms, task, 0, std::numeric_limits<int64_t>::max(), scores.data(),
             acc.data(), mx.data(), sum.data(), flag);
      finish_rows(in, terms, task, acc.data(), mx.data(), sum.data(), out, lse,
                  static_cast<T*>(nullptr));
    };
    for (int64_t u = next++; u < n_units; u = next++) {
      if (by_head) {  // every row block of batch entry b, for head h
        const int64_t b = u / in.H, h = u % in.H;
        for (Task task : blocks)
          if (task.b == b) task.h = h, run(task, &bad[u]);
      } else {  // one row block, every head
        for (Task task = blocks[u]; task.h < in.H; ++task.h) run(task, &bad[u]);
      }
    }
  });
  return std::any_of(bad.begin(), bad.end(), [](uint8_t x) { return x != 0; });
}

// ---------------------------------------------------------------------------------------
// Backward. One task per (batch entry, key/value head): it owns that head's dK and dV rows
// outright and writes dQ for the query heads of its group, so no two tasks touch the same
// memory and the summation order is fixed.

template <typename T>
void backward_impl(const Inputs<T>& in, const Plan& plan, const Terms<T>& terms, T scale,
                   const T* grad, const T* lse_dead_inf, const T* delta, T* dq, T* dk, T* dv,
                   T* dbias, T* dtable) {
  const int64_t D = in.D, Dv = in.Dv, S = in.S, L = in.L, H = in.H, Hkv = in.Hkv;
  const int64_t groups = H / Hkv;
  const bool capped = terms.cap > 0;
  at::parallel_for(0, in.B * Hkv, 1, [&](int64_t lo, int64_t hi) {
    // dK and dV are gathered transposed (dK^T [D, S], dV^T [Dv, S]): their block products
    // Q^T dS and dO^T P then read P and dS row-major, as the block GEMM wants, and only the
    // small Q and dO blocks (once per query block) and the finished heads get transposed
    std::vector<T> p_buf(kRows * kKeys), ds_buf(kRows * kKeys), dq_buf(kRows * D),
        q_t(D * kRows), g_t(Dv * kRows), dk_t(D * S), dv_t(Dv * S), th(capped ? kKeys : 0);
    for (int64_t t = lo; t < hi; ++t) {
      const int64_t b = t / Hkv, hk = t % Hkv;
      std::fill(dk_t.begin(), dk_t.end(), T(0));
      std::fill(dv_t.begin(), dv_t.end(), T(0));
      for (int64_t h = hk * groups; h < (hk + 1) * groups; ++h) {
        for (int64_t n_it = 0; n_it < plan.n_items; ++n_it) {
          const int64_t* it = plan.items + 6 * n_it;
          if (it[0] >= 0 && (b < it[0] || b >= it[1])) continue;
          const int64_t b_rel = it[0] < 0 ? b : b - it[0];
          for (int64_t r0 = it[2]; r0 < it[3]; r0 += kRows) {
            const int64_t m = std::min(kRows, it[3] - r0);
            const int64_t row0 = (b * H + h) * L + r0;
            std::fill(dq_buf.begin(), dq_buf.begin() + m * D, T(0));
            const T* qt = in.qrow(b, h, r0);
            const T* gt = grad + row0 * Dv;
            transpose(qt, m, D, in.qsr, q_t.data(), m);
            transpose(gt, m, Dv, Dv, g_t.data(), m);
            for (int64_t c = it[4]; c < it[5]; ++c) {
              const int64_t* ch = plan.chunks + 6 * c;
              for (int64_t kb = ch[0]; kb < ch[1]; kb = next_block(kb, ch[1])) {
                const int64_t n = next_block(kb, ch[1]) - kb;
                const uint8_t* keep;
                int64_t keep_rs = 0;
                if (!keep_block(plan, ch, b_rel, h, r0 - it[2], m, kb - ch[0], n, &keep,
                                &keep_rs))
                  continue;
                const T* kr = in.krow(b, h, kb);
                // the queries arrive scaled (see backward): scores = Q K^T, dP = dO V^T
                block_gemm(m, n, D, qt, in.qsr, in.ktcol(b, h, kb), kKeys, false, p_buf.data(),
                           n);
                block_gemm(m, n, Dv, gt, Dv, in.vtcol(b, h, kb), kKeys, false, ds_buf.data(), n);
                for (int64_t i = 0; i < m; ++i) {
                  T* pr = p_buf.data() + i * n;
                  T* dr = ds_buf.data() + i * n;
                  const T l = lse_dead_inf[row0 + i], dl = delta[row0 + i];
                  finish_row(pr, n, terms, b, h, r0 + i, kb,
                             keep == nullptr ? nullptr : keep + i * keep_rs,
                             capped ? th.data() : nullptr, neg_inf<T>());
                  exp_shifted(pr, n, l);
                  // the gradient of the scores after the cap: the additive terms' gradient
                  for (int64_t j = 0; j < n; ++j) dr[j] = pr[j] * (dr[j] - dl);
                  if (dbias != nullptr) {
                    std::copy(dr, dr + n, dbias + (row0 + i) * S + kb);
                  }
                  if (dtable != nullptr) {
                    // entry j sits on distance index (kb + j) - (r0 + i) - shift
                    T* tr = dtable + (b * H + h) * terms.tlen + (kb - (r0 + i) - terms.shift);
                    for (int64_t j = 0; j < n; ++j) tr[j] += dr[j];
                  }
                  if (capped)  // through the cap: d(cap tanh(s / cap)) / ds = 1 - tanh^2
                    for (int64_t j = 0; j < n; ++j) dr[j] *= T(1) - th[j] * th[j];
                }
                // dV^T += dO^T P, dK^T += (scale Q)^T dS, dQ += dS K (scaled once, below)
                block_gemm(Dv, n, m, g_t.data(), m, p_buf.data(), n, true, dv_t.data() + kb, S);
                block_gemm(D, n, m, q_t.data(), m, ds_buf.data(), n, true, dk_t.data() + kb, S);
                block_gemm(m, D, n, ds_buf.data(), n, kr, in.ksr, true, dq_buf.data(), D);
              }
            }
            T* dst = dq + row0 * D;
            for (int64_t x = 0; x < m * D; ++x) dst[x] = scale * dq_buf[x];
          }
        }
      }
      transpose(dk_t.data(), D, S, S, dk + (b * Hkv + hk) * S * D, D);
      transpose(dv_t.data(), Dv, S, S, dv + (b * Hkv + hk) * S * Dv, Dv);
    }
  });
}

// ---------------------------------------------------------------------------------------
// Entry points. q [B, H, L, D], k [B, H_kv, S, D], v [B, H_kv, S, Dv] with any strides; bias:
// empty or float [B, H, L, S] (broadcast strides allowed); table: empty or [H|1, n]; softcap:
// 0 for none; sinks: empty or [H]. Every result is a new contiguous tensor.

at::ScalarType compute_type(const at::Tensor& q) {
  return q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

// rows read as GEMM operands: unit stride along a row, rows apart by at least a row's length
// (an expanded tensor with row stride 0 is made contiguous)
at::Tensor unit_last(const at::Tensor& t, at::ScalarType type) {
  at::Tensor x = t.to(type);
  return x.stride(-1) == 1 && x.stride(-2) >= x.size(-1) ? x : x.contiguous();
}

template <typename T>
Terms<T> make_terms(const at::Tensor& bias, const at::Tensor& table, int64_t table_shift,
                    double softcap, const at::Tensor& sinks, at::ScalarType ct,
                    std::vector<at::Tensor>& keep_alive) {
  keep_alive.push_back(bias.defined() ? bias.to(ct) : bias);
  keep_alive.push_back(table.defined() ? table.to(ct).contiguous() : table);
  keep_alive.push_back(sinks.defined() ? sinks.to(ct).contiguous() : sinks);
  const size_t n = keep_alive.size();
  return Terms<T>(keep_alive[n - 3], keep_alive[n - 2], table_shift, softcap, keep_alive[n - 1]);
}

bool half_products();

// forward_impl with the weights (if asked) in the inputs' dtype, for the heads in `slot`
template <typename T, typename E>
bool forward_into(const Inputs<T, E>& in, const Plan& plan, const Terms<T>& terms, T* out,
                  T* lse, at::Tensor& weights, const std::vector<int64_t>& slot) {
  if (!weights.defined()) {
    const Weights<T>* none = nullptr;
    return forward_impl(in, plan, terms, out, lse, none);
  }
  auto run = [&](auto* data) {
    using W = std::remove_pointer_t<decltype(data)>;
    const Weights<W> w{data, weights.size(1), slot};
    return forward_impl(in, plan, terms, out, lse, &w);
  };
  if constexpr (std::is_same_v<T, float>) {
    if (weights.scalar_type() == at::kBFloat16) return run(weights.data_ptr<at::BFloat16>());
    if (weights.scalar_type() == at::kHalf) return run(weights.data_ptr<at::Half>());
  }
  return run(weights.data_ptr<T>());
}

// slot[h]: the place of query head h among `heads` (int64, distinct; empty: every head, in
// order), or -1; *chosen: how many heads that is
std::vector<int64_t> head_slots(const at::Tensor& heads, int64_t H, int64_t* chosen) {
  std::vector<int64_t> slot(H, -1);
  *chosen = H;
  if (heads.defined() && heads.numel() > 0) {
    TORCH_CHECK(heads.dtype() == at::kLong && heads.dim() == 1);
    const at::Tensor listed = heads.contiguous();
    *chosen = listed.numel();
    for (int64_t i = 0; i < *chosen; ++i) {
      const int64_t h = listed.data_ptr<int64_t>()[i];
      TORCH_CHECK(h >= 0 && h < H && slot[h] < 0, "heads must be distinct indices in [0, H)");
      slot[h] = i;
    }
  } else {
    for (int64_t h = 0; h < H; ++h) slot[h] = h;
  }
  return slot;
}

// Runs body(inputs, terms, out, lse) on the inputs as the kernel reads them: bf16 block
// products with float statistics where this CPU's bf16 microkernel is faster (the scale on
// the float scores; an odd head dim gets a zero column), else q, k and v in the compute type
// (the scale applied as the scores are finished: no scaled copy of the queries). Returns the
// body's answer: whether a block read held NaN or +-inf.
template <typename Body>
bool with_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                 const at::Tensor& bias, const at::Tensor& table, int64_t table_shift,
                 double scale, double softcap, const at::Tensor& sinks, at::Tensor& out,
                 at::Tensor& lse, const std::vector<uint8_t>& read, Body&& body) {
  const at::ScalarType ct = compute_type(q);
  std::vector<at::Tensor> alive;
  const bool blocked = q.size(2) > kDecodeRows;
  bool bad = false;
  if (q.scalar_type() == at::kBFloat16 && !blocked) {
    // decoding: bf16 keys and values read in place, widened as they are loaded
    const at::Tensor qh = unit_last(q, at::kBFloat16), kh = unit_last(k, at::kBFloat16),
                     vh = unit_last(v, at::kBFloat16);
    Terms<float> terms = make_terms<float>(bias, table, table_shift, softcap, sinks, ct, alive);
    terms.scale = static_cast<float>(scale);
    const Inputs<float, at::BFloat16> in(qh, kh, vh, false, false);
    bad = body(in, terms, out.data_ptr<float>(), lse.data_ptr<float>());
  } else if (q.scalar_type() == at::kBFloat16 && blocked && half_products()) {
    at::Tensor qh = unit_last(q, at::kBFloat16);
    if (q.size(3) % 2 != 0) qh = at::constant_pad_nd(qh, {0, 1});
    const at::Tensor kh = unit_last(k, at::kBFloat16), vh = unit_last(v, at::kBFloat16);
    Terms<float> terms = make_terms<float>(bias, table, table_shift, softcap, sinks, ct, alive);
    terms.scale = static_cast<float>(scale);
    const Inputs<float, at::BFloat16> in(qh, kh, vh, true, false, &read);
    bad = body(in, terms, out.data_ptr<float>(), lse.data_ptr<float>());
  } else {
    at::Tensor qc = unit_last(q, ct), kc = unit_last(k, ct), vc = unit_last(v, ct);
    AT_DISPATCH_FLOATING_TYPES(ct, "fused_attention_forward", [&] {
      Terms<scalar_t> terms =
          make_terms<scalar_t>(bias, table, table_shift, softcap, sinks, ct, alive);
      terms.scale = static_cast<scalar_t>(scale);
      const Inputs<scalar_t> in(qc, kc, vc, blocked, false, &read);
      bad = body(in, terms, out.data_ptr<scalar_t>(), lse.data_ptr<scalar_t>());
    });
  }
  return bad;
}

// out [B, H, L, Dv] and lse [B, H, L] as the kernel fills them: every entry of out is
// written once (no zeros first), lse starts at -inf
std::pair<at::Tensor, at::Tensor> forward_outputs(const at::Tensor& q, const at::Tensor& v) {
  const at::ScalarType ct = compute_type(q);
  const int64_t B = q.size(0), H = q.size(1), L = q.size(2);
  at::Tensor out = empty_large({B, H, L, v.size(3)}, q.options().dtype(ct));
  at::Tensor lse = at::full({B, H, L}, -std::numeric_limits<double>::infinity(),
                            q.options().dtype(ct));
  return {out, lse};
}

std::vector<at::Tensor> forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                const at::Tensor& items, const at::Tensor& chunks,
                                const at::Tensor& keep, const at::Tensor& bias,
                                const at::Tensor& table, int64_t table_shift, double scale,
                                double softcap, const at::Tensor& sinks, bool with_weights,
                                const at::Tensor& heads) {
  const int64_t B = q.size(0), H = q.size(1), L = q.size(2), S = k.size(2);
  int64_t chosen = H;  // the weights' heads: every query head, or those listed (in order)
  const std::vector<int64_t> slot = head_slots(heads, H, &chosen);
  auto [out, lse] = forward_outputs(q, v);
  // every weight is written once by the kernel: no zeros first
  at::Tensor weights =
      with_weights ? empty_large({B, chosen, L, S}, q.options()) : at::Tensor();
  const Plan plan = make_plan(items, chunks, keep);
  const bool bad = with_inputs(
      q, k, v, bias, table, table_shift, scale, softcap, sinks, out, lse, read_blocks(plan, S),
      [&](const auto& in, const auto& terms, auto* o, auto* l) {
        return forward_into(in, plan, terms, o, l, weights, slot);
      });
  // the last entry: whether a block the kernel read held NaN or +-inf (the NaN rule's signal)
  std::vector<at::Tensor> result{out.to(q.scalar_type()), lse};
  if (with_weights) result.push_back(weights);
  result.push_back(at::scalar_tensor(bad, q.options().dtype(at::kBool)));
  return result;
}

// The forward with the statistics in `names` (key_mass, window_mass, entropy, head_mean) of
// the query heads `heads` (as forward's) instead of their weights: [out, lse, key_mass,
// window_mass, entropy, head_mean, bad], a statistic not asked for an empty tensor. window_row:
// the first query row window_mass sums. Key statistics and head_mean are separate passes.
std::vector<at::Tensor> forward_stats(const at::Tensor& q, const at::Tensor& k,
                                      const at::Tensor& v, const at::Tensor& items,
                                      const at::Tensor& chunks, const at::Tensor& keep,
                                      const at::Tensor& bias, const at::Tensor& table,
                                      int64_t table_shift, double scale, double softcap,
                                      const at::Tensor& sinks, const at::Tensor& heads,
                                      const std::vector<std::string>& names,
                                      int64_t window_row) {
  const int64_t B = q.size(0), H = q.size(1), L = q.size(2), S = k.size(2);
  int64_t chosen = H;
  const std::vector<int64_t> slot = head_slots(heads, H, &chosen);
  auto [out, lse] = forward_outputs(q, v);
  const auto options = q.options().dtype(compute_type(q));
  auto wanted = [&](const char* name, std::initializer_list<int64_t> shape) {
    const bool asked = std::find(names.begin(), names.end(), name) != names.end();
    return asked ? at::zeros(shape, options) : at::empty({0}, options);
  };
  at::Tensor key_mass = wanted("key_mass", {B, chosen, S});
  at::Tensor window_mass = wanted("window_mass", {B, chosen, S});
  at::Tensor entropy = wanted("entropy", {B, chosen, L});
  at::Tensor head_mean = wanted("head_mean", {B, L, S});
  const Plan plan = make_plan(items, chunks, keep);
  const bool bad = with_inputs(
      q, k, v, bias, table, table_shift, scale, softcap, sinks, out, lse, read_blocks(plan, S),
      [&](const auto& in, const auto& terms, auto* o, auto* l) {
        using T = std::remove_pointer_t<decltype(o)>;
        auto data = [](at::Tensor& t) { return t.numel() > 0 ? t.data_ptr<T>() : nullptr; };
        Stats<T> st;
        st.key_mass = data(key_mass), st.window_mass = data(window_mass);
        st.entropy = data(entropy), st.head_mean = data(head_mean);
        st.heads = chosen, st.window_row = window_row, st.slot = slot;
        return stats_impl(in, plan, terms, o, l, st);
      });
  return {out.to(q.scalar_type()), lse, key_mass, window_mass, entropy, head_mean,
          at::scalar_tensor(bad, q.options().dtype(at::kBool))};
}

std::vector<at::Tensor> backward(const at::Tensor& grad, const at::Tensor& q,
                                 const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
                                 const at::Tensor& lse, const at::Tensor& items,
                                 const at::Tensor& chunks, const at::Tensor& keep,
                                 const at::Tensor& bias, const at::Tensor& table,
                                 int64_t table_shift, double scale, double softcap,
                                 bool bias_grad, bool table_grad) {
  const at::ScalarType ct = compute_type(q);
  at::Tensor qc = unit_last(q.to(ct) * scale, ct), kc = unit_last(k, ct), vc = unit_last(v, ct);
  at::Tensor g = grad.to(ct).contiguous();
  const int64_t B = q.size(0), H = q.size(1), L = q.size(2), S = k.size(2), D = q.size(3);
  // rows that saw nothing: +inf makes every recomputed probability exactly 0
  at::Tensor lse_c = lse.to(ct);
  lse_c = at::where(at::isfinite(lse_c), lse_c, at::full({}, INFINITY, lse_c.options()))
              .contiguous();
  at::Tensor delta = (g * out.to(ct)).sum(-1).contiguous();  // [B, H, L]
  // every (batch entry, key/value head) writes its whole dK and dV, every reached row its dQ
  at::Tensor dq = empty_large({B, H, L, D}, q.options().dtype(ct));
  at::Tensor dk = empty_large({B, k.size(1), S, D}, q.options().dtype(ct));
  at::Tensor dv = empty_large({B, k.size(1), S, v.size(3)}, q.options().dtype(ct));
  at::Tensor dbias = bias_grad ? at::zeros({B, H, L, S}, q.options().dtype(ct)) : at::Tensor();
  at::Tensor dtable = table_grad ? at::zeros({B, H, table.size(1)}, q.options().dtype(ct))
                                 : at::Tensor();
  const Plan plan = make_plan(items, chunks, keep);
  std::vector<at::Tensor> alive;
  AT_DISPATCH_FLOATING_TYPES(ct, "fused_attention_backward", [&] {
    zero_unreached_rows(plan, B, H, L, D, dq.data_ptr<scalar_t>());
    const Terms<scalar_t> terms =
        make_terms<scalar_t>(bias, table, table_shift, softcap, at::Tensor(), ct, alive);
    backward_impl<scalar_t>(
        Inputs<scalar_t>(qc, kc, vc, true, true), plan, terms, static_cast<scalar_t>(scale),
        g.data_ptr<scalar_t>(), lse_c.data_ptr<scalar_t>(), delta.data_ptr<scalar_t>(),
        dq.data_ptr<scalar_t>(), dk.data_ptr<scalar_t>(), dv.data_ptr<scalar_t>(),
        bias_grad ? dbias.data_ptr<scalar_t>() : nullptr,
        table_grad ? dtable.data_ptr<scalar_t>() : nullptr);
  });
  std::vector<at::Tensor> result{dq.to(q.scalar_type()), dk.to(k.scalar_type()),
                                 dv.to(v.scalar_type())};
  result.push_back(bias_grad ? dbias : at::empty({0}, q.options().dtype(ct)));
  result.push_back(table_grad ? dtable : at::empty({0}, q.options().dtype(ct)));
  return result;
}

// The block products' own rate, in FLOP per second of the clock given: the forward's block
// shapes (scores [kRows, kKeys] = Q [kRows, d] K^T, then acc [kRows, d] += P V), operands in
// cache, in float32 or with bf16 operands, for `seconds` on the calling thread.
template <typename E, typename Clock>
double block_rate_here(int64_t d, double seconds, Clock now) {
  const int64_t d2 = (d + 1) / 2 * 2;
  std::vector<E> q(kRows * d2, E(0.5f)), kt(d2 * kKeys, E(0.25f)), p(kRows * kKeys),
      v(kKeys * d2, E(0.125f));
  std::vector<float> s(kRows * kKeys), acc(kRows * d2, 0.0f);
  const double start = now();
  double done = 0, elapsed = 0;
  while (elapsed < seconds) {
    if constexpr (std::is_same_v<E, float>) {
      block_gemm(kRows, kKeys, d2, q.data(), d2, kt.data(), kKeys, false, s.data(), kKeys);
      block_gemm(kRows, d2, kKeys, s.data(), kKeys, v.data(), d2, true, acc.data(), d2);
    } else {
      block_gemm_vnni(kRows, kKeys, d2, q.data(), d2, kt.data(), kKeys, false, s.data(), kKeys);
      to_bf16(p.data(), s.data(), kRows * kKeys);
      block_gemm_vnni(kRows, d2, kKeys, p.data(), kKeys, v.data(), d2, true, acc.data(), d2);
    }
    done += 4.0 * kRows * kKeys * d2;
    elapsed = now() - start;
  }
  return done / elapsed;
}

double wall_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// The block products' peak: GFLOP/s on every thread at once (wall clock), in float32 or
// with bf16 operands. What the kernel's time is best compared with: on some CPUs torch's own
// float32 matmul runs well below it.
double block_peak(int64_t d, double seconds, bool bf16) {
#ifndef MULTIHEAD_BRGEMM
  if (bf16) return 0.0;
#endif
  const int64_t threads = at::get_num_threads();
  std::vector<double> rates(threads, 0.0);
  at::parallel_for(0, threads, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) {
#ifdef MULTIHEAD_BRGEMM
      if (bf16) {
        rates[t] = block_rate_here<at::BFloat16>(d, seconds, wall_seconds);
        continue;
      }
#endif
      rates[t] = block_rate_here<float>(d, seconds, wall_seconds);
    }
  });
  double total = 0;
  for (const double r : rates) total += r;
  return total / 1e9;
}

// Whether bf16 inputs run their block products in bf16: where the bf16 microkernel is at least
// 1.25x the float one on this machine (CPUs with AVX512-BF16 or AMX), timed once per process
// on the calling thread in its own CPU time (a busy machine does not change the answer), a
// few milliseconds. Elsewhere bf16 inputs are widened to float once per call, which keeps the
// 2x error rule as well and runs at the float speed.
bool half_products() {
#ifdef MULTIHEAD_BRGEMM
  static const bool faster = [] {
#if defined(__x86_64__)
    if (!at::native::cpublas::could_pack(at::kBFloat16) && !__builtin_cpu_supports("avx512bf16"))
      return false;
#endif
    const auto cpu_seconds = [] {
      timespec t{};
      clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
      return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
    };
    double wide = 0, half = 0;
    for (int round = 0; round < 3; ++round) {
      wide = std::max(wide, block_rate_here<float>(64, 0.003, cpu_seconds));
      half = std::max(half, block_rate_here<at::BFloat16>(64, 0.003, cpu_seconds));
    }
    return half >= 1.25 * wide;
  }();
  return faster;
#else
  return false;
#endif
}

// How many of torch's intra-op threads one parallel loop of the kernel reaches, over `tasks`
// tasks (a check of the build: without OpenMP, at::parallel_for runs on the calling thread).
int64_t parallel_threads(int64_t tasks) {
  std::vector<int> seen(std::max<int64_t>(tasks, 0), -1);
  at::parallel_for(0, tasks, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) seen[t] = at::get_thread_num();
  });
  std::sort(seen.begin(), seen.end());
  return std::unique(seen.begin(), seen.end()) - seen.begin();
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("forward_stats", &forward_stats,
        "the forward with softmax statistics of chosen heads instead of their weights");
  m.def("block_peak", &block_peak, "GFLOP/s of the block products (float32 or bf16), all threads");
  m.def("half_products", &half_products, "whether bf16 inputs use bf16 block products here");
  m.def("parallel_threads", &parallel_threads, "threads one parallel loop reaches");
  m.def("pool_stats", &pool_stats,
        "the large-buffer pool: (buffers waiting, their bytes, takes it served, takes it missed)");
  m.def("forward", &forward, "fused attention forward: (out, lse[, weights], saw non-finite)");
  m.def("backward", &backward, "fused attention backward: (dq, dk, dv, dbias, dtable)");
}
