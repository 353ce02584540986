// The fused kernel's memory: large buffers from a pool of huge-page mappings, and keys and
// values copied into the layouts the block products read (transposed per key block, or packed
// in pairs for the bf16 microkernel), checked for NaN and inf in the same pass.

#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <tuple>
#include <utility>
#include <vector>
#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "nonfinite.h"
#include "plan.h"
#include "products.h"

namespace {

#if defined(__linux__) && defined(MADV_HUGEPAGE)
// Whether a mapping marked for transparent huge pages is faster to touch first than one of small
// pages on this machine: timed once per process on 16 MiB each way (in some virtual machines a
// huge page's first touch costs several times the small pages it replaces).
inline double first_touch_seconds(bool huge) {
  constexpr size_t kBytes = size_t(16) << 20, kAlign = size_t(1) << 21;
  void* raw = mmap(nullptr, kBytes + kAlign, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
                   -1, 0);
  if (raw == MAP_FAILED) return 0.0;
  char* start = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(raw) + kAlign - 1) &
                                        ~uintptr_t(kAlign - 1));
  if (huge) madvise(start, kBytes, MADV_HUGEPAGE);
  const auto t0 = std::chrono::steady_clock::now();
  std::memset(start, 1, kBytes);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  munmap(raw, kBytes + kAlign);
  return seconds;
}

inline bool huge_pages_pay() {
  static const bool pays = [] {
    first_touch_seconds(false);  // the first mapping of a process pays for more than its pages
    return first_touch_seconds(true) < first_touch_seconds(false);
  }();
  return pays;
}

// Large buffers (the weights, the output, packed keys and values, gradients) live in mappings
// of their own, marked for transparent huge pages where that makes a first touch faster
// (huge_pages_pay), so a first touch faults in 2 MiB instead of 4 KiB: allocations this large
// come fresh from the system at every call otherwise, and faulting in the weights of a long
// input 4 KiB at a time can cost more than computing them. A freed mapping waits in a small
// pool (at most kPoolEntries, kPoolBytes in all) for the next buffer of about its size, which
// then skips the system's zeroing of new pages too: calls of one shape, as a model's layers
// make them, reuse each other's memory. A full pool makes room for the newest buffer by
// unmapping its oldest ones: the shapes a process uses now are the ones it asks for next (a
// pool that kept its first buffers would serve none of a later shape).
class LargeBuffers {
 public:
  static constexpr size_t kHuge = size_t(1) << 21;
  static constexpr size_t kPoolBytes = size_t(1) << 30;
  static constexpr size_t kPoolEntries = 8;

  // a huge-page-aligned mapping of at least `bytes` (its length in *length), or null
  void* take(size_t bytes, size_t* length) {
    const size_t need = (bytes + kHuge - 1) / kHuge * kHuge;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto best = free_.end();
      for (auto it = free_.begin(); it != free_.end(); ++it)
        if (it->second >= need && it->second <= 2 * need &&
            (best == free_.end() || it->second < best->second))
          best = it;
      if (best != free_.end()) {
        void* p = best->first;
        *length = best->second;
        held_ -= best->second;
        free_.erase(best);
        ++hits_;
        return p;
      }
      ++misses_;
    }
    // one huge page more than needed, then the unaligned ends unmapped
    void* raw = mmap(nullptr, need + kHuge, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
                     -1, 0);
    if (raw == MAP_FAILED) return nullptr;
    const uintptr_t at = reinterpret_cast<uintptr_t>(raw);
    const uintptr_t start = (at + kHuge - 1) & ~uintptr_t(kHuge - 1);
    if (start > at) munmap(raw, start - at);
    if (start + need < at + need + kHuge)
      munmap(reinterpret_cast<void*>(start + need), at + need + kHuge - (start + need));
    if (huge_pages_pay()) madvise(reinterpret_cast<void*>(start), need, MADV_HUGEPAGE);
    *length = need;
    return reinterpret_cast<void*>(start);
  }

  void give(void* p, size_t length) {
    std::vector<std::pair<void*, size_t>> evicted;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (length <= kPoolBytes) {
        // free_ is in the order buffers came back: the oldest first
        while (!free_.empty() && (free_.size() >= kPoolEntries || held_ + length > kPoolBytes)) {
          evicted.push_back(free_.front());
          held_ -= free_.front().second;
          free_.erase(free_.begin());
        }
        free_.emplace_back(p, length);
        held_ += length;
        p = nullptr;
      }
    }
    for (const auto& e : evicted) munmap(e.first, e.second);
    if (p != nullptr) munmap(p, length);
  }

  // (buffers waiting, their bytes, takes served from the pool, takes that mapped new memory)
  std::tuple<int64_t, int64_t, int64_t, int64_t> stats() {
    std::lock_guard<std::mutex> lock(mutex_);
    return {int64_t(free_.size()), int64_t(held_), hits_, misses_};
  }

 private:
  std::mutex mutex_;
  std::vector<std::pair<void*, size_t>> free_;
  size_t held_ = 0;
  int64_t hits_ = 0, misses_ = 0;
};

