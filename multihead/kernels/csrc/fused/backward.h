// The backward pass: dq, dk, dv and the gradients of the additive terms, recomputing each
// block's weights from the saved log-sum-exp.

#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "inputs.h"
#include "math.h"
#include "plan.h"
#include "products.h"
#include "softmax.h"

namespace {

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
                // the queries arrive scaled (see backward, entry.h): scores = Q K^T, dP = dO V^T
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

}  // namespace
