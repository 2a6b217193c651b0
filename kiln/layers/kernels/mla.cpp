// DeepSeek-V2/V3's decoder layer of a whole step in one call (`mla_layer`): multi-head latent
// attention over the latent KV pool, then a dense SwiGLU MLP or the MoE block (grouped top-k
// routing, the routed and the absorbed shared experts in one moe_q4). What the eager layers of
// kiln/models/deepseek.py run, with the weights absorbed the same way (see its head comment);
// without ~60 Python-level ops a layer, which made a batch-1 step of the DeepSeek benchmark
// model 19 ms where its kernels take ~9. Every row's numbers come from its own row alone
// (the kernels below never mix rows; the routing is per row), so a row decodes the same alone
// or in a batch (--batch-invariant). A layer's tensors are gathered once into an MlaLayer.

#include <ATen/TensorOperators.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/custom_class.h>
#include <torch/library.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <optional>
#include <vector>

#include "ops.h"

namespace KILN_NS {
namespace {

// One DeepSeek decoder layer's tensors and shapes. The linears, in order: q_proj (or q_a_proj
// then q_b_proj: a q LoRA), kv_a_proj_with_mqa, o_proj, then for a dense layer gate_up and
// down; each is `counts[i]` parts (kiln's q4 tiles, kind -1, or GGUF blocks) with a bias or an
// empty tensor. Empty tensors stand for None (q_a_norm, the correction bias).
struct MlaLayer : torch::CustomClassHolder {
  at::Tensor ln1, ln2, q_a_norm, kv_norm, uk, uv, k, v;
  double eps = 0, latent_eps = 0, scale = 0;
  std::vector<at::Tensor> weights, biases;
  std::vector<int64_t> kinds, rows, counts;
  int64_t heads = 0, nope = 0, rope = 0, vdim = 0, rank = 0;
  bool interleave = false;
  // the MoE block (router defined) or a dense MLP
  at::Tensor router, bias, w13, w2, routed;
  RouteRule rule;  // how a token's experts are picked (route_row; rule.bias points into bias)
  int64_t top_k = 0, shared = 0;
  // run the op-by-op chain even where the one region could (the tests compare the two)
  bool chain = false;

  void attention(at::Tensor ln1_, at::Tensor ln2_, double eps_, at::Tensor q_a_norm_,
                 at::Tensor kv_norm_, double latent_eps_, std::vector<at::Tensor> weights_,
                 std::vector<int64_t> kinds_, std::vector<int64_t> rows_,
                 std::vector<int64_t> counts_, std::vector<at::Tensor> biases_, at::Tensor uk_,
                 at::Tensor uv_, int64_t heads_, int64_t nope_, int64_t rope_, int64_t vdim_,
                 bool interleave_, at::Tensor k_, at::Tensor v_, double scale_) {
    TORCH_CHECK(counts_.size() == biases_.size() && (counts_.size() == 3 + (q_a_norm_.numel() > 0) ||
                                                     counts_.size() == 5 + (q_a_norm_.numel() > 0)),
                "MlaLayer.attention: the linears q (q_a, q_b), kv_a, o (+ gate_up, down), one "
                "bias each");
    TORCH_CHECK(std::accumulate(counts_.begin(), counts_.end(), int64_t{0}) ==
                        static_cast<int64_t>(weights_.size()) &&
                    weights_.size() == kinds_.size() && kinds_.size() == rows_.size(),
                "MlaLayer.attention: one kind and row count per weight part");
    TORCH_CHECK(k_.dim() == 3 && k_.size(1) == 1 && k_.is_contiguous() &&
                    (k_.scalar_type() == at::kFloat || k_.scalar_type() == at::kHalf),
                "MlaLayer.attention: the latent pool must be contiguous fp32 or fp16 [S, 1, r + p]");
    rank = kv_norm_.numel();
    TORCH_CHECK(k_.size(2) == rank + rope_ && rank % 32 == 0 && nope_ % 32 == 0 && rope_ % 2 == 0 &&
                    ln1_.numel() % 32 == 0,
                "MlaLayer.attention: rank and nope multiples of 32, the pool r + p wide");
    ln1 = std::move(ln1_), ln2 = std::move(ln2_), eps = eps_;
    q_a_norm = std::move(q_a_norm_), kv_norm = std::move(kv_norm_), latent_eps = latent_eps_;
    weights = std::move(weights_), kinds = std::move(kinds_), rows = std::move(rows_);
    counts = std::move(counts_), biases = std::move(biases_);
    uk = std::move(uk_), uv = std::move(uv_);
    heads = heads_, nope = nope_, rope = rope_, vdim = vdim_, interleave = interleave_;
    k = std::move(k_), v = std::move(v_), scale = scale_;
  }

