// Products of a few rows by a large weight matrix: the one-row products of decoding.
//
// out[m, n] = scale[n] * sum_k x[m, k] * w[n, k] + bias[n], for x float32 (M, K) with M small
// (one row per sequence being decoded, 16 at most) and w (N, K) row-major in float32, bfloat16
// or int8 (weight-only quantization with one scale per output channel), or uint8 ("w8a16":
// int8 codes offset by 128, against activations rounded to int16; see rows_kernel_i16). The weights are read
// once per call and widened to float32 in registers; activations and sums stay float32.
//
// A BLAS runs such a product as a matrix-vector product that one core streams; here the
// output channels are split over torch's intra-op pool (at::parallel_for), so every core
// streams its share of the weights and torch.set_num_threads governs it.
//
// Register blocking: a task walks its channels NB at a time and the rows R at a time (R <= 8),
// keeping R x NB vectors of 16 partial sums in registers; each 16 weights loaded (and widened)
// serve all R rows, and each 16 activations loaded serve all NB channels. Few rows give few
// accumulators, so one row takes NB = 4 channels: four independent chains of fused
// multiply-adds hide their latency.
//
// Every output is summed the same way whatever the blocking and the task it falls in: 16 lane
// sums over k in order, a fixed tree over the lanes, then the K % 16 tail in order. Results are
// therefore bitwise the same for any thread count, row count and channel split.
//
// rows_linear_stacked runs several matrices of one input width (a layer's q, k and v
// projections; a gated feed-forward's gate and up) as the one matrix of their channels
// stacked, in one parallel loop: each output is the bits rows_linear gives it, and a
// decoding step pays one call, one dispatch to the threads and one output for the group.

// ATen's per-operator headers and torch's pybind casters rather than torch/extension.h, which
// pulls in the whole C++ frontend and doubles the compile time
#include <torch/csrc/utils/pybind.h>

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "simd.h"

namespace {

// every output is summed in 16 float lanes (VF16) whatever the CPU's vector width
constexpr int64_t kLanes16 = 16;
constexpr int64_t kGrain = 16;  // output channels per task at least: amortizes the dispatch
constexpr int64_t kMaxRows = 16;  // rows per call at most (the Python side's limit)
constexpr int kRowBlock = 8;  // rows held in registers at once
constexpr int64_t kAheadBytes = 12 << 10;  // how far ahead of the sums the weights are fetched

// R rows of x (row stride ldx) against NB weight rows starting at w (row stride K):
// sums[r * NB + j] = sum_k x[r, k] * w[j, k].
template <int R, int NB, typename W>
inline void block(const float* x, int64_t ldx, const W* w, int64_t K, float* sums) {
  VF16 acc[R][NB];
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < NB; ++j) acc[r][j] = VF16{};
  }
  const int64_t whole = K / kLanes16 * kLanes16;
  // the weight rows after these follow them in memory: fetch the rows `ahead` rows on (a
  // whole number of blocks, at least kAheadBytes on) into L2 while these are summed. Each of
  // the NB streams is only K weights long, too short for the hardware prefetcher to ramp up.
  constexpr int64_t kLine = 64 / sizeof(W);
  const int64_t row_bytes = K * static_cast<int64_t>(sizeof(W));
  const int64_t ahead =
      row_bytes ? (kAheadBytes + NB * row_bytes - 1) / (NB * row_bytes) * NB * K : 0;
  for (int64_t k = 0; k < whole; k += kLanes16) {
    if (k % kLine == 0) {
      for (int j = 0; j < NB; ++j) prefetch_l2(w + ahead + j * K + k);
    }
    VF16 wv[NB];
    for (int j = 0; j < NB; ++j) wv[j] = load_float<VF16>(w + j * K + k);
    for (int r = 0; r < R; ++r) {
      const VF16 xv = load_float<VF16>(x + r * ldx + k);
      for (int j = 0; j < NB; ++j) acc[r][j] = mul_add(xv, wv[j], acc[r][j]);
    }
  }
  for (int r = 0; r < R; ++r) {
    const float* xr = x + r * ldx;
    for (int j = 0; j < NB; ++j) {
      float s = tree_sum(acc[r][j]);  // the fixed tree: lanes 8 apart, then 4, 2, 1
      const W* wj = w + j * K;
      for (int64_t t = whole; t < K; ++t) s += xr[t] * static_cast<float>(wj[t]);
      sums[r * NB + j] = s;
    }
  }
}

