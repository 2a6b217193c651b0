// kiln's one-call layers, the ATen side: decode_layer (a Llama decoder layer of a whole step:
// decode rows, prefill chunks, speculative verify rows), moe_layer (Qwen2/3-MoE, Mixtral) and
// decode_stack (a step's layers in one call). The eager layers (kiln/models/llama.py, run where
// the layer kernel does not: LoRA adapter steps, --no-batch-invariant) call the kernels one by
// one; decode_layer calls the very same functions (and q4_linear, attend_rows, kq_linear) in the
// same order, so a row gets the same bits either way (--batch-invariant), while a step pays one
// dispatch per layer instead of ~30 PyTorch ops (batch-1 decode is dispatch-bound: each op
// costs more than the arithmetic of one row). Each row's numbers come from its own row alone,
// in an order fixed by the row: none of these kernels mixes rows.

#include <ATen/TensorOperators.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/sigmoid.h>
#include <omp.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <exception>
#include <optional>
#include <tuple>
#include <vector>

#include "ops.h"

namespace KILN_NS {

// A linear of the layer as its module runs it: kiln's q4 tiles (kind -1, one part) or GGUF
// blocks through kq_linear (kquant.cpp) (kinds = GGML type ids), then the bias added.
constexpr int64_t kKindQ4 = -1;

at::Tensor layer_linear(const at::Tensor& x, at::TensorList parts, at::IntArrayRef kinds,
                        at::IntArrayRef rows, const std::optional<at::Tensor>& bias) {
  at::Tensor y;
  if (kinds.size() == 1 && kinds[0] == kKindQ4) {
    y = q4_linear(x, parts[0], rows[0]);
  } else {
    // the GGUF-block kernels (kquant.cpp, the same library): the function that
    // kiln/layers/quant/gguf_blocks.py's module calls
    y = kq_linear(x, parts, kinds, rows);
  }
  return bias.has_value() ? y + *bias : y;
}

// The attention half's arguments, checked once for both one-region layers (`name`: the op's,
// for the messages), the contiguous copies held here while the region runs; `bind` points an
// AttnQ4 at the caller's workspace, whose first `floats()` are the half's rows.
template <typename KT>
struct AttnQ4Args {
  at::Tensor xc, cc, sc, l1, sl, qn, kn;
  RowTable rt;
  const int64_t* sp;
  const float* bias[2];
  int64_t T, H, Hq, Hk, D, W;
  std::vector<int64_t> rows;

  AttnQ4Args(const char* name, const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
             const at::Tensor& ln1, at::TensorList w, at::IntArrayRef n,
             const c10::List<std::optional<at::Tensor>>& biases,
             const std::optional<at::Tensor>& q_norm, const std::optional<at::Tensor>& k_norm,
             const at::Tensor& k, const at::Tensor& v, const at::Tensor& slots,
             const at::Tensor& table, const at::Tensor& row_of, const at::Tensor& lens,
             int64_t num_heads)
      : rt(table, row_of, lens), T(x.size(0)), H(x.size(1)), Hq(num_heads) {
    TORCH_CHECK(kernel_pool(k, v) && k.scalar_type() == c10::CppTypeToScalarType<KT>::value,
                name, ": pools must be contiguous fp32 or fp16 [S, Hk, D], K and V alike");
    Hk = k.size(1);
    D = k.size(2);
    W = (Hq + 2 * Hk) * D;
    for (int i = 0; i < 2; ++i) check_packed(name, w[i], 3);
    TORCH_CHECK(D % 16 == 0 && D <= 256 && Hq % Hk == 0 && Hq / Hk <= 16 && H % 32 == 0 &&
                    n[0] == W && w[0].size(1) * kGroup == H && n[1] == H &&
                    w[1].size(1) * kGroup == Hq * D,
                name, ": the attention's shapes do not make a layer of this x and pool");
    for (int i = 0; i < 2; ++i)
      TORCH_CHECK((w[i].size(0) - 1) * kTile < n[i] && w[i].size(0) * kTile >= n[i], name,
                  ": packed weight ", i, " does not hold ", n[i], " rows");
    TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
                    cos.numel() == T * D && sin.numel() == T * D && slots.numel() == T &&
                    slots.scalar_type() == at::kLong && ln1.numel() == H,
                name, ": cos/sin fp32 [T, 1, D], slots int64 [T], norms [H]");
    TORCH_CHECK(!q_norm.has_value() ||
                    (q_norm->numel() == D && k_norm->numel() == D &&
                     q_norm->scalar_type() == at::kFloat && k_norm->scalar_type() == at::kFloat),
                name, ": q/k norms fp32 [D]");
    for (int i = 0; i < 2; ++i) {
      const auto b = biases.get(i);
      TORCH_CHECK(!b.has_value() || (b->scalar_type() == at::kFloat && b->is_contiguous() &&
                                     b->numel() == n[i]),
                  name, ": bias ", i, " must be contiguous fp32 [", n[i], "]");
      bias[i] = b.has_value() ? b->data_ptr<float>() : nullptr;
    }
    xc = x.contiguous();
    cc = cos.contiguous();
    sc = sin.contiguous();
    l1 = ln1.contiguous();
    sl = slots.contiguous();
    if (q_norm.has_value()) {
      qn = q_norm->contiguous();
      kn = k_norm->contiguous();
    }
    sp = checked_slots(sl, k.size(0));
    TORCH_CHECK(rt.lens.numel() == T,
                "attend_rows: table [R, L] int64, row_of and lens [T] int64");
    rows.resize(T);
    for (int64_t i = 0; i < T; ++i) rows[i] = i;
  }

