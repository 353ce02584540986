// Products of a few rows by a large weight matrix: the one-row products of decoding.
//
// out[m, n] = scale[n] * sum_k x[m, k] * w[n, k] + bias[n], for x float32 (M, K) with M small
// (one row per sequence being decoded) and w (N, K) row-major in float32, bfloat16 or int8
// (weight-only quantization with one scale per output channel). The weights are read once
// per call and converted to float32 in registers; activations and sums stay float32.
//
// A BLAS runs such a product as a matrix-vector product that one core streams; here the
// output channels are split over torch's intra-op pool (at::parallel_for), so every core
// streams its share of the weights and torch.set_num_threads governs it. Each output is
// summed by one task in a fixed order: results are bitwise reproducible for any thread count.
//
// The inner loops keep 16 independent float lanes per row, so the compiler vectorizes them
// (one AVX-512 or two AVX2 fused multiply-adds per 16 weights) without reassociating a sum.

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace {

constexpr int64_t kLanes = 16;
constexpr int64_t kGrain = 16;  // output channels per task at least: amortizes the dispatch
constexpr int64_t kBlock = 512;  // weights widened at a time (2 KiB of floats: L1)
constexpr int64_t kMaxRows = 16;  // rows per call at most (MAX_ROWS in quant.py)

inline float widen(float v) { return v; }
inline float widen(int8_t v) { return static_cast<float>(v); }
inline float widen(c10::BFloat16 v) {
  uint32_t bits = static_cast<uint32_t>(v.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// One row of x against a block of float weights: acc[l] += sum over the block's lanes
inline void dot_block(const float* x, const float* w, int64_t len, float* acc) {
  float a[kLanes];
  for (int64_t l = 0; l < kLanes; ++l) a[l] = acc[l];
  for (int64_t i = 0; i + kLanes <= len; i += kLanes) {
    for (int64_t l = 0; l < kLanes; ++l) a[l] += x[i + l] * w[i + l];
  }
  for (int64_t l = 0; l < kLanes; ++l) acc[l] = a[l];
}

inline const float* as_float(const float* w, int64_t len, float* buffer) { return w; }

template <typename W>
inline const float* as_float(const W* w, int64_t len, float* buffer) {
  for (int64_t i = 0; i < len; ++i) buffer[i] = widen(w[i]);
  return buffer;
}

// R rows of x against one weight row w (K entries): sums[r] = sum_k x[r, k] * w[k]. The
// weights are widened a block at a time into a float buffer that stays in L1, then every row
// runs over the block.
template <typename W>
inline void dot_rows(const float* x, int64_t ldx, int64_t R, const W* w, int64_t K,
                     float* sums) {
  float acc[kMaxRows][kLanes] = {};
  float buffer[kBlock];
  const int64_t whole = K / kLanes * kLanes;
  for (int64_t k0 = 0; k0 < whole; k0 += kBlock) {
    const int64_t len = std::min(kBlock, whole - k0);
    const float* wf = as_float(w + k0, len, buffer);
    for (int64_t r = 0; r < R; ++r) dot_block(x + r * ldx + k0, wf, len, acc[r]);
  }
  for (int64_t r = 0; r < R; ++r) {
    float s = 0.0f;
    for (int64_t l = 0; l < kLanes; ++l) s += acc[r][l];
    const float* xr = x + r * ldx;
    for (int64_t t = whole; t < K; ++t) s += xr[t] * widen(w[t]);
    sums[r] = s;
  }
}

template <typename W>
void rows_kernel(const float* x, int64_t M, int64_t K, const W* w, int64_t N,
                 const float* scale, const float* bias, float* out) {
  at::parallel_for(0, N, kGrain, [&](int64_t n0, int64_t n1) {
    float sums[kMaxRows];
    for (int64_t n = n0; n < n1; ++n) {
      const W* wn = w + n * K;
      const float s = scale ? scale[n] : 1.0f;
      const float b = bias ? bias[n] : 0.0f;
      dot_rows(x, K, M, wn, K, sums);
      for (int64_t r = 0; r < M; ++r) out[r * N + n] = sums[r] * s + b;
    }
  });
}

torch::Tensor rows_linear(torch::Tensor x, torch::Tensor w, torch::Tensor scale,
                          torch::Tensor bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be float32 (M, K)");
  TORCH_CHECK(w.dim() == 2 && w.size(1) == x.size(1), "w must be (N, K) with x's K");
  x = x.contiguous();
  w = w.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(M <= kMaxRows, "rows_linear takes at most 16 rows");
  const float* s = nullptr;
  const float* b = nullptr;
  if (scale.numel()) {
    TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.numel() == N, "scale: float32 (N,)");
    scale = scale.contiguous();
    s = scale.data_ptr<float>();
  }
  if (bias.numel()) {
    TORCH_CHECK(bias.scalar_type() == at::kFloat && bias.numel() == N, "bias: float32 (N,)");
    bias = bias.contiguous();
    b = bias.data_ptr<float>();
  }
  auto out = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  switch (w.scalar_type()) {
    case at::kFloat: rows_kernel(xp, M, K, w.data_ptr<float>(), N, s, b, op); break;
    case at::kBFloat16: rows_kernel(xp, M, K, w.data_ptr<c10::BFloat16>(), N, s, b, op); break;
    case at::kChar: rows_kernel(xp, M, K, w.data_ptr<int8_t>(), N, s, b, op); break;
    default: TORCH_CHECK(false, "w must be float32, bfloat16 or int8");
  }
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rows_linear", &rows_linear, "few-row linear over float32/bf16/int8 weights");
}
