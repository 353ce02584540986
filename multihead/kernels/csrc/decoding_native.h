// A decoder's whole decoding step in C++: one new token per row through every layer, with no
// Python between the layers (multihead/modules/decoding_native.py prepares the arguments once
// per model).
//
// Per layer: the first norm (LayerNorm or RMSNorm), the q, k and v products as one stacked
// product (rows_kernel), the rotary embedding of q and k (half-split or interleaved pairs),
// the new key and value written into the cache at slot `start` of every row, attention of the
// one query row over the S = start + 1 cached keys (grouped-query heads read their key/value
// head), the output product, the residual, the second norm, the feed-forward (GELU or ReLU
// between two products, or SiLU/GELU-gated with gate and up stacked), the residual.
//
// Every product runs on rows_kernel (the few-row kernel above, over float32, bf16 or int8
// weights); the norms, the rotary, the softmax and the activations are plain float32 loops,
// summed in other orders than torch's, so a step equals the modules' path within float32
// rounding, not bit for bit. Included by rows_linear.cpp, whose anonymous namespace it shares.

#include <cmath>

// one layer's tensors, in the order modules/decoding_native.py hands them over (an absent bias,
// scale or norm bias is an empty tensor)
enum LayerPart : int {
  kNorm1W, kNorm1B, kQW, kQS, kQB, kKW, kKS, kKB, kVW, kVS, kVB, kOW, kOS, kOB,
  kNorm2W, kNorm2B, kUpW, kUpS, kUpB, kGateW, kGateS, kGateB, kDownW, kDownS, kDownB,
  kLayerParts
};

enum Norm : int { kLayerNorm = 0, kRmsNorm = 1 };
enum Activation : int { kGeluErf = 0, kGeluTanh = 1, kSilu = 2, kRelu = 3 };

// The float32 data of a tensor, or null when it is empty (contiguity is checked once, in
// Python, when the arguments are prepared).
inline const float* floats_or_null(const at::Tensor& t) {
  return t.numel() ? t.data_ptr<float>() : nullptr;
}

// out (M, sum N_i) = x (M, K) against the products' weights (one dtype), each with its scale
// and bias (or none), side by side.
inline void products(const float* x, int64_t M, int64_t K,
                     std::initializer_list<const at::Tensor*> parts_in, float* out,
                     int64_t ldo) {
  std::vector<Part> parts;
  int64_t column = 0;
  at::ScalarType dtype = (*parts_in.begin())[0].scalar_type();
  for (const at::Tensor* p : parts_in) {
    const int64_t N = p[0].size(0);
    parts.push_back({p[0].data_ptr(), N, floats_or_null(p[1]), floats_or_null(p[2]), column});
    column += N;
  }
  run_parts(dtype, x, M, K, parts, ldo, out);
}

// y (M, E) = norm(x) with weight w and bias b (or none)
inline void normed(const float* x, int64_t M, int64_t E, int norm, float eps, const float* w,
                   const float* b, float* y) {
  for (int64_t r = 0; r < M; ++r) {
    const float* xr = x + r * E;
    float* yr = y + r * E;
    double mean = 0.0, squares = 0.0;
    if (norm == kLayerNorm) {
      for (int64_t i = 0; i < E; ++i) mean += xr[i];
      mean /= E;
    }
    for (int64_t i = 0; i < E; ++i) {
      const double c = xr[i] - mean;
      squares += c * c;
    }
    const float inv = static_cast<float>(1.0 / std::sqrt(squares / E + eps));
    for (int64_t i = 0; i < E; ++i) {
      const float v = static_cast<float>(xr[i] - mean) * inv;
      yr[i] = (w ? v * w[i] : v) + (b ? b[i] : 0.0f);
    }
  }
}