  // h (the normed input), qkv, q, ctx, x1: [T, H], [T, W], [T, Hq D] x 2, [T, H]
  int64_t floats() const { return T * (2 * H + W + 2 * Hq * D); }

  AttnQ4<KT> bind(float* ws, QRows& xh, QRows& xc2, double eps, double qk_eps, double scale,
                  at::TensorList w, at::Tensor& k, at::Tensor& v) const {
    xh.resize(T, H);
    xc2.resize(T, Hq * D);
    float* qkv = ws + T * H;
    float* qb = qkv + T * W;
    float* ctx = qb + T * Hq * D;
    float* x1 = ctx + T * Hq * D;
    return {xc.data_ptr<float>(), l1.data_ptr<float>(), cc.data_ptr<float>(),
            sc.data_ptr<float>(), qn.defined() ? qn.data_ptr<float>() : nullptr,
            kn.defined() ? kn.data_ptr<float>() : nullptr, static_cast<float>(eps),
            static_cast<float>(qk_eps), static_cast<float>(scale), w[0].data_ptr<uint8_t>(),
            w[1].data_ptr<uint8_t>(), w[0].size(0), tile_bytes(w[0]), w[1].size(0),
            tile_bytes(w[1]), bias[0], bias[1], k.data_ptr<KT>(), v.data_ptr<KT>(), sp,
            rt.table.data_ptr<int64_t>(), rt.row_of.data_ptr<int64_t>(),
            rt.lens.data_ptr<int64_t>(), rows.data(), T, H, Hq, Hk, D, rt.L, ws, qkv, qb, ctx, x1,
            &xh, &xc2};
  }
};

// Whether a layer runs in one parallel region: fp32 rows, the pools as the kernels read them,
// biases fp32 or none, and its linears either each one part of kiln's q4 tiles (`q4`:
// decode_layer_q4, moe_layer_q4) or every part GGUF blocks (decode_layer_kq, layers_kq.cpp).
bool one_region_layer(const at::Tensor& x, const at::Tensor& k, const at::Tensor& v,
                      at::IntArrayRef kinds, at::IntArrayRef counts,
                      const c10::List<std::optional<at::Tensor>>& biases, bool q4) {
  if (x.scalar_type() != at::kFloat || x.dim() != 2 || !kernel_pool(k, v)) return false;
  for (size_t i = 0; i < biases.size(); ++i) {
    const auto b = biases.get(i);
    if ((q4 && (kinds[i] != kKindQ4 || counts[i] != 1)) ||
        (b.has_value() && b->scalar_type() != at::kFloat))
      return false;
  }
  for (const int64_t kind : kinds)
    if (!q4 && kind == kKindQ4) return false;
  return true;
}