// f(std::integral_constant<int, R>) for R = rows (1 to kRowBlock): a block's row count as the
// compile-time constant its accumulators are sized by
template <typename F>
inline void by_rows(int64_t rows, F&& f) {
  switch (rows) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 5: f(std::integral_constant<int, 5>{}); break;
    case 6: f(std::integral_constant<int, 6>{}); break;
    case 7: f(std::integral_constant<int, 7>{}); break;
    default: f(std::integral_constant<int, 8>{}); break;
  }
}

// f(std::integral_constant<int, NB>, n) over channels [n0, n1), NB at a time (more rows hold
// more accumulators: fewer channels at a time keep them in registers), the rest one by one
template <typename F>
inline void by_channels(int64_t M, int64_t n0, int64_t n1, F&& f) {
  int64_t n = n0;
  if (M <= 4) {
    for (; n + 4 <= n1; n += 4) f(std::integral_constant<int, 4>{}, n);
  } else {
    for (; n + 2 <= n1; n += 2) f(std::integral_constant<int, 2>{}, n);
  }
  for (; n < n1; ++n) f(std::integral_constant<int, 1>{}, n);
}

// Channels [n, n + NB) for rows [0, M): R rows at a time, then the output's scale and bias;
// output row r starts at out + r * ldo.
template <int NB, typename W>
inline void channels(const float* x, int64_t M, int64_t K, const W* w, int64_t n, int64_t ldo,
                     const float* scale, const float* bias, float* out) {
  float sums[kRowBlock * NB];
  for (int64_t r0 = 0; r0 < M; r0 += kRowBlock) {
    const int64_t rows = std::min<int64_t>(kRowBlock, M - r0);
    const float* xr = x + r0 * K;
    const W* wn = w + n * K;
    by_rows(rows, [&](auto R) { block<decltype(R)::value, NB>(xr, K, wn, K, sums); });
    for (int64_t r = 0; r < rows; ++r) {
      for (int j = 0; j < NB; ++j) {
        const int64_t c = n + j;
        const float s = scale ? scale[c] : 1.0f;
        const float b = bias ? bias[c] : 0.0f;
        out[(r0 + r) * ldo + c] = sums[r * NB + j] * s + b;
      }
    }
  }
}

// One matrix of a product: w (N, K) of the call's weight type, its scale and bias (or null),
// and where its channels start in the output row.
struct Part {
  const void* w;
  int64_t N;
  const float* scale;
  const float* bias;
  int64_t column;
};

// The parts' channels, numbered through one after another, split over the threads: a task's
// range takes its share of each part it overlaps, f(part, n0, n1) its channels [n0, n1) of
// the part.
template <typename F>
inline void over_parts(const std::vector<Part>& parts, int64_t ldo, F&& f) {
  at::parallel_for(0, ldo, kGrain, [&](int64_t n0, int64_t n1) {
    for (const Part& p : parts) {
      const int64_t lo = std::max(n0, p.column), hi = std::min(n1, p.column + p.N);
      if (lo < hi) f(p, lo - p.column, hi - p.column);
    }
  });
}

