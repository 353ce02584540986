// The fused CPU attention kernel behind backend="fused".
//
// The kernel only loops: Python hands it a work list built from the mask's own tile answers
// (query tiles, each with its key chunks and, for partly visible chunks, a small keep block),
// and it never knows which mask produced it. Per block of query rows it walks the key blocks
// of every chunk with an online softmax (FlashAttention's recipe): scores by one GEMM, each
// row finished in one vector pass (soft cap, additive terms, keep bits, maximum), exp and row
// sums in a second (which also applies the scale when there is neither cap nor terms, and
// writes the bf16 weights of a half-precision product directly), output by another GEMM; sink
// logits join each row's denominator at the end. Softmax statistics and accumulators are
// float32 (float64 for float64 inputs). bf16 inputs run their block products in bf16 where
// this CPU's bf16 microkernel is faster (half_products), else they are widened once per call;
// both keep the 2x error rule. Keys and values are packed for those products, and checked
// for NaN and inf, in one pass per block (pack_half). With
// weights, a task keeps its rows' scores over their key span in cache and writes every weight
// once (attend_weights).
//
// Work is spread over torch's intra-op pool (at::parallel_for), so torch.set_num_threads
// governs it. Every output row, and in the backward pass every key's gradient, is written by
// exactly one task in a fixed order: results are bitwise reproducible for a thread count.

// The kernel in rooms, each a header of this one translation unit (so the compiler inlines
// across them as within one file, and everything stays internal to it), each including the
// rooms it uses:
//
//   simd.h               vectors, their loads and stores, sums across lanes (shared with
//                        rows_linear.cpp)
//   fused/math.h         exp and tanh over vectors
//   fused/nonfinite.h    the NaN rule's scans
//   fused/few_rows.h     decoding's products, keys and values read in place
//   fused/products.h     the block products (torch's brgemm, a register-blocked loop)
//   fused/plan.h         the work list, the block sizes, the tasks
//   fused/buffers.h      the large-buffer pool; keys and values packed for the products
//   fused/inputs.h       q, k and v as the kernel reads them; a block's two products
//   fused/softmax.h      a row of scores finished, exponentiated and summed; rows normalized
//   fused/weights.h      a task's rows over their whole key span, the weights written once
//   fused/forward.h      the forward pass: a task's online softmax, the pass over all tasks
//   fused/stats.h        the forward with softmax statistics instead of weights
//   fused/backward.h     the backward pass
//   fused/calibration.h  what is timed or probed on this machine at run time
//   fused/entry.h        the entry points, tensors in and out
//   fused/contributions.h ALTI's distances for multihead.inspect (not attention itself)
//   this file            the bindings

// ATen's per-operator headers and torch's pybind casters rather than torch/extension.h, which
// pulls in the whole C++ frontend (autograd, nn, optim) and doubles the compile time
#include <torch/csrc/utils/pybind.h>

#include "fused/buffers.h"
#include "fused/calibration.h"
#include "fused/contributions.h"
#include "fused/entry.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("forward_stats", &forward_stats,
        "the forward with softmax statistics of chosen heads instead of their weights");
  m.def("block_peak", &block_peak, "GFLOP/s of the block products (float32 or bf16), all threads");
  m.def("half_products", &half_products, "whether bf16 inputs use bf16 block products here");
  m.def("half_available", &half_available, "whether torch's bf16 microkernel runs on this CPU");
  m.def("parallel_threads", &parallel_threads, "threads one parallel loop reaches");
  m.def("pool_stats", &pool_stats,
        "the large-buffer pool: (buffers waiting, their bytes, takes it served, takes it missed)");
  m.def("forward", &forward, "fused attention forward: (out, lse[, weights], saw non-finite)");
  m.def("backward", &backward, "fused attention backward: (dq, dk, dv, dbias, dtable)");
  m.def("alti_distances", &alti_distances,
        "ALTI's Manhattan distances of a block of query rows: (n, S)");
}
