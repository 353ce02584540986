// ALTI's Manhattan distances (Ferrando et al. 2022) for a block of query rows, without the
// (rows, keys, E) tensor of every key's contribution to every row: multihead.inspect.
// contributions.alti_matrix hands the block here.
//
// For query row i (at position row0 + r) and key j the contribution of j to i is
//   T'_ij = s_i (sum_h alpha[r, j, h] u[j, h, :] + [i == j] x[r, :])
// (u: each head's value of key j through its slice of the output projection, with a norm's
// linear map applied; x: the residual of the row, the same; s_i: the row's norm scale, 1 for
// a pre-norm layer), and the kernel writes d[r, j] = sum_e |y[r, e] - T'_ij[e]|. A causal
// block stops each row at its own position: a later key gets d = inf (it contributes nothing,
// which |y|_1 computed in another order would not say exactly).
//
// Work: a task takes a few rows and walks the keys one at a time: the key's u (H x E floats)
// is read from memory once for all of the task's rows and stays in L1 while they use it
// (a tile of several keys' u would live in L2 instead). The sums over heads are in the CPU's
// own vectors, their magnitudes added in 16 lanes (distance below).

#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include "../simd.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <cstdint>

namespace {

constexpr int64_t kAltiRows = 32;  // rows of one task: they share each key's u_j

// sum_e |y[e] - s (sum_h a[h] u[h, e] + x[e])| (x may be null): 64 elements of E at a time,
// held in the CPU's own vectors (a vector wider than the CPU's, as GCC lowers it, spills to the
// stack on every operation), summed over the heads; the magnitudes
// are added into 16 lanes in the order of the 16-lane sums the rows' products use, so the
// result's bits do not depend on the vector width; the rest of E one by one
inline double distance(const float* a, const float* u, const float* y, const float* x,
                       float s, int64_t H, int64_t E) {
  constexpr int kParts = 64 / kLanes;  // native vectors per 64 elements
  constexpr int kSum = 16 / kLanes;    // native vectors per 16 lanes
  auto magnitude = [](VF v) { return v < 0 ? -v : v; };
  VF sums[kSum] = {};
  const VF scale = VF{} + s;
  const int64_t whole = E - E % 64;
  for (int64_t e0 = 0; e0 < whole; e0 += 64) {
    VF t[kParts] = {};
    for (int64_t h = 0; h < H; ++h) {
      const VF w = VF{} + a[h];
      const float* uh = u + h * E + e0;
      for (int p = 0; p < kParts; ++p) t[p] = t[p] + w * load(uh + p * kLanes);
    }
    if (x != nullptr)
      for (int p = 0; p < kParts; ++p) t[p] += load(x + e0 + p * kLanes);
    for (int q = 0; q < kSum; ++q) {  // lanes 16 k + q kLanes.. of the four 16-lane groups
      VF m = magnitude(load(y + e0 + q * kLanes) - scale * t[q]);
      for (int k = 1; k < 4; ++k)
        m += magnitude(load(y + e0 + 16 * k + q * kLanes) - scale * t[k * kSum + q]);
      sums[q] += m;
    }
  }
  double total = 0.0;
  for (int q = 0; q < kSum; ++q)
    for (int l = 0; l < kLanes; ++l) total += sums[q][l];
  for (int64_t e = whole; e < E; ++e) {
    float t = x != nullptr ? x[e] : 0.f;
    for (int64_t h = 0; h < H; ++h) t += a[h] * u[h * E + e];
    total += std::fabs(y[e] - s * t);
  }
  return total;
}

// alpha (n, S, H), u (S, H, E), y (n, E), x (n, E), scale (n): float32, contiguous
// -> d (n, S) float32
at::Tensor alti_distances(const at::Tensor& alpha, const at::Tensor& u, const at::Tensor& y,
                          const at::Tensor& x, const at::Tensor& scale, int64_t row0,
                          bool causal) {
  TORCH_CHECK(alpha.dim() == 3 && u.dim() == 3 && y.dim() == 2 && x.dim() == 2,
              "alti_distances: alpha (n, S, H), u (S, H, E), y and x (n, E)");
  TORCH_CHECK(alpha.scalar_type() == at::kFloat && u.scalar_type() == at::kFloat &&
                  y.scalar_type() == at::kFloat && x.scalar_type() == at::kFloat &&
                  scale.scalar_type() == at::kFloat,
              "alti_distances takes float32 tensors");
  TORCH_CHECK(alpha.is_contiguous() && u.is_contiguous() && y.is_contiguous() &&
                  x.is_contiguous() && scale.is_contiguous(),
              "alti_distances takes contiguous tensors");
  const int64_t n = alpha.size(0), S = alpha.size(1), H = alpha.size(2), E = u.size(2);
  TORCH_CHECK(u.size(0) == S && u.size(1) == H && y.size(0) == n && y.size(1) == E &&
                  x.size(0) == n && x.size(1) == E && scale.numel() == n,
              "alti_distances: the shapes do not agree");
  at::Tensor d = at::empty({n, S}, alpha.options());
  const float* A = alpha.data_ptr<float>();
  const float* U = u.data_ptr<float>();
  const float* Y = y.data_ptr<float>();
  const float* X = x.data_ptr<float>();
  const float* C = scale.data_ptr<float>();
  float* D = d.data_ptr<float>();
  const int64_t tasks = (n + kAltiRows - 1) / kAltiRows;
  at::parallel_for(0, tasks, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t task = lo; task < hi; ++task) {
      const int64_t r0 = task * kAltiRows, r1 = std::min(n, r0 + kAltiRows);
      const int64_t last = causal ? std::min(S, row0 + r1) : S;  // keys any row of it sees
      for (int64_t j = 0; j < last; ++j) {  // one key at a time, its u (H x E) in L1
        const float* uj = U + j * H * E;
        for (int64_t r = r0; r < r1; ++r) {
          float* out = D + r * S + j;
          if (causal && j > row0 + r) {  // a later key: no contribution at all
            *out = std::numeric_limits<float>::infinity();
            continue;
          }
          const bool own = j == row0 + r;
          *out = static_cast<float>(distance(A + (r * S + j) * H, uj, Y + r * E,
                                             own ? X + r * E : nullptr, C[r], H, E));
        }
      }
      for (int64_t r = r0; r < r1; ++r)  // keys no row of the task sees
        for (int64_t j = last; j < S; ++j) D[r * S + j] = std::numeric_limits<float>::infinity();
    }
  });
  return d;
}

}  // namespace
