// What the fused kernel learns about the machine at run time: the block products' rate and
// peak, whether bf16 inputs run their products in bf16 here, and how many threads a parallel
// loop reaches.

#pragma once

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <ctime>
#include <exception>
#include <type_traits>
#include <vector>

#include "../simd.h"
#include "plan.h"
#include "products.h"

namespace {

// The block products' own rate, in FLOP per second of the clock given: the forward's block
// shapes (scores [kRows, kKeys] = Q [kRows, d] K^T, then acc [kRows, d] += P V), operands in
// cache, in float32 or with bf16 operands, for `seconds` on the calling thread.
template <typename E, typename Clock>
double block_rate_here(int64_t d, double seconds, Clock now) {
  const int64_t d2 = (d + 1) / 2 * 2;
  std::vector<E> q(kRows * d2, E(0.5f)), kt(d2 * kKeys, E(0.25f)), p(kRows * kKeys),
      v(kKeys * d2, E(0.125f));
  std::vector<float> s(kRows * kKeys), acc(kRows * d2, 0.0f);
  const double start = now();
  double done = 0, elapsed = 0;
  while (elapsed < seconds) {
    if constexpr (std::is_same_v<E, float>) {
      block_gemm(kRows, kKeys, d2, q.data(), d2, kt.data(), kKeys, false, s.data(), kKeys);
      block_gemm(kRows, d2, kKeys, s.data(), kKeys, v.data(), d2, true, acc.data(), d2);
    } else {
      block_gemm_vnni(kRows, kKeys, d2, q.data(), d2, kt.data(), kKeys, false, s.data(), kKeys);
      to_bf16(p.data(), s.data(), kRows * kKeys);
      block_gemm_vnni(kRows, d2, kKeys, p.data(), kKeys, v.data(), d2, true, acc.data(), d2);
    }
    done += 4.0 * kRows * kKeys * d2;
    elapsed = now() - start;
  }
  return done / elapsed;
}

double wall_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Whether torch's bf16 microkernel runs here at all: on x86 it needs AMX or AVX512-BF16, and
// torch raises (rather than falls back) on a CPU without them, so one tiny product is tried
// once per process and an error read as "no".
bool half_available() {
#ifdef MULTIHEAD_BRGEMM
  static const bool runs = [] {
#if defined(__x86_64__)
    if (!at::native::cpublas::could_pack(at::kBFloat16) && !__builtin_cpu_supports("avx512bf16"))
      return false;
#endif
    try {
      std::vector<at::BFloat16> a(2 * 2, at::BFloat16(1.0f)), b(2 * 16, at::BFloat16(1.0f));
      std::vector<float> c(2 * 16, 0.0f);
      block_gemm_vnni(2, 16, 2, a.data(), 2, b.data(), 16, false, c.data(), 16);
      return c[0] == 2.0f;
    } catch (const std::exception&) {
      return false;
    }
  }();
  return runs;
#else
  return false;
#endif
}

// The block products' peak: GFLOP/s on every thread at once (wall clock), in float32 or
// with bf16 operands (0 where the bf16 microkernel does not run here: half_available). What the kernel's time is best compared with: on some CPUs torch's own
// float32 matmul runs well below it.
double block_peak(int64_t d, double seconds, bool bf16) {
  if (bf16 && !half_available()) return 0.0;
  const int64_t threads = at::get_num_threads();
  std::vector<double> rates(threads, 0.0);
  at::parallel_for(0, threads, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) {
#ifdef MULTIHEAD_BRGEMM
      if (bf16) {
        rates[t] = block_rate_here<at::BFloat16>(d, seconds, wall_seconds);
        continue;
      }
#endif
      rates[t] = block_rate_here<float>(d, seconds, wall_seconds);
    }
  });
  double total = 0;
  for (const double r : rates) total += r;
  return total / 1e9;
}

// Whether bf16 inputs run their block products in bf16: where the bf16 microkernel is at least
// 1.25x the float one on this machine (CPUs with AVX512-BF16 or AMX), timed once per process
// on the calling thread in its own CPU time (a busy machine does not change the answer), a
// few milliseconds. Elsewhere bf16 inputs are widened to float once per call, which keeps the
// 2x error rule as well and runs at the float speed.
bool half_products() {
#ifdef MULTIHEAD_BRGEMM
  static const bool faster = [] {
    if (!half_available()) return false;
    const auto cpu_seconds = [] {
      timespec t{};
      clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
      return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
    };
    double wide = 0, half = 0;
    for (int round = 0; round < 3; ++round) {
      wide = std::max(wide, block_rate_here<float>(64, 0.003, cpu_seconds));
      half = std::max(half, block_rate_here<at::BFloat16>(64, 0.003, cpu_seconds));
    }
    return half >= 1.25 * wide;
  }();
  return faster;
#else
  return false;
#endif
}

// How many of torch's intra-op threads one parallel loop of the kernel reaches, over `tasks`
// tasks (a check of the build: without OpenMP, at::parallel_for runs on the calling thread).
int64_t parallel_threads(int64_t tasks) {
  std::vector<int> seen(std::max<int64_t>(tasks, 0), -1);
  at::parallel_for(0, tasks, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) seen[t] = at::get_thread_num();
  });
  std::sort(seen.begin(), seen.end());
  return std::unique(seen.begin(), seen.end()) - seen.begin();
}

}  // namespace
