// The forward with its weights: a task's rows over their whole key span with their final
// maxima (attend_span, which the statistics use too), and each weight written once, in the
// caller's dtype, with stores that bypass the cache.

#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

#include "../simd.h"
#include "inputs.h"
#include "math.h"
#include "plan.h"
#include "softmax.h"

namespace {

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

}  // namespace
