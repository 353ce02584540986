// The forward pass: out [B, H, L, Dv], lse [B, H, L] and, when asked, the weights
// [B, H, L, S]. A task's online softmax over its key blocks (attend), and the pass over every
// task on torch's pool, decoding's tasks split over the keys.

#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "inputs.h"
#include "math.h"
#include "nonfinite.h"
#include "plan.h"
#include "softmax.h"
#include "weights.h"

namespace {

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
  // plain (see scaled_row_max, softmax.h): a span's rows hold raw scores, the scale joins the exp
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

}  // namespace