  void moe(at::Tensor router_, at::Tensor bias_, int64_t top_k_, int64_t n_group_,
           int64_t topk_group_, int64_t method_, bool sigmoid_, bool renormalize_,
           double routed_scale_, at::Tensor w13_, at::Tensor w2_, int64_t shared_,
           at::Tensor routed_) {
    const int64_t E = router_.size(0);
    TORCH_CHECK(router_.dim() == 2 && router_.scalar_type() == at::kFloat &&
                    (bias_.numel() == 0 || bias_.numel() == E) && top_k_ > 0 && top_k_ <= E &&
                    n_group_ > 0 && E % n_group_ == 0 && topk_group_ > 0 &&
                    topk_group_ <= n_group_ && w13_.size(0) == E + shared_ &&
                    routed_.scalar_type() == at::kLong && routed_.numel() == E &&
                    routed_.is_contiguous(),
                "MlaLayer.moe: router fp32 [E, H], bias [E] or empty, w13/w2 E + shared "
                "experts, routed int64 [E]");
    router = router_.contiguous(), bias = bias_.contiguous(), top_k = top_k_;
    w13 = std::move(w13_), w2 = std::move(w2_), shared = shared_, routed = std::move(routed_);
    rule = {E, top_k, n_group_, topk_group_, method_, shared, sigmoid_, renormalize_,
            static_cast<float>(routed_scale_), bias.numel() ? bias.data_ptr<float>() : nullptr};
  }