// "w8a16" weights: int8 codes stored offset by 128 as uint8 (1..255), against activations
// rounded to int16 (one scale per row: the row's largest magnitude becomes 32767), summed
// exactly in integers. With AVX512-VNNI, vpdpwssd multiplies 32 int16 pairs and adds them into
// 16 int32 lanes in one instruction, where the float path converts every 16 weights to float
// (two instructions) before its multiply-add; the weights are widened 32 at a time (one
// instruction). The offset comes out once per output: sum x (u - 128) = sum x u - 128 sum x.
// A lane adds at most 2 products of 32767 x 255 per 32 inputs, so kChunk inputs keep it below
// 2^31; the lanes go to int64 after each chunk. Integer sums are exact, so every output is the
// same on every CPU, thread count and split; they differ from "int8" on the float path by the
// activations' rounding (at most 1/65534 of the row's largest magnitude per input).
constexpr int64_t kChunk = 2048;  // inputs summed in int32 lanes before they go to int64

#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
inline int64_t lanes_int64(__m512i acc) {
  const __m512i lo = _mm512_cvtepi32_epi64(_mm512_castsi512_si256(acc));
  const __m512i hi = _mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64(acc, 1));
  return _mm512_reduce_add_epi64(_mm512_add_epi64(lo, hi));
}
#endif

// sums[r * NB + j] = sum_k x[r, k] * w[j, k] over k < K / 32 * 32, exactly
template <int R, int NB>
inline void block_i16(const int16_t* x, int64_t ldx, const uint8_t* w, int64_t K,
                      int64_t* sums) {
  for (int i = 0; i < R * NB; ++i) sums[i] = 0;
  const int64_t whole = K / 32 * 32;
#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
  const int64_t ahead = K ? (kAheadBytes + NB * K - 1) / (NB * K) * NB * K : 0;
  for (int64_t c0 = 0; c0 < whole; c0 += kChunk) {
    const int64_t c1 = std::min(whole, c0 + kChunk);
    __m512i acc[R][NB];
    for (int r = 0; r < R; ++r) {
      for (int j = 0; j < NB; ++j) acc[r][j] = _mm512_setzero_si512();
    }
    for (int64_t k = c0; k < c1; k += 32) {
      if (k % 64 == 0) {
        for (int j = 0; j < NB; ++j) prefetch_l2(w + ahead + j * K + k);
      }
      __m512i wv[NB];
      for (int j = 0; j < NB; ++j) {
        const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + j * K + k));
        wv[j] = _mm512_cvtepu8_epi16(b);
      }
      for (int r = 0; r < R; ++r) {
        const __m512i xv = _mm512_loadu_si512(x + r * ldx + k);
        for (int j = 0; j < NB; ++j) acc[r][j] = _mm512_dpwssd_epi32(acc[r][j], xv, wv[j]);
      }
    }
    for (int r = 0; r < R; ++r) {
      for (int j = 0; j < NB; ++j) sums[r * NB + j] += lanes_int64(acc[r][j]);
    }
  }
#else
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < NB; ++j) {
      int64_t total = 0;
      for (int64_t k = 0; k < whole; ++k) total += int64_t{x[r * ldx + k]} * w[j * K + k];
      sums[r * NB + j] = total;
    }
  }
#endif
}

// Channels [n, n + NB) for rows [0, M) of the int16 activations xq (row scales xs, row sums
// xsum); the tail past K / 32 * 32 and the offset of 128 added here
template <int NB>
inline void channels_i16(const int16_t* xq, const float* xs, const int64_t* xsum, int64_t M,
                         int64_t K, const uint8_t* w, int64_t n, int64_t ldo, const float* scale,
                         const float* bias, float* out) {
  int64_t sums[kRowBlock * NB];
  const int64_t whole = K / 32 * 32;
  for (int64_t r0 = 0; r0 < M; r0 += kRowBlock) {
    const int64_t rows = std::min<int64_t>(kRowBlock, M - r0);
    const int16_t* xr = xq + r0 * K;
    const uint8_t* wn = w + n * K;
    by_rows(rows, [&](auto R) { block_i16<decltype(R)::value, NB>(xr, K, wn, K, sums); });
    for (int64_t r = 0; r < rows; ++r) {
      const int16_t* x1 = xr + r * K;
      for (int j = 0; j < NB; ++j) {
        const uint8_t* wj = wn + j * K;
        int64_t total = sums[r * NB + j] - 128 * xsum[r0 + r];
        for (int64_t t = whole; t < K; ++t) total += int64_t{x1[t]} * wj[t];
        const int64_t c = n + j;
        const float s = (scale ? scale[c] : 1.0f) * xs[r0 + r];
        const float b = bias ? bias[c] : 0.0f;
        out[(r0 + r) * ldo + c] = static_cast<float>(total) * s + b;
      }
    }
  }
}

