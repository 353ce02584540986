// The work list the kernel walks (made in Python from the mask's tile answers: fused.py's
// _flatten), the block sizes, and the tasks it is cut into.

#pragma once

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

// Block sizes: 256 query rows by 512 keys. The scores of a block (512 KiB in float32) stay in
// L2, and every online-softmax update and block product covers 512 keys at once, so the
// per-block work (the GEMM calls, each row's rescaling) is spread over many scores. Forward
// tasks get fewer rows (down to kMinRows) when 256-row tasks would leave threads idle.
constexpr int64_t kRows = 256;  // query rows per task and per backward block
constexpr int64_t kMinRows = 64;
constexpr int64_t kKeys = 512;  // keys per block
constexpr int64_t kDecodeRows = 16;  // L up to this is decoding: keys read in place, split

struct Plan {
  const int64_t* items;   // [n, 6]: b0, b1, q0, q1, first chunk, end chunk (b0 = -1: all)
  int64_t n_items;
  const int64_t* chunks;  // [m, 6]: k0, k1, keep offset (-1: fully visible), keep strides b, h, row
  const uint8_t* keep;    // every keep block, flattened
  int64_t n_chunks;
};

Plan make_plan(const at::Tensor& items, const at::Tensor& chunks, const at::Tensor& keep) {
  TORCH_CHECK(items.dtype() == at::kLong && items.is_contiguous() && items.size(1) == 6);
  TORCH_CHECK(chunks.dtype() == at::kLong && chunks.is_contiguous() && chunks.size(1) == 6);
  TORCH_CHECK(keep.dtype() == at::kBool && keep.is_contiguous());
  return Plan{items.data_ptr<int64_t>(), items.size(0), chunks.data_ptr<int64_t>(),
              reinterpret_cast<const uint8_t*>(keep.data_ptr<bool>()), chunks.size(0)};
}

// Which blocks of kKeys keys some chunk of the plan reads (one flag per block, for every batch
// entry and head alike). The others are never read, so they are neither packed nor checked: a
// call whose rows see a few keys of a long sequence (a window's rows, auto's proxy of a call)
// prepares only those.
std::vector<uint8_t> read_blocks(const Plan& plan, int64_t S) {
  std::vector<uint8_t> read((S + kKeys - 1) / kKeys, 0);
  for (int64_t c = 0; c < plan.n_chunks; ++c) {
    const int64_t k0 = plan.chunks[6 * c], k1 = std::min(plan.chunks[6 * c + 1], S);
    if (k1 > k0) std::fill(read.begin() + k0 / kKeys, read.begin() + (k1 - 1) / kKeys + 1, 1);
  }
  return read;
}

inline bool unread(const std::vector<uint8_t>* read, int64_t block) {
  return read != nullptr && !(*read)[block];
}

// The end of the key block starting at kb: the next multiple of kKeys, or the chunk's end.
inline int64_t next_block(int64_t kb, int64_t stop) {
  return std::min(stop, (kb / kKeys + 1) * kKeys);
}

// A query-row block of one item, for one batch entry and one head.
struct Task {
  int64_t item, b, h, r0, r1;
};

// Query rows per forward task: kRows, halved (down to kMinRows) while there would be fewer
// than four tasks per thread. Depends on the plan and the thread count only.
int64_t task_rows(const Plan& plan, int64_t batch, int64_t heads, int64_t threads) {
  int64_t rows = kRows;
  for (; rows > kMinRows; rows /= 2) {
    int64_t count = 0;
    for (int64_t n = 0; n < plan.n_items; ++n) {
      const int64_t* it = plan.items + 6 * n;
      const int64_t batches = it[0] < 0 ? batch : it[1] - it[0];
      count += batches * heads * ((it[3] - it[2] + rows - 1) / rows);
    }
    if (count >= 4 * threads) break;
  }
  return rows;
}

std::vector<Task> forward_tasks(const Plan& plan, int64_t batch, int64_t heads, int64_t rows) {
  std::vector<Task> tasks;
  for (int64_t n = 0; n < plan.n_items; ++n) {
    const int64_t* it = plan.items + 6 * n;
    const int64_t b0 = it[0] < 0 ? 0 : it[0], b1 = it[0] < 0 ? batch : it[1];
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t h = 0; h < heads; ++h)
        for (int64_t r = it[2]; r < it[3]; r += rows)
          tasks.push_back({n, b, h, r, std::min(r + rows, it[3])});
  }
  return tasks;
}

int64_t key_blocks(const Plan& plan, const Task& task) {
  const int64_t* it = plan.items + 6 * task.item;
  int64_t count = 0;
  for (int64_t c = it[4]; c < it[5]; ++c) {
    const int64_t* ch = plan.chunks + 6 * c;
    for (int64_t kb = ch[0]; kb < ch[1]; kb = next_block(kb, ch[1])) ++count;
  }
  return count;
}

// Per key block of one task: where the keep bits start, or null when every key is visible.
// Returns false when no (row, key) pair of the block is visible (the block is skipped).
inline bool keep_block(const Plan& plan, const int64_t* ch, int64_t b_rel, int64_t h,
                       int64_t row0, int64_t rows, int64_t k_rel, int64_t cols,
                       const uint8_t** out, int64_t* row_stride) {
  *out = nullptr;
  if (ch[2] < 0) return true;
  const uint8_t* p = plan.keep + ch[2] + b_rel * ch[3] + h * ch[4] + row0 * ch[5] + k_rel;
  bool any = false, all = true;
  for (int64_t i = 0; i < rows; ++i) {
    const uint8_t* r = p + i * ch[5];
    int64_t seen = 0;
    for (int64_t j = 0; j < cols; ++j) seen += r[j];
    any |= seen > 0;
    all &= seen == cols;
  }
  if (!all) *out = p;
  *row_stride = ch[5];
  return any;
}

// Query rows per weights task: the forward's, halved (down to kMinRows / 4) until the rows'
// scores over the widest item's key span fit `budget` bytes (kScratchBytes for the weights;
// the statistics keep to the plain forward's scores block, so that asking for them adds
// only their own size to the memory a forward holds).
constexpr int64_t kScratchBytes = int64_t(1) << 20;

int64_t weight_rows(const Plan& plan, int64_t rows, int64_t elem,
                    int64_t budget = kScratchBytes) {
  int64_t span = 1;
  for (int64_t n = 0; n < plan.n_items; ++n) {
    const int64_t* it = plan.items + 6 * n;
    if (it[5] > it[4])
      span = std::max(span, plan.chunks[6 * (it[5] - 1) + 1] - plan.chunks[6 * it[4]]);
  }
  while (rows > kMinRows / 4 && rows * span * elem > budget) rows /= 2;
  return rows;
}

}  // namespace