  at::Tensor linear(size_t i, const at::Tensor& x) const {
    const int64_t a = std::accumulate(counts.begin(), counts.begin() + i, int64_t{0});
    const auto b = biases[i].numel() > 0 ? std::optional<at::Tensor>(biases[i]) : std::nullopt;
    const auto parts = at::TensorList(weights).slice(a, counts[i]);
    return layer_linear(x, parts, at::IntArrayRef(kinds).slice(a, counts[i]),
                        at::IntArrayRef(rows).slice(a, counts[i]), b);
  }
};

// RoPE of one head's p values (cos / signed sin as RotaryEmbedding.lookup gives them): the
// Llama form x * cos + rotate_half(x) * sin, or DeepSeek's interleaved pairs, which come out
// de-interleaved ([rotated evens | rotated odds]) as deepseek.py's apply_rotary_interleaved
// returns them (q and k get the same permutation, so their dot products are unchanged). Each
// product rounded, then the sum: the eager layer's PyTorch ops round alike (no FMA).
template <typename T>
__attribute__((optimize("fp-contract=off"))) void rope_values(const float* x, const float* cs, const float* sn, int64_t p, bool interleave,
                 T* y) {
  const int64_t half = p / 2;
  if (interleave) {
    for (int64_t i = 0; i < half; ++i) {
      const float a = x[2 * i], b = x[2 * i + 1];
      y[i] = static_cast<T>(a * cs[i] + b * sn[i]);
      y[half + i] = static_cast<T>(b * cs[i] - a * sn[i]);
    }
    return;
  }
  for (int64_t i = 0; i < half; ++i) {
    y[i] = static_cast<T>(x[i] * cs[i] + x[half + i] * sn[i]);
    y[half + i] = static_cast<T>(x[half + i] * cs[half + i] + x[i] * sn[half + i]);
  }
}

// Whether mla_layer_q4 runs the layer: each linear one part of kiln's q4 tiles, the experts
// stacked q4 tiles too.
bool one_region(const MlaLayer& L) {
  if (L.chain) return false;
  for (size_t i = 0; i < L.kinds.size(); ++i)
    if (L.kinds[i] != -1 || L.counts[i] != 1) return false;
  return !L.router.defined() || L.w13.scalar_type() == at::kByte;
}

// mla_layer where every linear is kiln's q4 tiles (a Q4_0 / int4 model): the whole layer in ONE
// parallel region, as layers.cpp's decode_layer_q4 and moe_layer_q4 run theirs: the same row
// functions in the same order as the op-by-op chain below (rms_row, the q4 tiles with the bias
// and the residual in their stores, heads_q4's loop, attend_rows, router_logit, moe_q4's work),
// so the same bits, without a region, a fork and a join and a tensor per op (~10 a layer,
// ~5 us each at one row, where the other thread spins).
template <typename KT>
at::Tensor mla_layer_q4(const MlaLayer& L, const at::Tensor& x, const at::Tensor& cos,
                        const at::Tensor& sin, const int64_t* sp, const RowTable& rt) {
  const int64_t T = x.size(0), H = x.size(1), Hh = L.heads, n = L.nope, p = L.rope, r = L.rank;
  const int64_t V = L.vdim, R = r + p, WQ = Hh * (n + p), QA = L.q_a_norm.numel();
  const bool lora = QA > 0, moe = L.router.defined();
  struct Lin {
    const uint8_t* w;
    int64_t tiles, tile_bytes, n;
    const float* bias;
  };
  std::vector<Lin> lin;
  for (size_t i = 0; i < L.weights.size(); ++i) {
    const at::Tensor& w = L.weights[i];
    check_packed("mla_layer", w, 3);
    lin.push_back({w.data_ptr<uint8_t>(), w.size(0), tile_bytes(w), L.rows[i],
                   L.biases[i].numel() ? L.biases[i].data_ptr<float>() : nullptr});
  }
  const size_t iq = lora ? 1 : 0, ikv = iq + 1, io = ikv + 1;
  TORCH_CHECK(lin[iq].n == WQ && lin[ikv].n == R && lin[io].n == H &&
                  L.weights[io].size(1) * kGroup == Hh * V,
              "mla_layer: the linears' widths do not make this layer");
  const int64_t I = moe ? L.w13.size(1) * kTile / 2 : lin[io + 1].n / 2;
  const int64_t E = moe ? L.router.size(0) : 0, K = moe ? L.top_k + L.shared : 0;
  const auto xc = x.contiguous();
  at::Tensor out = at::empty({T, H}, xc.options());
  // the workspace: (one per calling thread, kept between calls: see decode_layer_q4)
  // (the region's threads use the calling thread's: a thread_local named inside the region
  // would be each thread's own)
  static thread_local std::vector<float> ws;
  static thread_local QRows tl_q[7];
  QRows &xh = tl_q[0], &xa = tl_q[1], &xn = tl_q[2], &xl = tl_q[3], &xo = tl_q[4],
        &xs = tl_q[5], &hs = tl_q[6];
  const int64_t need = T * (3 * H + QA + WQ + R + r + Hh * (R + r + V) + E) +
                       (moe ? T * K * (I + H) : T * 3 * I);
  if (static_cast<int64_t>(ws.size()) < need) ws.resize(need);
  float* h = ws.data();
  float* qa = h + T * H;
  float* q = qa + T * QA;
  float* ckv = q + T * WQ;
  float* lat = ckv + T * R;
  float* qfull = lat + T * r;
  float* olat = qfull + T * Hh * R;
  float* o = olat + T * Hh * r;
  float* x1 = o + T * Hh * V;
  float* h2 = x1 + T * H;
  float* logits = h2 + T * H;
  float* mw_buf = logits + T * E;  // MoE: the experts' [pairs, I] then [pairs, H]; dense: gu, act
  xh.resize(T, H);
  if (lora) xa.resize(T, QA);
  xn.resize(T * Hh, n);
  xl.resize(T * Hh, r);
  xo.resize(T, Hh * V);
  xs.resize(T, H);
  if (!moe) hs.resize(T, I);
  std::vector<int64_t> rows(T);
  std::iota(rows.begin(), rows.end(), int64_t{0});
  const float* xp = xc.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* snp = sin.data_ptr<float>();
  const float e = static_cast<float>(L.eps), le = static_cast<float>(L.latent_eps);
  KT* pool = L.k.data_ptr<KT>();
  const int nt = threads();
  std::optional<MoeWeights> mw;
  if (moe) mw.emplace(L.w13, L.w2);
  MoePlan pl;
  std::vector<int64_t> ids(T * K);
  std::vector<float> wts(T * K);
  auto tiles = [&](size_t i, const QRows& a, float* y, const float* resid) {
    q4_tiles_omp(lin[i].w, lin[i].tile_bytes, lin[i].tiles, a, rows.data(), T, lin[i].n, y,
                 lin[i].bias, resid);
  };
#pragma omp parallel num_threads(nt)
  {
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; ++t) {
      rms_row(xp + t * H, L.ln1.data_ptr<float>(), e, H, h + t * H);
      xh.quantize(t, h + t * H);
    }
    if (lora) {
      tiles(0, xh, qa, nullptr);
#pragma omp for schedule(static)
      for (int64_t t = 0; t < T; ++t) {
        rms_row(qa + t * QA, L.q_a_norm.data_ptr<float>(), le, QA, qa + t * QA);
        xa.quantize(t, qa + t * QA);
      }
    }
    tiles(iq, lora ? xa : xh, q, nullptr);
    tiles(ikv, xh, ckv, nullptr);
    // the latent row [rms_norm(c) | rope(k_pe)] into the pool; q's nope parts quantized for
    // W_uk, its rope parts rotated into the query rows [q_lat | q_pe]
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; ++t) {
      const float* row = ckv + t * R;
      KT* dst = pool + sp[t] * R;
      rms_row(row, L.kv_norm.data_ptr<float>(), le, r, lat + t * r);
      for (int64_t i = 0; i < r; ++i) dst[i] = static_cast<KT>(lat[t * r + i]);
      rope_values(row + r, cp + t * p, snp + t * p, p, L.interleave, dst + r);
      for (int64_t hh = 0; hh < Hh; ++hh) {
        const float* qh = q + t * WQ + hh * (n + p);
        xn.quantize(t * Hh + hh, qh);
        rope_values(qh + n, cp + t * p, snp + t * p, p, L.interleave,
                    qfull + (t * Hh + hh) * R + r);
      }
    }
    heads_q4_omp(L.uk.data_ptr<uint8_t>(), L.uk.size(1), tile_bytes(L.uk), xn, T, Hh,
                 r, qfull, R);
    attend_rows_omp(qfull, static_cast<const KT*>(pool), static_cast<const KT*>(pool),
                    rt.table.data_ptr<int64_t>(), rt.row_of.data_ptr<int64_t>(),
                    rt.lens.data_ptr<int64_t>(), olat, T, Hh, 1, R, r, rt.L,
                    static_cast<float>(L.scale), nt, R);
    quantize_rows_omp(static_cast<const float*>(olat), T * Hh, r, xl);
    heads_q4_omp(L.uv.data_ptr<uint8_t>(), L.uv.size(1), tile_bytes(L.uv), xl, T, Hh,
                 V, o, V);
    quantize_rows_omp(static_cast<const float*>(o), T, Hh * V, xo);
    tiles(io, xo, x1, xp);
    norm_rows_omp(x1, L.ln2.data_ptr<float>(), e, T, H, h2, xs);
    if (!moe) {
      float* gu = mw_buf;
      float* act = gu + T * 2 * I;
      tiles(io + 1, xs, gu, nullptr);
#pragma omp for schedule(static)
      for (int64_t t = 0; t < T; ++t) {
        silu_row(gu + t * 2 * I, gu + t * 2 * I + I, I, act + t * I);
        hs.quantize(t, act + t * I);
      }
      tiles(io + 2, hs, out.data_ptr<float>(), x1);
    } else {
      const float* rp = L.router.data_ptr<float>();
#pragma omp for schedule(static)
      for (int64_t i = 0; i < T * E; ++i) logits[i] = router_logit(h2 + (i / E) * H, rp + (i % E) * H, H);
#pragma omp master
      {
        int64_t* counter = L.routed.data_ptr<int64_t>();
        for (int64_t t = 0; t < T; ++t) {
          route_row(L.rule, logits + t * E, ids.data() + t * K, wts.data() + t * K);
          for (int64_t j = 0; j < L.top_k; ++j) ++counter[ids[t * K + j]];
        }
        pl = moe_plan(ids.data(), wts.data(), T, K, L.w13.size(0), I / kTile, H / kTile,
                      omp_get_num_threads());
        hs.resize(pl.Pv, I);
      }
#pragma omp barrier
      moe_q4_omp(pl, *mw, xs, mw_buf, hs, mw_buf + T * K * I, out.data_ptr<float>(), x1,
                 omp_get_thread_num());
    }
  }
  return out;
}