// decode_layer when its four linears are kiln's q4 tiles and no LoRA adapter runs: the same
// kernels in the same order (so the same bits), in ONE parallel region, the stages separated by
// the implicit barriers of their `omp for` loops instead of a region, an allocation and a
// dispatch per op: a batch-1 decode step of SmolLM2 is ~270 small ops whose fixed costs (a few
// us each) were a third of the layer's time. The residual adds and biases are folded into the
// linears' tile stores (store_tile: the same adds in the same order). KT: the pool's type.
template <typename KT>
at::Tensor decode_layer_q4(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                           const at::Tensor& ln1, const at::Tensor& ln2, double eps,
                           at::TensorList w, at::IntArrayRef n,
                           const c10::List<std::optional<at::Tensor>>& biases, at::Tensor k,
                           at::Tensor v, const at::Tensor& slots, const at::Tensor& table,
                           const at::Tensor& row_of, const at::Tensor& lens, int64_t num_heads,
                           double scale) {
  const AttnQ4Args<KT> args("decode_layer", x, cos, sin, ln1, w, n, biases, std::nullopt,
                            std::nullopt, k, v, slots, table, row_of, lens, num_heads);
  const int64_t T = args.T, H = args.H, I = n[2] / 2;
  for (int i = 2; i < 4; ++i) check_packed("decode_layer", w[i], 3);
  TORCH_CHECK(n[2] % 64 == 0 && w[2].size(1) * kGroup == H && n[3] == H &&
                  w[3].size(1) * kGroup == I && ln2.numel() == H,
              "decode_layer: the MLP's shapes do not make a Llama layer of this x");
  for (int i = 2; i < 4; ++i)
    TORCH_CHECK((w[i].size(0) - 1) * kTile < n[i] && w[i].size(0) * kTile >= n[i],
                "decode_layer: packed weight ", i, " does not hold ", n[i], " rows");
  const float* bias[2];
  for (int i = 2; i < 4; ++i) {
    const auto b = biases.get(i);
    TORCH_CHECK(!b.has_value() || (b->scalar_type() == at::kFloat && b->is_contiguous() &&
                                   b->numel() == n[i]),
                "decode_layer: bias ", i, " must be contiguous fp32 [", n[i], "]");
    bias[i - 2] = b.has_value() ? b->data_ptr<float>() : nullptr;
  }
  const auto l2 = ln2.contiguous();
  at::Tensor out = at::empty({T, H}, args.xc.options());
  if (T == 0) return out;
  // The stages' rows: the attention half's (h, qkv, q, ctx, x1), then gu, a. One workspace
  // per calling thread, kept between calls: a 512-token prefill chunk's is ~16 MB, whose
  // zeroing or fresh pages per layer cost more than the layer's norms and adds (prefill 512 on
  // SmolLM2 ~8% slower with a new zeroed vector per call).
  // (thread_local: inside the parallel region below the names would be each thread's own,
  // so the region uses these references, bound here to the calling thread's)
  static thread_local std::vector<float> ws;
  static thread_local QRows tl_xh, tl_xc, tl_xa;
  QRows& xh = tl_xh;
  QRows& xa = tl_xa;
  const int64_t need = args.floats() + T * 3 * I;
  if (static_cast<int64_t>(ws.size()) < need) ws.resize(need);
  const AttnQ4<KT> attn = args.bind(ws.data(), xh, tl_xc, eps, 0.0, scale, w, k, v);
  float* h = attn.h;
  float* x1 = attn.x1;
  float* gu = ws.data() + args.floats();
  float* act = gu + T * 2 * I;
  xa.resize(T, I);
  const int64_t* rows = args.rows.data();
  float* op = out.data_ptr<float>();
  const float e = static_cast<float>(eps);
  const uint8_t* wp2 = w[2].data_ptr<uint8_t>();
  const uint8_t* wp3 = w[3].data_ptr<uint8_t>();
  const int nt = threads();
#pragma omp parallel num_threads(nt)
  {
    attn.run(nt);
    norm_rows_omp(x1, l2.data_ptr<float>(), e, T, H, h, xh);
    q4_tiles_omp(wp2, tile_bytes(w[2]), w[2].size(0), xh, rows, T, 2 * I, gu, bias[0],
                 nullptr);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; ++t) {
      silu_row(gu + t * 2 * I, gu + t * 2 * I + I, I, act + t * I);
      xa.quantize(t, act + t * I);
    }
    q4_tiles_omp(wp3, tile_bytes(w[3]), w[3].size(0), xa, rows, T, H, op, bias[1], x1);
  }
  return out;
}