inline float activated(float v, int activation) {
  switch (activation) {
    case kGeluErf: return 0.5f * v * (1.0f + std::erf(v * 0.70710678118654752f));
    case kGeluTanh: {
      const float inner = 0.79788456080286536f * (v + 0.044715f * v * v * v);
      return 0.5f * v * (1.0f + std::tanh(inner));
    }
    case kSilu: return v / (1.0f + std::exp(-v));
    default: return v > 0.0f ? v : 0.0f;
  }
}

// x (D) rotated in place by cos, sin (D / 2): pairs (i, i + D/2), or (2i, 2i + 1) interleaved
inline void rotated(float* x, int64_t D, const float* cos, const float* sin, bool interleaved) {
  const int64_t half = D / 2;
  for (int64_t i = 0; i < half; ++i) {
    const int64_t a_at = interleaved ? 2 * i : i, c_at = interleaved ? 2 * i + 1 : i + half;
    const float a = x[a_at], c = x[c_at];
    x[a_at] = a * cos[i] - c * sin[i];
    x[c_at] = c * cos[i] + a * sin[i];
  }
}

// out (B, H, Dv) = softmax(q . K^T * scale) V for each row's one query over S cached keys;
// keys (B, H_kv, cap, D), values (B, H_kv, cap, Dv) of one layer
inline void attended(const float* q, int64_t B, int64_t H, int64_t H_kv, int64_t D, int64_t Dv,
                     const float* keys, const float* values, int64_t cap, int64_t S, float scale,
                     float* out) {
  const int64_t group = H / H_kv;
  at::parallel_for(0, B * H, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> p(S);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b = t / H, h = t % H, g = h / group;
      const float* qh = q + (b * H + h) * D;
      const float* k = keys + ((b * H_kv + g) * cap) * D;
      const float* v = values + ((b * H_kv + g) * cap) * Dv;
      float top = -INFINITY;
      for (int64_t s = 0; s < S; ++s) {
        float dot = 0.0f;
        for (int64_t i = 0; i < D; ++i) dot += qh[i] * k[s * D + i];
        p[s] = dot * scale;
        top = std::max(top, p[s]);
      }
      float total = 0.0f;
      for (int64_t s = 0; s < S; ++s) total += (p[s] = std::exp(p[s] - top));
      float* o = out + (b * H + h) * Dv;
      for (int64_t i = 0; i < Dv; ++i) o[i] = 0.0f;
      for (int64_t s = 0; s < S; ++s) {
        const float w = p[s] / total;
        for (int64_t i = 0; i < Dv; ++i) o[i] += w * v[s * Dv + i];
      }
    }
  });
}