// The op-by-op chain (any linears: GGUF blocks too), or mla_layer_q4.
template <typename KT>
at::Tensor mla_layer_impl(const MlaLayer& L, const at::Tensor& x, const at::Tensor& cos,
                          const at::Tensor& sin, const at::Tensor& slots,
                          const at::Tensor& table, const at::Tensor& row_of,
                          const at::Tensor& lens) {
  const int64_t T = x.size(0), Hh = L.heads, n = L.nope, p = L.rope, r = L.rank;
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
                  cos.numel() == T * p && sin.numel() == T * p && slots.numel() == T &&
                  slots.scalar_type() == at::kLong,
              "mla_layer: cos/sin fp32 [T, 1, p], slots int64 [T]");
  const int64_t* sp = checked_slots(slots, L.k.size(0));
  if (one_region(L) && T > 0) {
    const RowTable rt(table, row_of, lens);
    TORCH_CHECK(rt.lens.numel() == T, "mla_layer: row_of and lens [T]");
    return mla_layer_q4<KT>(L, x, cos.contiguous(), sin.contiguous(), sp, rt);
  }
  const auto h = rms_norm(x, L.ln1, L.eps);
  size_t li = 0;
  at::Tensor q;
  if (L.q_a_norm.numel() > 0) {
    const auto qa = L.linear(li++, h);
    q = L.linear(li++, rms_norm(qa, L.q_a_norm, L.latent_eps));
  } else {
    q = L.linear(li++, h);
  }
  const auto ckv = L.linear(li++, h).contiguous();  // [T, r + p]
  q = q.contiguous();                                 // [T, Hh (n + p)]
  TORCH_CHECK(q.size(1) == Hh * (n + p) && ckv.size(1) == r + p,
              "mla_layer: q / kv_a widths do not match the heads and the latent");
  // q's nope parts for the absorbed W_uk; the query row [q_lat | rope(q_pe)] per head; the
  // latent row [rms_norm(c) | rope(k_pe)] written to the pool at the row's slot.
  auto qn = at::empty({T, Hh, n}, x.options());
  auto qfull = at::empty({T, Hh, r + p}, x.options());
  const auto cc = cos.contiguous(), sc = sin.contiguous();
  {
    const float* qp = q.data_ptr<float>();
    const float* cp = ckv.data_ptr<float>();
    const float* kn = L.kv_norm.data_ptr<float>();
    float* qnp = qn.data_ptr<float>();
    float* qfp = qfull.data_ptr<float>();
    KT* pool = L.k.data_ptr<KT>();
    const float e = static_cast<float>(L.latent_eps);
    std::vector<float> lat(r);
    for (int64_t t = 0; t < T; ++t) {
      const float* cs = cc.data_ptr<float>() + t * p;
      const float* sn = sc.data_ptr<float>() + t * p;
      const float* row = cp + t * (r + p);
      KT* dst = pool + sp[t] * (r + p);
      rms_row(row, kn, e, r, lat.data());
      for (int64_t i = 0; i < r; ++i) dst[i] = static_cast<KT>(lat[i]);
      rope_values(row + r, cs, sn, p, L.interleave, dst + r);
      for (int64_t hh = 0; hh < Hh; ++hh) {
        const float* qh = qp + (t * Hh + hh) * (n + p);
        std::copy(qh, qh + n, qnp + (t * Hh + hh) * n);
        rope_values(qh + n, cs, sn, p, L.interleave, qfp + (t * Hh + hh) * (r + p) + r);
      }
    }
  }
  const auto q_lat = heads_q4(qn, L.uk, r);  // [T, Hh, r]
  qfull.slice(2, 0, r).copy_(q_lat);
  const auto o_lat = attend_rows(qfull, L.k, L.v, table, row_of, lens, L.scale);  // [T, Hh, r]
  const auto o = heads_q4(o_lat, L.uv, L.vdim);                                  // [T, Hh, v]
  const auto x1 = x + L.linear(li++, o.view({T, Hh * L.vdim}));
  const auto h2 = rms_norm(x1, L.ln2, L.eps);
  if (!L.router.defined()) return x1 + L.linear(li + 1, silu_mul_rows(L.linear(li, h2)));
  const auto logits = router_logits(h2, L.router);  // [T, E]
  const int64_t K = L.top_k + L.shared;
  auto ids = at::empty({T, K}, x.options().dtype(at::kLong));
  auto w = at::empty({T, K}, x.options());
  {
    const float* lp = logits.data_ptr<float>();
    int64_t* ip = ids.data_ptr<int64_t>();
    float* wp = w.data_ptr<float>();
    int64_t* counter = L.routed.data_ptr<int64_t>();
    const int64_t E = L.router.size(0);
    for (int64_t t = 0; t < T; ++t) {
      route_row(L.rule, lp + t * E, ip + t * K, wp + t * K);
      for (int64_t j = 0; j < L.top_k; ++j) ++counter[ip[t * K + j]];  // Experts.count
    }
  }
  return x1 + moe_q4(h2, ids, w, L.w13, L.w2, 0);
}

