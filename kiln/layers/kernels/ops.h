// The ATen side of kiln's kernel library: the checks the ops share and the ops one source calls
// in another (the one-call layers chain q4_linear, attend_rows, lora_add, kq_linear...; ops.cpp
// registers them). Included by the sources that take tensors (ops.cpp, layers.cpp, lora.cpp,
// kquant.cpp); the compute-only ones stop at kernels.h.

#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

#include "kernels.h"

namespace KILN_NS {

// packed int4 weights (the tiles of q4_tiles.cpp) of `dims` dimensions, and an activation x
void check_packed(const char* name, const at::Tensor& p, int64_t dims);
// The bytes of one tile of a packed weight [..., groups, block bytes] (either block size)
inline int64_t tile_bytes(const at::Tensor& p) { return p.size(-2) * p.size(-1); }
void check_x(const char* name, const at::Tensor& x);
// a KV pool pair as the kernels take it (fp32 or fp16, K and V alike), and a step's slots in it
bool kernel_pool(const at::Tensor& k, const at::Tensor& v);
const int64_t* checked_slots(const at::Tensor& slots, int64_t S);

// attend_rows' table, row_of and lens, contiguous int64 and checked: every row's length within
// the table's width, every row_of a row of the table.
struct RowTable {
  at::Tensor table, row_of, lens;
  int64_t L;
  RowTable(const at::Tensor& t, const at::Tensor& r, const at::Tensor& l)
      : table(t.contiguous()), row_of(r.to(at::kLong).contiguous()),
        lens(l.to(at::kLong).contiguous()), L(table.size(1)) {
    const int64_t* lp = lens.data_ptr<int64_t>();
    const int64_t* rp = row_of.data_ptr<int64_t>();
    for (int64_t t = 0; t < lens.numel(); ++t)
      TORCH_CHECK(lp[t] >= 1 && lp[t] <= L && rp[t] >= 0 && rp[t] < table.size(0),
                  "attend_rows: row ", t, " has length ", lp[t], " (table width ", L, ")");
  }
};

// ---- the ops (ops.cpp, lora.cpp, kquant.cpp) the one-call layers chain, or ops.cpp registers
at::Tensor q4_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n);
at::Tensor heads_q4(const at::Tensor& x, const at::Tensor& w, int64_t n);
void pack_q4_blocks(const at::Tensor& raw, int64_t block_bytes, const at::Tensor& out);
at::Tensor moe_q4(const at::Tensor& x, const at::Tensor& ids, const at::Tensor& weights,
                  const at::Tensor& w13, const at::Tensor& w2, int64_t num_threads);
at::Tensor attend_rows(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       const at::Tensor& table, const at::Tensor& row_of, const at::Tensor& lens,
                       double scale);
at::Tensor q8_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale);
void lora_add(at::Tensor out, const at::Tensor& x, const at::Tensor& a, const at::Tensor& bt,
              const at::Tensor& pieces, const at::Tensor& ranks, const at::Tensor& seg,
              const at::Tensor& local);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps);
at::Tensor silu_mul_rows(const at::Tensor& gu);
at::Tensor rope_write(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                      at::Tensor k, at::Tensor v, const at::Tensor& slots, int64_t num_heads);
at::Tensor router_logits(const at::Tensor& x, const at::Tensor& w);
// layers.cpp: a layer's linear as its module runs it (q4 tiles, kind -1, or GGUF blocks) + bias
at::Tensor layer_linear(const at::Tensor& x, at::TensorList parts, at::IntArrayRef kinds,
                        at::IntArrayRef rows, const std::optional<at::Tensor>& bias);
// kquant.cpp's GGUF-block linear, called by layers.cpp's layer kernels (one library), and its
// plan (kquant.h's KqLinear) for a one-region layer (layers_kq.cpp)
struct KqLinear;
void kq_plan(KqLinear& lin, int64_t M, int64_t K, at::TensorList weights,
             at::IntArrayRef types, at::IntArrayRef rows);
// layers_kq.cpp: decode_layer in one parallel region where its linears are GGUF blocks
at::Tensor decode_layer_kq(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                           const at::Tensor& ln1, const at::Tensor& ln2, double eps,
                           at::TensorList weights, at::IntArrayRef kinds, at::IntArrayRef rows,
                           at::IntArrayRef counts,
                           const c10::List<std::optional<at::Tensor>>& biases, at::Tensor k,
                           at::Tensor v, const at::Tensor& slots, const at::Tensor& table,
                           const at::Tensor& row_of, const at::Tensor& lens, int64_t num_heads,
                           double scale);
// the q and k heads of a fused qkv normalized in place (Qwen3's q/k norms; ops.cpp)
void qk_norm_rows(at::Tensor& qkv, const at::Tensor& qn, const at::Tensor& kn, double eps,
                  int64_t Hq, int64_t Hk, int64_t D);
at::Tensor kq_linear(const at::Tensor& x, at::TensorList weights, at::IntArrayRef types,
                     at::IntArrayRef rows);

}  // namespace KILN_NS