// One Llama decoder layer of a step:
//   x [T, H] fp32 -> x + attn + mlp, the step's K/V written at slots [T]
//   weights, kinds, rows: the four linears' parts (qkv, o, gate_up, down) in order, `counts`
//                         parts each; biases: the four biases (None: no bias)
//   table [R, L], row_of [T], lens [T]: row t attends to the first lens[t] slots of
//                         table[row_of[t]] (attend_rows' arguments)
//   lora, lora_seg: empty, or per linear (a, bt, pieces, ranks, local) (a empty: no adapters
//                         on it) and the step's row groups (lora_add's arguments)
// The ops and their order are LlamaDecoderLayer.forward's with its kernels (see above).
at::Tensor decode_layer(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                        const at::Tensor& ln1, const at::Tensor& ln2, double eps,
                        at::TensorList weights, at::IntArrayRef kinds, at::IntArrayRef rows,
                        at::IntArrayRef counts, const c10::List<std::optional<at::Tensor>>& biases,
                        at::Tensor k, at::Tensor v, const at::Tensor& slots,
                        const at::Tensor& table, const at::Tensor& row_of, const at::Tensor& lens,
                        int64_t num_heads, double scale, at::TensorList lora,
                        const std::optional<at::Tensor>& lora_seg,
                        const std::optional<at::Tensor>& q_norm,
                        const std::optional<at::Tensor>& k_norm, double qk_eps) {
  TORCH_CHECK(counts.size() == 4 && biases.size() == 4,
              "decode_layer: four linears (qkv, o, gate_up, down)");
  TORCH_CHECK(lora.empty() || (lora.size() == 20 && lora_seg.has_value()),
              "decode_layer: lora is 5 tensors per linear (a, bt, pieces, ranks, local) and a seg");
  TORCH_CHECK(weights.size() == kinds.size() && kinds.size() == rows.size(),
              "decode_layer: one kind and row count per weight part");
  int64_t off[5] = {0};
  for (int i = 0; i < 4; ++i) off[i + 1] = off[i] + counts[i];
  TORCH_CHECK(off[4] == static_cast<int64_t>(weights.size()),
              "decode_layer: counts must add up to the weight parts");
  TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "decode_layer: q and k norms together");
  if (lora.empty() && !q_norm.has_value() && weights.size() == 4 &&
      one_region_layer(x, k, v, kinds, counts, biases, true)) {
    const auto layer_q4 = k.scalar_type() == at::kFloat ? &decode_layer_q4<float>
                                                        : &decode_layer_q4<at::Half>;
    return layer_q4(x, cos, sin, ln1, ln2, eps, weights, rows, biases, k, v, slots, table,
                    row_of, lens, num_heads, scale);
  }
  if (lora.empty() && !q_norm.has_value() &&
      one_region_layer(x, k, v, kinds, counts, biases, false))
    return decode_layer_kq(x, cos, sin, ln1, ln2, eps, weights, kinds, rows, counts, biases, k,
                           v, slots, table, row_of, lens, num_heads, scale);
  auto lin = [&](int i, const at::Tensor& h) {
    const int64_t a = off[i], n = counts[i];
    auto y = layer_linear(h, weights.slice(a, n), kinds.slice(a, n), rows.slice(a, n),
                          biases.get(i));
    // the linear's LoRA adapters, added to its output as the module's forward hook does
    // (kiln/engine/lora.py): same call, same place, so adapter rows get the eager bits
    if (!lora.empty() && lora[5 * i].numel() > 0)
      lora_add(y, h, lora[5 * i], lora[5 * i + 1], lora[5 * i + 2], lora[5 * i + 3], *lora_seg,
               lora[5 * i + 4]);
    return y;
  };
  const int64_t B = x.size(0);
  auto qkv = lin(0, rms_norm(x, ln1, eps));
  if (q_norm.has_value())
    qk_norm_rows(qkv, *q_norm, *k_norm, qk_eps, num_heads, k.size(1), k.size(2));
  const auto q = rope_write(qkv, cos, sin, k, v, slots, num_heads);
  const auto ctx = attend_rows(q, k, v, table, row_of, lens, scale);
  const auto x1 = x + lin(1, ctx.view({B, -1}));
  return x1 + lin(3, silu_mul_rows(lin(2, rms_norm(x1, ln2, eps))));
}

// moe_layer's MoE half as the op takes it (the router, the stacked experts, how a token's pairs
// are chosen), gathered once so that its two paths (the op-by-op chain, moe_layer_q4's one
// region) read the same arguments and route with the same code, so the same bits.
struct MoeArgs {
  at::Tensor router, w13, w2;
  int64_t top_k, shared;
  bool renormalize, shared_gate;
  int64_t E() const { return w13.size(0) - shared; }  // routed ones (then `shared` virtual)

  // softmax_topk of T rows of logits (row stride R) over the E routed experts: ids and w
  // [T, top_k]
  void route_rows(const float* lp, int64_t T, int64_t R, int64_t* ids, float* w) const {
    softmax_topk_rows(lp, T, R, E(), top_k, renormalize, ids, w);
  }

  // The router's logits [T, R] -> (ids [T, top_k], contiguous, for the experts' counters;
  // moe_q4's pair ids and weights [T, top_k + shared]): route_rows, as the eager
  // layers' op (ops.cpp softmax_topk) routes, then each token's pairs (t, E + c) for `shared`
  // virtual experts (a shared expert absorbed after the E routed: Experts.absorb_shared)
  // weighted sigmoid(logits[t, E]) (a gated shared expert: Qwen2-MoE) or 1, as moe.py's
  // with_shared_pairs: the same ATen ops, so the same bits.
  std::tuple<at::Tensor, at::Tensor, at::Tensor> route(const at::Tensor& logits) const {
    const int64_t E = this->E(), T = logits.size(0), R = logits.size(1);
    const auto lc = logits.contiguous();
    at::Tensor ids = at::empty({T, top_k}, lc.options().dtype(at::kLong));
    at::Tensor w = at::empty({T, top_k}, lc.options());
    route_rows(lc.data_ptr<float>(), T, R, ids.data_ptr<int64_t>(), w.data_ptr<float>());
    if (shared == 0) return {ids, ids, w};
    const auto sid = at::arange(E, E + shared, ids.options()).expand({T, shared});
    const auto sw = (shared_gate ? at::sigmoid(logits.slice(1, E, E + 1)).to(at::kFloat)
                                 : at::ones({T, 1}, w.options().dtype(at::kFloat)))
                        .expand({T, shared});
    return {ids, at::cat({ids, sid}, 1).contiguous(), at::cat({w, sw}, 1).contiguous()};
  }
};

