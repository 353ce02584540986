// The fused kernel's entry points, tensors in and out: forward, forward_stats and backward.

#pragma once

#include <ATen/Dispatch.h>
#include <ATen/TensorOperators.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/isfinite.h>
#include <ATen/ops/scalar_tensor.h>
#include <ATen/ops/where.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "backward.h"
#include "buffers.h"
#include "calibration.h"
#include "forward.h"
#include "inputs.h"
#include "plan.h"
#include "softmax.h"
#include "stats.h"
#include "weights.h"

namespace {

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

}  // namespace
