// decode_layer (layers.cpp) when its linears are GGUF blocks (a Q4_K_M / Q8_0 / Q5_0 model on
// kquant.cpp's kernels) and no LoRA adapter runs: the whole layer in ONE parallel region, as
// decode_layer_q4 runs an all-int4 one. The same functions in the same order as decode_layer's
// op-by-op chain (rms_row, each linear's KqLinear with its bias and the residual added in its
// stores as the chain adds them, rope_row, attend_rows, silu_row), so the same bits, without a
// region, a plan, an allocation and a dispatch per op: Qwen2.5-Coder-0.5B's batch-1 step spent
// ~14% of its samples in libgomp's waits while one thread ran the ~10 ops a layer between its
// four linears.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <omp.h>

#include <cstdint>
#include <optional>
#include <vector>

#include "kquant.h"
#include "ops.h"

namespace KILN_NS {

namespace {

template <typename KT>
at::Tensor decode_layer_kq_impl(const at::Tensor& x, const at::Tensor& cos,
                                const at::Tensor& sin, const at::Tensor& ln1,
                                const at::Tensor& ln2, double eps, at::TensorList weights,
                                at::IntArrayRef kinds, at::IntArrayRef rows,
                                at::IntArrayRef counts,
                                const c10::List<std::optional<at::Tensor>>& biases,
                                at::Tensor k, at::Tensor v, const at::Tensor& slots,
                                const at::Tensor& table, const at::Tensor& row_of,
                                const at::Tensor& lens, int64_t num_heads, double scale) {
  const int64_t T = x.size(0), H = x.size(1), Hq = num_heads, Hk = k.size(1), D = k.size(2);
  const int64_t W = (Hq + 2 * Hk) * D;
  // the four linears' plans (one per calling thread, kept between calls: their activation
  // buffers too), each linear's input width: qkv and gate_up read H, o reads Hq D, down I
  static thread_local KqLinear tl_lin[4];
  KqLinear* lin = tl_lin;  // (the region's threads use the calling thread's)
  int64_t off = 0;
  for (int i = 0; i < 4; ++i) {
    const int64_t in = i == 0 || i == 2 ? H : i == 1 ? Hq * D : lin[2].N / 2;
    kq_plan(lin[i], T, in, weights.slice(off, counts[i]), kinds.slice(off, counts[i]),
            rows.slice(off, counts[i]));
    off += counts[i];
  }
  const int64_t I = lin[2].N / 2;
  TORCH_CHECK(lin[0].N == W && lin[1].N == H && lin[2].N % 2 == 0 && lin[3].N == H &&
                  D % 16 == 0 && H % 8 == 0 && I % 8 == 0 && ln1.numel() == H &&
                  ln2.numel() == H,
              "decode_layer: the linears' widths do not make a layer of this x and pool");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
                  cos.numel() == T * D && sin.numel() == T * D && slots.numel() == T &&
                  slots.scalar_type() == at::kLong,
              "decode_layer: cos/sin fp32 [T, 1, D], slots int64 [T]");
  const float* bias[4];
  for (int i = 0; i < 4; ++i) {
    const auto b = biases.get(i);
    TORCH_CHECK(!b.has_value() || (b->scalar_type() == at::kFloat && b->is_contiguous() &&
                                   b->numel() == lin[i].N),
                "decode_layer: bias ", i, " must be contiguous fp32 [", lin[i].N, "]");
    bias[i] = b.has_value() ? b->data_ptr<float>() : nullptr;
  }
  const RowTable rt(table, row_of, lens);
  TORCH_CHECK(rt.lens.numel() == T, "attend_rows: row_of and lens [T]");
  const auto xc = x.contiguous(), cc = cos.contiguous(), sc = sin.contiguous();
  const auto sl = slots.contiguous(), l1 = ln1.contiguous(), l2 = ln2.contiguous();
  const int64_t* sp = checked_slots(sl, k.size(0));
  at::Tensor out = at::empty({T, H}, xc.options());
  if (T == 0) return out;
  // rows of: h [T, H], qkv [T, W], q and ctx [T, Hq D], x1 [T, H], gu [T, 2I], act [T, I]
  static thread_local std::vector<float> tl_ws;
  std::vector<float>& ws = tl_ws;
  const int64_t need = T * (2 * H + W + 2 * Hq * D + 3 * I);
  if (static_cast<int64_t>(ws.size()) < need) ws.resize(need);
  float* h = ws.data();
  float* qkv = h + T * H;
  float* q = qkv + T * W;
  float* ctx = q + T * Hq * D;
  float* x1 = ctx + T * Hq * D;
  float* gu = x1 + T * H;
  float* act = gu + T * 2 * I;
  const float* xp = xc.data_ptr<float>();
  const float* cp = cc.data_ptr<float>();
  const float* snp = sc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  KT* kp = k.data_ptr<KT>();
  KT* vp = v.data_ptr<KT>();
  const float e = static_cast<float>(eps);
  const int nt = threads();
#pragma omp parallel num_threads(nt)
  {
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; ++t) rms_row(xp + t * H, l1.data_ptr<float>(), e, H, h + t * H);
    lin[0].run(static_cast<const float*>(h), qkv, bias[0], nullptr);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; ++t)
      rope_row(qkv + t * W, cp + t * D, snp + t * D, Hq, Hk, D, q + t * Hq * D,
               kp + sp[t] * Hk * D, vp + sp[t] * Hk * D);
    attend_rows_omp(static_cast<const float*>(q), static_cast<const KT*>(kp),
                    static_cast<const KT*>(vp), rt.table.data_ptr<int64_t>(),
                    rt.row_of.data_ptr<int64_t>(), rt.lens.data_ptr<int64_t>(), ctx, T, Hq, Hk,
                    D, D, rt.L, static_cast<float>(scale), nt);
    lin[1].run(static_cast<const float*>(ctx), x1, bias[1], xp);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; ++t) rms_row(x1 + t * H, l2.data_ptr<float>(), e, H, h + t * H);
    lin[2].run(static_cast<const float*>(h), gu, bias[2], nullptr);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; ++t) silu_row(gu + t * 2 * I, gu + t * 2 * I + I, I, act + t * I);
    lin[3].run(static_cast<const float*>(act), op, bias[3], x1);
  }
  return out;
}

}  // namespace

at::Tensor decode_layer_kq(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                           const at::Tensor& ln1, const at::Tensor& ln2, double eps,
                           at::TensorList weights, at::IntArrayRef kinds, at::IntArrayRef rows,
                           at::IntArrayRef counts,
                           const c10::List<std::optional<at::Tensor>>& biases, at::Tensor k,
                           at::Tensor v, const at::Tensor& slots, const at::Tensor& table,
                           const at::Tensor& row_of, const at::Tensor& lens, int64_t num_heads,
                           double scale) {
  const auto impl = k.scalar_type() == at::kFloat ? &decode_layer_kq_impl<float>
                                                  : &decode_layer_kq_impl<at::Half>;
  return impl(x, cos, sin, ln1, ln2, eps, weights, kinds, rows, counts, biases, k, v, slots,
              table, row_of, lens, num_heads, scale);
}

}  // namespace KILN_NS