// moe_layer where both attention linears are kiln's q4 tiles (a Q4_0 / int4 model) and the
// pools fp32 or fp16: the whole layer in one parallel region, as decode_layer_q4 does for a
// dense layer. The same row functions in the same order as moe_layer's op by op chain (rms_row,
// q4 tiles, rms_row per q/k head, rope_row, attend_rows, router_logit, route_row, moe_q4_omp),
// so the same bits; what goes is a parallel region, a fork and a join and a tensor per op: ~12
// of them a layer, ~5 us each at one row.
template <typename KT>
std::tuple<at::Tensor, at::Tensor> moe_layer_q4(
    const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& ln1,
    const at::Tensor& ln2, double eps, at::TensorList w, at::IntArrayRef n,
    const c10::List<std::optional<at::Tensor>>& biases, const std::optional<at::Tensor>& q_norm,
    const std::optional<at::Tensor>& k_norm, double qk_eps, at::Tensor k, at::Tensor v,
    const at::Tensor& slots, const at::Tensor& table, const at::Tensor& row_of,
    const at::Tensor& lens, int64_t num_heads, double scale, const MoeArgs& moe) {
  const AttnQ4Args<KT> args("moe_layer", x, cos, sin, ln1, w, n, biases, q_norm, k_norm, k, v,
                            slots, table, row_of, lens, num_heads);
  const int64_t T = args.T, H = args.H;
  // w13 / w2: E routed experts, then `shared` virtual ones (a shared expert absorbed, see
  // MoeArgs::route); the router's rows: the E routed, then the shared gate's (shared_gate)
  const at::Tensor &w13 = moe.w13, &w2 = moe.w2, &router = moe.router;
  const int64_t shared = moe.shared, EA = w13.size(0), E = moe.E(), R = E + moe.shared_gate;
  const int64_t I = w13.size(1) * kTile / 2, K = moe.top_k + shared;  // K: pairs a token
  check_packed("moe_layer (w13)", w13, 4);
  check_packed("moe_layer (w2)", w2, 4);
  TORCH_CHECK(w13.size(2) * kGroup == H && w2.size(0) == EA && w2.size(1) * kTile == H &&
                  w2.size(2) * kGroup == I && I % kTile == 0 && router.dim() == 2 &&
                  router.size(0) == R && router.size(1) == H && shared >= 0 && E > 0 &&
                  (shared > 0 || !moe.shared_gate) &&
                  router.scalar_type() == at::kFloat && ln2.numel() == H,
              "moe_layer: the experts' and router's shapes do not make a MoE layer of this x");
  const auto l2 = ln2.contiguous();
  const auto rc = router.contiguous();
  at::Tensor out = at::empty({T, H}, args.xc.options());
  at::Tensor logits = at::empty({T, R}, args.xc.options());
  at::Tensor ids = at::empty({T, moe.top_k}, args.xc.options().dtype(at::kLong));
  if (T == 0) return {out, ids};  // (else: route_row's, below)
  // (one workspace per calling thread, kept between calls: see decode_layer_q4)
  static thread_local std::vector<float> ws;
  static thread_local QRows tl_xh, tl_xc, tl_xs, tl_hs;
  QRows& xs = tl_xs;
  QRows& hs = tl_hs;
  const int64_t need = args.floats() + T * H + T * K * (I + H);
  if (static_cast<int64_t>(ws.size()) < need) ws.resize(need);
  const AttnQ4<KT> attn = args.bind(ws.data(), tl_xh, tl_xc, eps, qk_eps, scale, w, k, v);
  float* x1 = attn.x1;
  float* h2 = ws.data() + args.floats();
  float* eh = h2 + T * H;          // the experts' [pairs, I]
  float* eo = eh + T * K * I;      // and [pairs, H]
  xs.resize(T, H);
  const float* rp = rc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  float* lp = logits.data_ptr<float>();
  const float e = static_cast<float>(eps);
  const MoeWeights mw(w13, w2);
  const int nt = threads();
  MoePlan pl;
  std::exception_ptr error;
#pragma omp parallel num_threads(nt)
  {
    attn.run(nt);
    norm_rows_omp(x1, l2.data_ptr<float>(), e, T, H, h2, xs);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < T * R; ++r)
      lp[r] = router_logit(h2 + (r / R) * H, rp + (r % R) * H, H);
    // the routing (route_row; with a shared expert MoeArgs::route's ATen ops), serial, on the
    // calling thread: ATen's thread-local state (inference mode) is that thread's. An
    // exception must not leave the region (std::terminate): it is rethrown after.
#pragma omp master
    {
      try {
        if (shared == 0) {  // (no tensor: route_row straight into ids and a buffer)
          static thread_local std::vector<float> tl_w;
          tl_w.resize(T * K);
          int64_t* ip = ids.data_ptr<int64_t>();
          moe.route_rows(lp, T, R, ip, tl_w.data());
          pl = moe_plan(ip, tl_w.data(), T, K, EA, I / kTile, H / kTile, omp_get_num_threads());
        } else {
          at::Tensor pi, pw;
          std::tie(ids, pi, pw) = moe.route(logits);
          pl = moe_plan(pi.data_ptr<int64_t>(), pw.data_ptr<float>(), T, K, EA, I / kTile,
                        H / kTile, omp_get_num_threads());
        }
        hs.resize(pl.Pv, I);
      } catch (...) {
        error = std::current_exception();
      }
    }
#pragma omp barrier
    if (!error) moe_q4_omp(pl, mw, xs, eh, hs, eo, op, x1, omp_get_thread_num());
  }
  if (error) std::rethrow_exception(error);
  return {out, ids};
}