// x (M, K) float32 as int16 (xq, M x K), one scale per row (xs: round(x / s) with
// s = max |x| / 32767, 0 for a row of zeros) and each row's sum of the int16 values (xsum)
inline void activations_i16(const float* x, int64_t M, int64_t K, int16_t* xq, float* xs,
                            int64_t* xsum) {
  for (int64_t r = 0; r < M; ++r) {
    const float* xr = x + r * K;
    float top = 0.0f;
    for (int64_t k = 0; k < K; ++k) top = std::max(top, std::fabs(xr[k]));
    xs[r] = top / 32767.0f;
    const float inv = top > 0.0f ? 32767.0f / top : 0.0f;
    int64_t total = 0;
    for (int64_t k = 0; k < K; ++k) {
      const float v = std::min(32767.0f, std::max(-32767.0f, xr[k] * inv));
      xq[r * K + k] = static_cast<int16_t>(std::lrintf(v));
      total += xq[r * K + k];
    }
    xsum[r] = total;
  }
}

// w8a16 parts' channels on the integer path, split over the threads as rows_kernel splits them
inline void rows_kernel_i16(const float* x, int64_t M, int64_t K, const std::vector<Part>& parts,
                            int64_t ldo, float* out) {
  std::vector<int16_t> xq(M * K);
  std::vector<float> xs(M);
  std::vector<int64_t> xsum(M);
  activations_i16(x, M, K, xq.data(), xs.data(), xsum.data());
  const int16_t* q = xq.data();
  const float* s = xs.data();
  const int64_t* t = xsum.data();
  over_parts(parts, ldo, [&](const Part& p, int64_t n0, int64_t n1) {
    const uint8_t* w = static_cast<const uint8_t*>(p.w);
    float* o = out + p.column;
    by_channels(M, n0, n1, [&](auto NB, int64_t n) {
      channels_i16<decltype(NB)::value>(q, s, t, M, K, w, n, ldo, p.scale, p.bias, o);
    });
  });
}

// The parts' products on the float path (weights of type W widened to float32 in registers)
template <typename W>
void rows_kernel(const float* x, int64_t M, int64_t K, const std::vector<Part>& parts,
                 int64_t ldo, float* out) {
  over_parts(parts, ldo, [&](const Part& p, int64_t n0, int64_t n1) {
    const W* w = static_cast<const W*>(p.w);
    float* o = out + p.column;
    by_channels(M, n0, n1, [&](auto NB, int64_t n) {
      channels<decltype(NB)::value>(x, M, K, w, n, ldo, p.scale, p.bias, o);
    });
  });
}

// The parts' products (their weights all of ``dtype``) on the path that dtype takes: the float
// kernel for float32, bf16 and int8, the integer one for w8a16's uint8.
inline void run_parts(at::ScalarType dtype, const float* x, int64_t M, int64_t K,
                      const std::vector<Part>& parts, int64_t ldo, float* out) {
  switch (dtype) {
    case at::kFloat: rows_kernel<float>(x, M, K, parts, ldo, out); break;
    case at::kBFloat16: rows_kernel<c10::BFloat16>(x, M, K, parts, ldo, out); break;
    case at::kChar: rows_kernel<int8_t>(x, M, K, parts, ldo, out); break;
    case at::kByte: rows_kernel_i16(x, M, K, parts, ldo, out); break;
    default: TORCH_CHECK(false, "w must be float32, bfloat16, int8 or uint8 (w8a16)");
  }
}

