// What turns a block's raw scores into softmax weights, row by row: the terms that finish a
// score (soft cap, additive terms, keep bits), the row maxima, the exps and their sums, and
// the normalized output and log-sum-exp of a task's rows (sinks joining the denominator).

#pragma once

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "../simd.h"
#include "inputs.h"
#include "math.h"
#include "plan.h"

namespace {

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

// x[j] = exp(x[j] - shift) in place; returns the sum. With `moment`, also
// *moment = sum_j x[j] (x[j] - shift) over the entries that stay above 0 (a row's entropy,
// see attend_stats in stats.h): hidden keys (-inf) add nothing.
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

// x[j] *= factor
template <typename T>
void scale_row(T* x, int64_t n, T factor) {
  for (int64_t j = 0; j < n; ++j) x[j] *= factor;
}

}  // namespace