// never destroyed: tensors freed while the process exits still return their buffers
LargeBuffers& large_buffers() {
  static LargeBuffers* pool = new LargeBuffers();
  return *pool;
}
#endif

std::tuple<int64_t, int64_t, int64_t, int64_t> pool_stats() {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  return large_buffers().stats();
#else
  return {0, 0, 0, 0};
#endif
}

// A new tensor for a large buffer (see LargeBuffers); elsewhere, and for small buffers,
// at::empty. Its contents are undefined: every caller writes each entry.
at::Tensor empty_large(at::IntArrayRef sizes, const at::TensorOptions& options) {
  int64_t bytes = c10::elementSize(options.dtype().toScalarType());
  for (const int64_t s : sizes) bytes *= s;
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  if (bytes >= int64_t(4 * LargeBuffers::kHuge)) {
    size_t length = 0;
    void* p = large_buffers().take(static_cast<size_t>(bytes), &length);
    if (p != nullptr)
      return at::from_blob(
          p, sizes, [p, length](void*) { large_buffers().give(p, length); }, options);
  }
#endif
  return at::empty(sizes, options);
}

// [B, H_kv, S, d] -> [B, H_kv, ceil(S / kKeys), d, kKeys]: every block of kKeys keys transposed
// on its own (zero-padded), so a GEMM walking a block's columns reads rows kKeys apart. Rows S
// apart would alias in L1 when S is a multiple of 1024 (every row in the same few cache sets).
// One task per block, in parallel: the copy is a pass over every key, spread over the threads
// like the attention itself.
template <typename T>
at::Tensor blocked_transpose(const at::Tensor& x, const std::vector<uint8_t>* read = nullptr) {
  const int64_t B = x.size(0), H = x.size(1), S = x.size(2), d = x.size(3);
  const int64_t n = (S + kKeys - 1) / kKeys;
  at::Tensor out = empty_large({B, H, n, d, kKeys}, x.options());
  const T* src = x.data_ptr<T>();
  T* dst = out.data_ptr<T>();
  const int64_t sb = x.stride(0), sh = x.stride(1), sr = x.stride(2);
  at::parallel_for(0, B * H * n, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t u = lo; u < hi; ++u) {
      if (unread(read, u % n)) continue;
      const int64_t b = u / (H * n), h = (u / n) % H, blk = u % n;
      const int64_t j0 = blk * kKeys, cols = std::min(kKeys, S - j0);
      T* block = dst + u * d * kKeys;
      transpose(src + b * sb + h * sh + j0 * sr, cols, d, sr, block, kKeys);
      if (cols < kKeys)
        for (int64_t p = 0; p < d; ++p)
          std::fill(block + p * kKeys + cols, block + (p + 1) * kKeys, T(0));
    }
  });
  return out;
}

