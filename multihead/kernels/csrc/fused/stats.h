// The forward with softmax statistics of chosen heads instead of their weights (stats.py's
// attention_stats): key mass, window mass, entropy and the heads' mean, each summed in a fixed
// order.

#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "forward.h"
#include "inputs.h"
#include "plan.h"
#include "softmax.h"
#include "weights.h"

namespace {

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

}  // namespace