// The layer on x [T, H] fp32: the step's latent rows written to the layer's pool at `slots`,
// row t attending to the first lens[t] slots of table[row_of[t]] (attend_rows' arguments),
// the layer's routing added to its counters. Eager only: the schema does not declare those
// writes.
at::Tensor mla_layer(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                     const c10::intrusive_ptr<MlaLayer>& layer, const at::Tensor& slots,
                     const at::Tensor& table, const at::Tensor& row_of, const at::Tensor& lens) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && layer->k.defined(),
              "mla_layer: x fp32 [T, H] and a layer with its attention set");
  return layer->k.scalar_type() == at::kFloat
             ? mla_layer_impl<float>(*layer, x, cos, sin, slots, table, row_of, lens)
             : mla_layer_impl<at::Half>(*layer, x, cos, sin, slots, table, row_of, lens);
}

// A model's DeepSeek layers in order (LlamaModel._mla_stack), so that mla_stack runs a whole
// step's layers in one call: from Python, 24 calls of mla_layer cost ~0.4 ms of a ~10 ms
// batch-1 step of the DeepSeek-shaped model.
struct MlaStack : torch::CustomClassHolder {
  std::vector<c10::intrusive_ptr<MlaLayer>> layers;
  void add(c10::intrusive_ptr<MlaLayer> layer) { layers.push_back(std::move(layer)); }
  int64_t size() const { return static_cast<int64_t>(layers.size()); }
};