// A mixture-of-experts decoder layer of any step in one call (Qwen2/3-MoE without a shared
// expert, Mixtral): what the layer's eager forward runs, op for op (rms_norm, the qkv linear,
// the q/k norms, rope_write, attend_rows, the o linear, the residual, rms_norm, the router's
// fp32 logits, softmax + top-k (+ renormalized), moe_q4, the residual), without ~40 Python
// calls a layer. Returns (x out [T, H], ids [T, k]: the routing, for the experts' counters).
std::tuple<at::Tensor, at::Tensor> moe_layer(
    const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& ln1,
    const at::Tensor& ln2, double eps, at::TensorList weights, at::IntArrayRef kinds,
    at::IntArrayRef rows, at::IntArrayRef counts,
    const c10::List<std::optional<at::Tensor>>& biases, const std::optional<at::Tensor>& q_norm,
    const std::optional<at::Tensor>& k_norm, double qk_eps, at::Tensor k, at::Tensor v,
    const at::Tensor& slots, const at::Tensor& table, const at::Tensor& row_of,
    const at::Tensor& lens, int64_t num_heads, double scale, const at::Tensor& router,
    int64_t top_k, bool renormalize, const at::Tensor& w13, const at::Tensor& w2,
    int64_t shared, bool shared_gate) {
  TORCH_CHECK(counts.size() == 2 && biases.size() == 2,
              "moe_layer: two linears (qkv, o)");
  TORCH_CHECK(weights.size() == kinds.size() && kinds.size() == rows.size() &&
                  counts[0] + counts[1] == static_cast<int64_t>(weights.size()),
              "moe_layer: one kind and row count per weight part, counts adding up to them");
  TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "moe_layer: q and k norms together");
  const MoeArgs moe{router, w13, w2, top_k, shared, renormalize, shared_gate};
  if (weights.size() == 2 && w13.scalar_type() == at::kByte &&
      one_region_layer(x, k, v, kinds, counts, biases, true)) {
    const auto layer = k.scalar_type() == at::kFloat ? &moe_layer_q4<float>
                                                     : &moe_layer_q4<at::Half>;
    return layer(x, cos, sin, ln1, ln2, eps, weights, rows, biases, q_norm, k_norm, qk_eps, k,
                 v, slots, table, row_of, lens, num_heads, scale, moe);
  }
  auto lin = [&](int i, const at::Tensor& h) {
    const int64_t a = i == 0 ? 0 : counts[0], n = counts[i];
    return layer_linear(h, weights.slice(a, n), kinds.slice(a, n), rows.slice(a, n),
                        biases.get(i));
  };
  const int64_t B = x.size(0), Hk = k.size(1), D = k.size(2);
  auto qkv = lin(0, rms_norm(x, ln1, eps));
  if (q_norm.has_value()) qk_norm_rows(qkv, *q_norm, *k_norm, qk_eps, num_heads, Hk, D);
  const auto q = rope_write(qkv, cos, sin, k, v, slots, num_heads);
  const auto ctx = attend_rows(q, k, v, table, row_of, lens, scale);
  const auto x1 = x + lin(1, ctx.view({B, -1}));
  const auto h = rms_norm(x1, ln2, eps);
  // kiln/models/qwen_moe.py: Router (router_logits) then softmax_topk (route_row), the same ops
  auto [ids, pi, pw] = moe.route(router_logits(h, router));
  return {x1 + moe_q4(h, pi, pw, w13, w2, 0), ids};
}