// The float32 data of an optional (N,) vector: null when empty
const float* optional_vector(at::Tensor& t, int64_t N, const char* what) {
  if (!t.numel()) return nullptr;
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.numel() == N, what, ": float32 (N,)");
  t = t.contiguous();
  return t.data_ptr<float>();
}

// out (..., N_1 + ... + N_n) = x (..., K) against each (w_i, scale_i, bias_i), the matrices in
// one dtype and of x's width K; an empty scale or bias means none. x's leading dimensions are
// its rows. The vectors hold the tensors made contiguous for the call.
at::Tensor rows_linear_stacked(at::Tensor x, std::vector<at::Tensor> ws,
                               std::vector<at::Tensor> scales, std::vector<at::Tensor> biases) {
  TORCH_CHECK(x.dim() >= 1 && x.scalar_type() == at::kFloat, "x must be float32 (..., K)");
  TORCH_CHECK(!ws.empty() && scales.size() == ws.size() && biases.size() == ws.size(),
              "one scale and one bias (either may be empty) per weight matrix");
  std::vector<int64_t> shape = x.sizes().vec();
  const int64_t K = shape.back();
  int64_t M = 1;
  for (size_t d = 0; d + 1 < shape.size(); ++d) M *= shape[d];
  x = x.reshape({M, K}).contiguous();
  TORCH_CHECK(M <= kMaxRows, "rows_linear takes at most 16 rows");
  const at::ScalarType dtype = ws[0].scalar_type();
  std::vector<Part> parts;
  int64_t total = 0;
  for (size_t i = 0; i < ws.size(); ++i) {
    TORCH_CHECK(ws[i].dim() == 2 && ws[i].size(1) == K, "w must be (N, K) with x's K");
    TORCH_CHECK(ws[i].scalar_type() == dtype, "the stacked matrices must share one dtype");
    ws[i] = ws[i].contiguous();
    const int64_t N = ws[i].size(0);
    parts.push_back({ws[i].data_ptr(), N, optional_vector(scales[i], N, "scale"),
                     optional_vector(biases[i], N, "bias"), total});
    total += N;
  }
  shape.back() = total;
  auto out = at::empty(shape, x.options());
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  run_parts(dtype, xp, M, K, parts, total, op);
  return out;
}

// rows_linear_stacked's output cut into each matrix's (..., N_i), each contiguous: views of the
// one output where x holds one row, copies otherwise
std::vector<at::Tensor> rows_linear_parts(at::Tensor x, std::vector<at::Tensor> ws,
                                          std::vector<at::Tensor> scales,
                                          std::vector<at::Tensor> biases) {
  at::Tensor out = rows_linear_stacked(x, ws, scales, biases);
  std::vector<at::Tensor> cut;
  int64_t column = 0;
  for (const at::Tensor& w : ws) {
    cut.push_back(out.narrow(-1, column, w.size(0)).contiguous());
    column += w.size(0);
  }
  return cut;
}

at::Tensor rows_linear(at::Tensor x, at::Tensor w, at::Tensor scale, at::Tensor bias) {
  return rows_linear_stacked(x, {w}, {scale}, {bias});
}

// the whole decoding step over these products (multihead/modules/decoding_native.py)
#include "decoding_native.h"

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rows_linear", &rows_linear, "few-row linear over float32/bf16/int8 weights");
  m.def("rows_linear_stacked", &rows_linear_stacked,
        "few-row linear over several matrices of one dtype and width, their outputs side by side");
  m.def("rows_linear_parts", &rows_linear_parts,
        "rows_linear_stacked's output as one contiguous tensor per matrix");
  m.def("native_step", &native_step,
        "a decoder's decoding step through every layer, the new keys and values cached");
}