// mla_layer of every layer of `stack` on x, in order (eager only, as mla_layer).
at::Tensor mla_stack(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                     const c10::intrusive_ptr<MlaStack>& stack, const at::Tensor& slots,
                     const at::Tensor& table, const at::Tensor& row_of, const at::Tensor& lens) {
  at::Tensor h = x;
  for (const auto& layer : stack->layers)
    h = mla_layer(h, cos, sin, layer, slots, table, row_of, lens);
  return h;
}

}  // namespace

// DeepSeek's one-call layer, a fragment of ops.cpp's library.
KILN_LIBRARY_FRAGMENT(m) {
  m.class_<MlaLayer>("MlaLayer")
      .def(torch::init<>())
      .def("attention", &MlaLayer::attention)
      .def("moe", &MlaLayer::moe)
      .def("set_chain", [](const c10::intrusive_ptr<MlaLayer>& self, bool on) { self->chain = on; });
  m.def("mla_layer(Tensor x, Tensor cos, Tensor sin, "
        "__torch__.torch.classes." KILN_STR(KILN_NS) ".MlaLayer layer, Tensor slots, "
        "Tensor table, Tensor row_of, Tensor lens) -> Tensor");
  m.impl("mla_layer", c10::DispatchKey::CPU, &mla_layer);
  m.class_<MlaStack>("MlaStack")
      .def(torch::init<>())
      .def("add", &MlaStack::add)
      .def("size", &MlaStack::size);
  m.def("mla_stack(Tensor x, Tensor cos, Tensor sin, "
        "__torch__.torch.classes." KILN_STR(KILN_NS) ".MlaStack stack, Tensor slots, "
        "Tensor table, Tensor row_of, Tensor lens) -> Tensor");
  m.impl("mla_stack", c10::DispatchKey::CPU, &mla_stack);
}

}  // namespace KILN_NS