// x (B, E) float32 after every layer. layers: kLayerParts tensors per layer; keys/values
// (layers, B, H_kv, cap, D|Dv) with the new token going to slot `start` of every row;
// cos/sin (B, D/2) or empty (no rotary).
at::Tensor native_step(at::Tensor x, std::vector<at::Tensor> layers, at::Tensor keys,
                        at::Tensor values, int64_t start, at::Tensor cos, at::Tensor sin,
                        bool interleaved, int64_t H, int64_t H_kv, double scale, int64_t norm,
                        double eps, int64_t activation, bool gated) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "x must be contiguous float32 (B, E)");
  TORCH_CHECK(layers.size() % kLayerParts == 0, "layer tensors must come in groups");
  TORCH_CHECK(keys.is_contiguous() && values.is_contiguous() &&
                  keys.scalar_type() == at::kFloat && values.scalar_type() == at::kFloat,
              "the cache must be contiguous float32");
  const int64_t n_layers = static_cast<int64_t>(layers.size()) / kLayerParts;
  const int64_t B = x.size(0), E = x.size(1), cap = keys.size(3), D = keys.size(4);
  const int64_t Dv = values.size(4), S = start + 1;
  TORCH_CHECK(keys.size(0) == n_layers && keys.size(1) == B && keys.size(2) == H_kv &&
                  start >= 0 && start < cap,
              "the cache must be (layers, B, H_kv, capacity > start, D)");
  TORCH_CHECK(B <= kMaxRows, "a native step takes at most 16 rows");
  const bool rotary = cos.numel() > 0;
  const float* cs = rotary ? cos.data_ptr<float>() : nullptr;
  const float* sn = rotary ? sin.data_ptr<float>() : nullptr;
  at::Tensor h = x.clone();
  float* hx = h.data_ptr<float>();
  const int64_t qkv_width = H * D + H_kv * D + H_kv * Dv;
  std::vector<float> normed_x(B * E), qkv(B * qkv_width), att(B * H * Dv), delta(B * E);
  std::vector<float> q(B * H * D);
  float* kc = keys.data_ptr<float>();
  float* vc = values.data_ptr<float>();
  for (int64_t l = 0; l < n_layers; ++l) {
    const at::Tensor* t = layers.data() + l * kLayerParts;
    normed(hx, B, E, static_cast<int>(norm), static_cast<float>(eps),
           floats_or_null(t[kNorm1W]), floats_or_null(t[kNorm1B]), normed_x.data());
    products(normed_x.data(), B, E, {t + kQW, t + kKW, t + kVW}, qkv.data(), qkv_width);
    float* lk = kc + l * B * H_kv * cap * D;
    float* lv = vc + l * B * H_kv * cap * Dv;
    for (int64_t b = 0; b < B; ++b) {
      const float* row = qkv.data() + b * qkv_width;
      const float* c = rotary ? cs + b * (D / 2) : nullptr;
      const float* s = rotary ? sn + b * (D / 2) : nullptr;
      for (int64_t hh = 0; hh < H; ++hh) {
        float* qh = q.data() + (b * H + hh) * D;
        std::memcpy(qh, row + hh * D, D * sizeof(float));
        if (rotary) rotated(qh, D, c, s, interleaved);
      }
      for (int64_t g = 0; g < H_kv; ++g) {
        float* kslot = lk + ((b * H_kv + g) * cap + start) * D;
        std::memcpy(kslot, row + H * D + g * D, D * sizeof(float));
        if (rotary) rotated(kslot, D, c, s, interleaved);
        float* vslot = lv + ((b * H_kv + g) * cap + start) * Dv;
        std::memcpy(vslot, row + H * D + H_kv * D + g * Dv, Dv * sizeof(float));
      }
    }
    attended(q.data(), B, H, H_kv, D, Dv, lk, lv, cap, S, static_cast<float>(scale), att.data());
    products(att.data(), B, H * Dv, {t + kOW}, delta.data(), E);
    for (int64_t i = 0; i < B * E; ++i) hx[i] += delta[i];
    normed(hx, B, E, static_cast<int>(norm), static_cast<float>(eps),
           floats_or_null(t[kNorm2W]), floats_or_null(t[kNorm2B]), normed_x.data());
    const int64_t hidden = t[kUpW].size(0);
    std::vector<float> inner(B * hidden * (gated ? 2 : 1));
    if (gated) {
      products(normed_x.data(), B, E, {t + kGateW, t + kUpW}, inner.data(), 2 * hidden);
      for (int64_t b = 0; b < B; ++b) {
        float* row = inner.data() + b * 2 * hidden;
        float* packed = inner.data() + b * hidden;  // row b's gate * up, packed in place
        for (int64_t i = 0; i < hidden; ++i) {
          const float gate = activated(row[i], static_cast<int>(activation));
          packed[i] = gate * row[hidden + i];
        }
      }
    } else {
      products(normed_x.data(), B, E, {t + kUpW}, inner.data(), hidden);
      for (int64_t i = 0; i < B * hidden; ++i)
        inner[i] = activated(inner[i], static_cast<int>(activation));
    }
    products(inner.data(), B, hidden, {t + kDownW}, delta.data(), E);
    for (int64_t i = 0; i < B * E; ++i) hx[i] += delta[i];
  }
  return h;
}