namespace {

// A model's decoder layers as the layer kernels take them, gathered once (LlamaModel's
// `_layer_stack`): decode_stack then runs a whole step's layers in one call. Why: passing
// decode_layer's 21 arguments (lists of weights, kinds, biases...) from Python costs ~15 us a
// call, 30 calls a SmolLM2 step, more than its norms, RoPE and attention together; a MoE layer
// (moe_layer's 27 arguments, then the routing counters) cost ~75 us a layer in Python, 1.8 ms of
// a 14 ms step of the MoE benchmark model. A layer is dense (`add`: decode_layer's arguments) or
// a sparse MoE block (`add_moe`: moe_layer's, and the layer's routing counters `routed` [E]
// int64, which each step's ids are added to, as Experts.count does). Empty tensors stand for
// None (a list of Tensors cannot hold None): biases, q/k norms. The pools k, v are the layers'
// own (KVStore's), written in place by every step.
struct LayerStack : torch::CustomClassHolder {
  struct Layer {
    at::Tensor ln1, ln2, k, v;
    double eps, scale;
    std::vector<at::Tensor> weights;
    std::vector<int64_t> kinds, rows, counts;
    c10::List<std::optional<at::Tensor>> biases;
    int64_t num_heads;
    std::optional<at::Tensor> q_norm, k_norm;
    double qk_eps;
    // a sparse MoE block where `router` is defined
    at::Tensor router, w13, w2, routed;
    int64_t top_k = 0, shared = 0;
    bool renormalize = false, shared_gate = false;
  };
  std::vector<Layer> layers;

  static std::optional<at::Tensor> maybe(const at::Tensor& t) {
    return t.numel() > 0 ? std::optional<at::Tensor>(t) : std::nullopt;
  }
  static Layer make(at::Tensor ln1, at::Tensor ln2, double eps, std::vector<at::Tensor> weights,
                    std::vector<int64_t> kinds, std::vector<int64_t> rows,
                    std::vector<int64_t> counts, const std::vector<at::Tensor>& biases,
                    at::Tensor k, at::Tensor v, int64_t num_heads, double scale,
                    const at::Tensor& q_norm, const at::Tensor& k_norm, double qk_eps) {
    TORCH_CHECK((q_norm.numel() > 0) == (k_norm.numel() > 0),
                "LayerStack: q and k norms together");
    c10::List<std::optional<at::Tensor>> b;
    for (const auto& t : biases) b.push_back(maybe(t));
    return {std::move(ln1), std::move(ln2), std::move(k), std::move(v), eps, scale,
            std::move(weights), std::move(kinds), std::move(rows), std::move(counts),
            std::move(b), num_heads, maybe(q_norm), maybe(k_norm), qk_eps};
  }
  void add(at::Tensor ln1, at::Tensor ln2, double eps, std::vector<at::Tensor> weights,
           std::vector<int64_t> kinds, std::vector<int64_t> rows, std::vector<int64_t> counts,
           std::vector<at::Tensor> biases, at::Tensor k, at::Tensor v, int64_t num_heads,
           double scale, at::Tensor q_norm, at::Tensor k_norm, double qk_eps) {
    TORCH_CHECK(biases.size() == 4, "LayerStack.add: four biases (empty: none)");
    layers.push_back(make(std::move(ln1), std::move(ln2), eps, std::move(weights),
                          std::move(kinds), std::move(rows), std::move(counts), biases,
                          std::move(k), std::move(v), num_heads, scale, q_norm, k_norm, qk_eps));
  }
  void add_moe(at::Tensor ln1, at::Tensor ln2, double eps, std::vector<at::Tensor> weights,
               std::vector<int64_t> kinds, std::vector<int64_t> rows,
               std::vector<int64_t> counts, std::vector<at::Tensor> biases, at::Tensor k,
               at::Tensor v, int64_t num_heads, double scale, at::Tensor q_norm,
               at::Tensor k_norm, double qk_eps, at::Tensor router, int64_t top_k,
               bool renormalize, at::Tensor w13, at::Tensor w2, at::Tensor routed,
               int64_t shared, bool shared_gate) {
    TORCH_CHECK(biases.size() == 2, "LayerStack.add_moe: two biases (qkv, o; empty: none)");
    TORCH_CHECK(routed.dim() == 1 && routed.scalar_type() == at::kLong &&
                    routed.is_contiguous() && routed.size(0) == w13.size(0) - shared,
                "LayerStack.add_moe: routed is the layer's int64 counters [E]");
    Layer l = make(std::move(ln1), std::move(ln2), eps, std::move(weights), std::move(kinds),
                   std::move(rows), std::move(counts), biases, std::move(k), std::move(v),
                   num_heads, scale, q_norm, k_norm, qk_eps);
    l.router = std::move(router);
    l.top_k = top_k;
    l.renormalize = renormalize;
    l.w13 = std::move(w13);
    l.w2 = std::move(w2);
    l.routed = std::move(routed);
    l.shared = shared;
    l.shared_gate = shared_gate;
    layers.push_back(std::move(l));
  }
  int64_t size() const { return static_cast<int64_t>(layers.size()); }
};

// Every layer of `stack` on x [T, H] in order: decode_layer's / moe_layer's arguments per
// layer, one step's (cos, sin, slots, table, row_of, lens) shared; no LoRA (a step with adapter
// rows runs layer by layer). Eager only: the schema does not declare the pools' and counters'
// writes.
at::Tensor decode_stack(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                        const c10::intrusive_ptr<LayerStack>& stack, const at::Tensor& slots,
                        const at::Tensor& table, const at::Tensor& row_of,
                        const at::Tensor& lens) {
  at::Tensor h = x;
  for (auto& l : stack->layers) {
    if (!l.router.defined()) {
      h = decode_layer(h, cos, sin, l.ln1, l.ln2, l.eps, l.weights, l.kinds, l.rows, l.counts,
                       l.biases, l.k, l.v, slots, table, row_of, lens, l.num_heads, l.scale, {},
                       std::nullopt, l.q_norm, l.k_norm, l.qk_eps);
      continue;
    }
    auto [y, ids] = moe_layer(h, cos, sin, l.ln1, l.ln2, l.eps, l.weights, l.kinds, l.rows,
                              l.counts, l.biases, l.q_norm, l.k_norm, l.qk_eps, l.k, l.v, slots,
                              table, row_of, lens, l.num_heads, l.scale, l.router, l.top_k,
                              l.renormalize, l.w13, l.w2, l.shared, l.shared_gate);
    const int64_t* ip = ids.data_ptr<int64_t>();
    int64_t* cp = l.routed.data_ptr<int64_t>();
    for (int64_t i = 0; i < ids.numel(); ++i) ++cp[ip[i]];
    h = y;
  }
  return h;
}

}  // namespace

