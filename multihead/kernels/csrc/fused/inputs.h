// q, k and v as the fused kernel reads them (Inputs), and a task's block products over them:
// the scores of a block of query rows against a key block, and the weights times the values.

#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <tuple>
#include <type_traits>
#include <vector>

#include "../simd.h"
#include "buffers.h"
#include "few_rows.h"
#include "nonfinite.h"
#include "plan.h"
#include "products.h"

namespace {

// q, k and v as the kernel reads them. T is the arithmetic type (float, double); E the
// storage of q, k and v: T itself (keys, and for the backward pass values, transposed block
// by block: the score GEMMs read them as row-major B operands along
// the keys, and rows S apart would alias in L1 when S is a multiple of 1024), or bf16 with
// float arithmetic (the half-precision block products: keys and values packed for the bf16
// microkernel, the scale applied to the float scores). Key blocks never cross a multiple of
// kKeys (see next_block, plan.h), so each lies inside one packed block.
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

}  // namespace
