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
// Work: a task takes a few rows and walks the keys a tile at a time: the tile's u (a few keys'
// H x E) is read from memory once for all of the task's rows, and each row reads its weights
// over the tile in order. The sums over heads are 16-lane vectors (simd.h).

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
constexpr int64_t kAltiKeys = 8;   // keys of one tile: their u (8 x H x E) stays in L2

// sum_e |y[e] - s (sum_h a[h] u[h, e] + x[e])| (x may be null): 64 elements of E at a time in
// four 16-lane registers summed over the heads, the rest one by one
inline double distance(const float* a, const float* u, const float* y, const float* x,
                       float s, int64_t H, int64_t E) {
  auto load16 = [](const float* p) {
    VF16 v;
    std::memcpy(&v, p, sizeof(VF16));
    return v;
  };
  auto magnitude = [](VF16 v) { return v < 0 ? -v : v; };
  VF16 sums = {};
  const int64_t whole = E - E % 64;
  for (int64_t e0 = 0; e0 < whole; e0 += 64) {
    VF16 t0 = {}, t1 = {}, t2 = {}, t3 = {};
    for (int64_t h = 0; h < H; ++h) {
      const VF16 w = VF16{} + a[h];
      const float* uh = u + h * E + e0;
      t0 = mul_add(w, load16(uh), t0);
      t1 = mul_add(w, load16(uh + 16), t1);
      t2 = mul_add(w, load16(uh + 32), t2);
      t3 = mul_add(w, load16(uh + 48), t3);
    }
    if (x != nullptr) {
      t0 += load16(x + e0), t1 += load16(x + e0 + 16);
      t2 += load16(x + e0 + 32), t3 += load16(x + e0 + 48);
    }
    sums += magnitude(load16(y + e0) - s * t0) + magnitude(load16(y + e0 + 16) - s * t1) +
            magnitude(load16(y + e0 + 32) - s * t2) + magnitude(load16(y + e0 + 48) - s * t3);
  }
  double total = 0.0;
  for (int l = 0; l < 16; ++l) total += sums[l];
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
      for (int64_t j0 = 0; j0 < last; j0 += kAltiKeys) {  // a tile of keys, its u in cache
        const int64_t j1 = std::min(last, j0 + kAltiKeys);
        for (int64_t r = r0; r < r1; ++r) {
          const float* yr = Y + r * E;
          const float* xr = X + r * E;
          const float sc = C[r];
          for (int64_t j = j0; j < j1; ++j) {
            float* out = D + r * S + j;
            if (causal && j > row0 + r) {  // a later key: no contribution at all
              *out = std::numeric_limits<float>::infinity();
              continue;
            }
            const float* a = A + (r * S + j) * H;  // the row's weights: read in order
            const bool own = j == row0 + r;
            *out = static_cast<float>(
                distance(a, U + j * H * E, yr, own ? xr : nullptr, sc, H, E));
          }
        }
      }
      for (int64_t r = r0; r < r1; ++r)  // keys no row of the task sees
        for (int64_t j = last; j < S; ++j) D[r * S + j] = std::numeric_limits<float>::infinity();
    }
  });
  return d;
}

}  // namespace