// The one-call layers and the layer stack, a fragment of ops.cpp's library.
KILN_LIBRARY_FRAGMENT(m) {
  m.def("decode_layer(Tensor x, Tensor cos, Tensor sin, Tensor ln1, Tensor ln2, float eps, "
        "Tensor[] weights, int[] kinds, int[] rows, int[] counts, Tensor?[] biases, Tensor(a!) k, "
        "Tensor(b!) v, Tensor slots, Tensor table, Tensor row_of, Tensor lens, int num_heads, "
        "float scale, Tensor[] lora, Tensor? lora_seg, Tensor? q_norm=None, "
        "Tensor? k_norm=None, float qk_eps=0.0) -> Tensor");
  m.def("moe_layer(Tensor x, Tensor cos, Tensor sin, Tensor ln1, Tensor ln2, float eps, "
        "Tensor[] weights, int[] kinds, int[] rows, int[] counts, Tensor?[] biases, "
        "Tensor? q_norm, Tensor? k_norm, float qk_eps, Tensor(a!) k, Tensor(b!) v, Tensor slots, "
        "Tensor table, Tensor row_of, Tensor lens, int num_heads, float scale, Tensor router, "
        "int top_k, bool renormalize, Tensor w13, Tensor w2, int shared=0, "
        "bool shared_gate=False) -> (Tensor, Tensor)");
  m.class_<LayerStack>("LayerStack")
      .def(torch::init<>())
      .def("add", &LayerStack::add)
      .def("add_moe", &LayerStack::add_moe)
      .def("size", &LayerStack::size);
  m.def("decode_stack(Tensor x, Tensor cos, Tensor sin, "
        "__torch__.torch.classes." KILN_STR(KILN_NS) ".LayerStack stack, Tensor slots, Tensor table, "
        "Tensor row_of, Tensor lens) -> Tensor");
  m.impl("decode_stack", c10::DispatchKey::CPU, &decode_stack);
  m.impl("decode_layer", c10::DispatchKey::CPU, &decode_layer);
  m.impl("moe_layer", c10::DispatchKey::CPU, &moe_layer);
}

}  // namespace KILN_NS