// Keys and values for the half-precision block products, packed in one pass over both (one
// task per block of kKeys keys, which packs its keys and values while they are in cache).
//
// Keys: [B, H_kv, blocks, D2 / 2, kKeys, 2] with D2 the head dim rounded up to even: each
// block of kKeys keys as the columns of K^T, pairs of consecutive dims interleaved (the VNNI
// form the bf16 microkernel reads), zero-padded. Where the head dim is even and every row
// starts on a 4-byte boundary, a pair of dims is one 32-bit unit and a block is a transpose of
// (keys x pairs) such units.
//
// Values: [B, H_kv, blocks, kKeys / 2, Dv, 2], pairs of consecutive keys interleaved (VNNI):
// entry c of a pair of rows is one 32-bit unit, the first row's bits low. Zero-padded.
// Non-finite values become 0 here: a row that may see one is flagged (the NaN rule runs it
// again), and a key next to a chunk's edge, read with a weight of 0 to keep the pairs aligned,
// must not turn that 0 into NaN. The test reads the bits (kExponentBits).
//
// With kflags and vflags, each block's flag (see block_flags) is set in the same pass.
template <typename E>
std::pair<at::Tensor, at::Tensor> pack_half(const at::Tensor& k, const at::Tensor& v,
                                            const std::vector<uint8_t>* read,
                                            std::vector<uint8_t>* kflags,
                                            std::vector<uint8_t>* vflags) {
  static_assert(sizeof(E) == 2, "pairs of 16-bit values");
  constexpr uint16_t exponent = kExponentBits<E>;
  const int64_t B = k.size(0), H = k.size(1), S = k.size(2), d = k.size(3), dv = v.size(3);
  const int64_t n = (S + kKeys - 1) / kKeys, pairs = (d + 1) / 2;
  at::Tensor kt = empty_large({B, H, n, pairs, kKeys, 2}, k.options());
  at::Tensor vt = empty_large({B, H, n, kKeys / 2, dv, 2}, v.options());
  if (kflags != nullptr) kflags->assign(B * H * n, 0), vflags->assign(B * H * n, 0);
  const E* ksrc = k.data_ptr<E>();
  const auto* vsrc = reinterpret_cast<const uint16_t*>(v.data_ptr<E>());
  E* kdst = kt.data_ptr<E>();
  auto* vdst = reinterpret_cast<uint32_t*>(vt.data_ptr<E>());
  const int64_t ksb = k.stride(0), ksh = k.stride(1), ksr = k.stride(2);
  const int64_t vsb = v.stride(0), vsh = v.stride(1), vsr = v.stride(2);
  const bool units = d % 2 == 0 && ksb % 2 == 0 && ksh % 2 == 0 && ksr % 2 == 0 &&
                     reinterpret_cast<uintptr_t>(ksrc) % 4 == 0;
  at::parallel_for(0, B * H * n, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t u = lo; u < hi; ++u) {
      if (unread(read, u % n)) continue;
      const int64_t b = u / (H * n), h = (u / n) % H, j0 = (u % n) * kKeys;
      const int64_t cols = std::min(kKeys, S - j0);
      // the keys
      E* block = kdst + u * pairs * kKeys * 2;
      const E* first = ksrc + b * ksb + h * ksh + j0 * ksr;
      if (units) {
        auto* out32 = reinterpret_cast<uint32_t*>(block);
        transpose(reinterpret_cast<const uint32_t*>(first), cols, pairs, ksr / 2, out32, kKeys);
        if (cols < kKeys)
          for (int64_t p = 0; p < pairs; ++p)
            std::fill(out32 + p * kKeys + cols, out32 + (p + 1) * kKeys, uint32_t(0));
      } else {
        for (int64_t j = 0; j < kKeys; ++j) {
          const E* row = first + j * ksr;
          const bool real = j < cols;
          for (int64_t p = 0; p < 2 * pairs; ++p)
            block[(p / 2) * kKeys * 2 + j * 2 + p % 2] = real && p < d ? row[p] : E(0);
        }
      }
      if (kflags != nullptr) (*kflags)[u] = any_nonfinite(first, cols, d, ksr);  // in cache
      // the values, a pair of rows at a time
      uint32_t* out = vdst + u * (kKeys / 2) * dv;
      const uint16_t* vfirst = vsrc + b * vsb + h * vsh + j0 * vsr;
      uint32_t seen = 0;  // any non-finite value
      for (int64_t j = 0; j < kKeys; j += 2, out += dv) {
        const uint16_t* r0 = vfirst + j * vsr;
        if (j + 1 < cols) {
          const uint16_t* r1 = r0 + vsr;
          for (int64_t c = 0; c < dv; ++c) {
            const uint32_t x0 = r0[c], x1 = r1[c];
            const bool bad0 = (x0 & exponent) == exponent, bad1 = (x1 & exponent) == exponent;
            seen |= bad0 | bad1;
            out[c] = (bad0 ? 0u : x0) | (bad1 ? 0u : x1 << 16);
          }
        } else if (j < cols) {
          for (int64_t c = 0; c < dv; ++c) {
            const uint32_t x0 = r0[c];
            const bool bad0 = (x0 & exponent) == exponent;
            seen |= bad0;
            out[c] = bad0 ? 0u : x0;
          }
        } else {
          std::fill(out, out + dv, 0u);
        }
      }
      if (vflags != nullptr) (*vflags)[u] = seen != 0;
    }
  });
  return {kt, vt};
}

// Per (batch entry, key/value head, block of kKeys keys): whether the block holds NaN or +-inf
// anywhere. A task reading part of a flagged block checks its exact rows (keys past a mask's
// lengths may hold anything); unflagged blocks need no check of their own.
template <typename E>
std::vector<uint8_t> block_flags(const at::Tensor& x, const std::vector<uint8_t>* read = nullptr) {
  const int64_t B = x.size(0), H = x.size(1), S = x.size(2), d = x.size(3);
  const int64_t n = (S + kKeys - 1) / kKeys;
  std::vector<uint8_t> flags(B * H * n, 0);
  const E* src = x.data_ptr<E>();
  const int64_t sb = x.stride(0), sh = x.stride(1), sr = x.stride(2);
  at::parallel_for(0, B * H * n, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t u = lo; u < hi; ++u) {
      if (unread(read, u % n)) continue;
      const int64_t b = u / (H * n), h = (u / n) % H, j0 = (u % n) * kKeys;
      flags[u] = any_nonfinite(src + b * sb + h * sh + j0 * sr, std::min(kKeys, S - j0), d, sr);
    }
  });
  return flags;
}

}  // namespace
