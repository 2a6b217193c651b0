// kiln's single-kernel ops, the ATen side: each checks its tensors, takes their pointers and
// runs the compute of q4_tiles.cpp, moe.cpp, attention.cpp or kernels.h's row kernels
// (q4_linear, heads_q4, moe_q4, softmax_topk, attend_rows, q8_linear, rms_norm, silu_mul,
// rope_write, router_logits), or its own (pack_q4_blocks: GGUF Q4_0 / Q4_1 rows into the int4
// tiles; embed_rows: an embedding lookup on GGUF's legacy blocks). The one-call layers
// (layers.cpp) chain them; the library's registration closes this file.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <omp.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "ops.h"

namespace KILN_NS {

int threads() { return std::max(1, at::get_num_threads()); }

void check_packed(const char* name, const at::Tensor& p, int64_t dims) {
  TORCH_CHECK(p.dim() == dims && p.scalar_type() == at::kByte && p.is_contiguous() &&
                  (p.size(dims - 1) == kBlockBytes || p.size(dims - 1) == kSymBlockBytes),
              name, ": packed weight must be contiguous uint8 [..., N/8, K/32, 160 or 144]");
}

void check_x(const char* name, const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              name, ": x must be [M, K] float32 or bfloat16");
}


MoeWeights::MoeWeights(const at::Tensor& a, const at::Tensor& b)
    : w13(a.data_ptr<uint8_t>()), w2(b.data_ptr<uint8_t>()), H(a.size(2) * kGroup),
      I(a.size(1) * kTile / 2), w13_expert(a.size(1) * tile_bytes(a)), w13_tile(tile_bytes(a)),
      w2_expert(b.size(1) * tile_bytes(b)), w2_tile(tile_bytes(b)) {}

// y [M, n] = x [M, K] @ W^T, W in the layout above; y in x's dtype (fp32 accumulation).
at::Tensor q4_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n) {
  check_x("q4_linear", x);
  check_packed("q4_linear", packed, 3);
  const int64_t M = x.size(0), K = x.size(1), NT = packed.size(0);
  TORCH_CHECK(packed.size(1) * kGroup == K && NT * kTile >= n && (NT - 1) * kTile < n,
              "q4_linear: packed weight holds [", NT * kTile, ", ", packed.size(1) * kGroup,
              "], x has K = ", K, " and n = ", n);
  auto y = at::empty({M, n}, x.options().dtype(at::kFloat));
  if (M == 0) return y.to(x.scalar_type());
  const auto xc = x.contiguous();
  const uint8_t* w = packed.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  QRows xs;
  xs.resize(M, K);
  std::vector<int64_t> rows(M);
  for (int64_t i = 0; i < M; ++i) rows[i] = i;
  const int64_t tb = tile_bytes(packed);
#pragma omp parallel num_threads(threads())
  {
    if (x.scalar_type() == at::kFloat)
      quantize_rows_omp(xc.data_ptr<float>(), M, K, xs);
    else
      quantize_rows_omp(xc.data_ptr<at::BFloat16>(), M, K, xs);
    // (the implicit barrier of the `omp for` above: all rows are quantized past here)
    q4_tiles_omp(w, tb, NT, xs, rows.data(), M, n, yp, nullptr, nullptr);
  }
  return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}

// One linear per head in one call: y [T, Hn, n] with y[t, h] = W_h x[t, h], for x [T, Hn, K]
// and w [Hn, N/8, K/32, 160] (each head's weight in the tiles above, stacked). MLA's absorbed
// up-projections (kiln/models/deepseek.py: q_nope -> latent through W_uk^T, latent -> v through
// W_uv) are this: a batched matmul read them in fp32 (8x the bytes of these tiles) and paid
// ATen's batched-GEMM setup for one row (the DeepSeek-shaped benchmark model, 1 row: 81 us a
// call, 2 calls a layer). Items (head, tile) split statically, so each thread streams its
// heads' tiles in order; every (t, h) row is quantized and computed alone (batch-invariant).
at::Tensor heads_q4(const at::Tensor& x, const at::Tensor& w, int64_t n) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == at::kFloat, "heads_q4: x must be fp32 [T, H, K]");
  check_packed("heads_q4", w, 4);
  const int64_t T = x.size(0), Hn = x.size(1), K = x.size(2), NT = w.size(1);
  TORCH_CHECK(w.size(0) == Hn && w.size(2) * kGroup == K && NT * kTile >= n &&
                  (NT - 1) * kTile < n,
              "heads_q4: w holds ", w.size(0), " heads of [", NT * kTile, ", ",
              w.size(2) * kGroup, "], x is [", T, ", ", Hn, ", ", K, "] and n = ", n);
  auto y = at::empty({T, Hn, n}, x.options());
  if (T == 0) return y;
  const auto xc = x.contiguous();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const int64_t tb = tile_bytes(w);
  float* yp = y.data_ptr<float>();
  QRows xs;
  xs.resize(T * Hn, K);
#pragma omp parallel num_threads(threads())
  {
    quantize_rows_omp(xc.data_ptr<float>(), T * Hn, K, xs);
    heads_q4_omp(wp, NT, tb, xs, T, Hn, n, yp, n);
  }
  return y;
}

// GGUF Q4_0 / Q4_1 rows -> the tiles above (reference.pack_q4_blocks, byte for byte). A block's
// 16 code bytes are already a tile row's (byte j = q[j] | q[j + 16] << 4) and its fp16 scale
// (Q4_1: and min) move as they are; Q4_0's min is -8 d, exact in fp16 short of overflow, which
// rounds to inf as PyTorch's fp16 multiply does. raw [M, N, G * block_bytes] (rows of M
// matrices: a layer's experts, a view of the file's memory map), out [M, ceil(N/8), G, 160]
// (any matrix and tile strides: a slice of a stack), or [..., 144] for Q4_0: the blocks
// without their mins (kSymBlockBytes), which the kernels take from the scales. One pass over
// both, threads over (matrix, tile) so each writes its tiles in order: a 14 B model's 8.6 GB of
// experts in seconds, where PyTorch's strided copy of 16-byte pieces took 38 s of a 54 s start.
void pack_q4_blocks(const at::Tensor& raw, int64_t block_bytes, const at::Tensor& out) {
  TORCH_CHECK(block_bytes == 18 || block_bytes == 20,
              "pack_q4_blocks: block_bytes must be 18 (Q4_0) or 20 (Q4_1), got ", block_bytes);
  TORCH_CHECK(raw.dim() == 3 && raw.scalar_type() == at::kByte && raw.stride(2) == 1,
              "pack_q4_blocks: raw must be uint8 [M, N, row bytes] with contiguous rows");
  const int64_t bb = out.dim() == 4 ? out.size(3) : 0;
  TORCH_CHECK(out.dim() == 4 && out.scalar_type() == at::kByte &&
                  (bb == kBlockBytes || (bb == kSymBlockBytes && block_bytes == 18)) &&
                  out.stride(3) == 1 && out.stride(2) == bb,
              "pack_q4_blocks: out must be uint8 [M, tiles, groups, 160] (or 144 for Q4_0) with "
              "contiguous blocks");
  const int64_t M = raw.size(0), N = raw.size(1), NT = out.size(1), G = out.size(2);
  TORCH_CHECK(out.size(0) == M && raw.size(2) == G * block_bytes && NT == (N + kTile - 1) / kTile,
              "pack_q4_blocks: raw [", M, ", ", N, ", ", raw.size(2), "] does not fit out [",
              out.size(0), ", ", NT, ", ", G, ", ", bb, "]");
  const uint8_t* rp = raw.data_ptr<uint8_t>();
  uint8_t* op = out.data_ptr<uint8_t>();
  const int64_t rs0 = raw.stride(0), rs1 = raw.stride(1), os0 = out.stride(0), os1 = out.stride(1);
  const bool has_min = block_bytes == 20;
  const int64_t codes_at = has_min ? 4 : 2;
#pragma omp parallel for schedule(static) num_threads(threads())
  for (int64_t item = 0; item < M * NT; ++item) {
    const int64_t mi = item / NT, t = item % NT;
    const uint8_t* rows[kTile];
    for (int64_t r = 0; r < kTile; ++r)
      rows[r] = t * kTile + r < N ? rp + mi * rs0 + (t * kTile + r) * rs1 : nullptr;
    uint8_t* dst = op + mi * os0 + t * os1;
    for (int64_t g = 0; g < G; ++g, dst += bb) {
      uint16_t scale[kTile], mn[kTile];
      for (int64_t r = 0; r < kTile; ++r) {
        // the row's code bytes 4k..4k+3 go to lane r of vector k (bytes 32k + 4r)
        if (rows[r] == nullptr) {  // padding past N: zero codes, scale and min
          for (int k = 0; k < 4; ++k) std::memset(dst + 32 * k + 4 * r, 0, 4);
          scale[r] = mn[r] = 0;
          continue;
        }
        const uint8_t* b = rows[r] + g * block_bytes;
        for (int k = 0; k < 4; ++k) std::memcpy(dst + 32 * k + 4 * r, b + codes_at + 4 * k, 4);
        std::memcpy(&scale[r], b, 2);
        if (has_min)
          std::memcpy(&mn[r], b + 2, 2);
        else
          mn[r] = _cvtss_sh(_cvtsh_ss(scale[r]) * -8.0f, _MM_FROUND_TO_NEAREST_INT);
      }
      std::memcpy(dst + 128, scale, sizeof(scale));
      if (bb == kBlockBytes) std::memcpy(dst + 144, mn, sizeof(mn));
    }
  }
}

// One MoE layer's routed experts in one call.
//   x        [T, H] fp32 or bf16       the layer's input rows
//   ids      [T, k] int64              each token's experts (from the router); -1: a pair
//                                      whose expert runs in another pool (skipped)
//   weights  [T, k] fp32               their routing weights
//   w13      uint8 [E, 2I/8, H/32, 160]  gate rows 0..I-1 then up rows I..2I-1, per expert
//   w2       uint8 [E, H/8, I/32, 160]   down
//   num_threads  the OpenMP team's size; 0: torch's thread count (a pool of SplitExperts gets
//                its share of the cores, beside the other pool's team)
//   -> y [T, H] in x's dtype: sum_j weights[t, j] * down_e(silu(gate_e x_t) * up_e x_t)
// Each token's row is quantized to int8 once; then moe_plan and moe_q4_omp.
at::Tensor moe_q4(const at::Tensor& x, const at::Tensor& ids, const at::Tensor& weights,
                  const at::Tensor& w13, const at::Tensor& w2, int64_t num_threads) {
  check_x("moe_q4", x);
  check_packed("moe_q4 (w13)", w13, 4);
  check_packed("moe_q4 (w2)", w2, 4);
  const int64_t T = x.size(0), H = x.size(1), E = w13.size(0);
  const int64_t I = w13.size(1) * kTile / 2;
  TORCH_CHECK(ids.dim() == 2 && ids.size(0) == T && ids.scalar_type() == at::kLong,
              "moe_q4: ids [T, k] int64");
  TORCH_CHECK(weights.sizes() == ids.sizes() && weights.scalar_type() == at::kFloat,
              "moe_q4: weights [T, k] float32");
  TORCH_CHECK(w13.size(2) * kGroup == H && w2.size(0) == E && w2.size(1) * kTile == H &&
                  w2.size(2) * kGroup == I && I % kTile == 0 && H % kTile == 0,
              "moe_q4: w13 [E, 2I/8, H/32, 160] and w2 [E, H/8, I/32, 160] do not match x [T, ",
              H, "] (I = ", I, ")");
  auto y = at::empty({T, H}, x.options().dtype(at::kFloat));
  if (T == 0) return y.to(x.scalar_type());
  const auto xc = x.contiguous();
  const auto idc = ids.contiguous();
  const auto wc = weights.contiguous();
  const int nt = num_threads > 0 ? static_cast<int>(num_threads) : threads();
  const MoePlan pl = moe_plan(idc.data_ptr<int64_t>(), wc.data_ptr<float>(), T, ids.size(1), E,
                              I / kTile, H / kTile, nt);
  if (pl.Pv == 0) return at::zeros({T, H}, x.options());
  const MoeWeights mw(w13, w2);
  QRows xs, hs;
  xs.resize(T, H);
  hs.resize(pl.Pv, I);
  // (not zero-filled: every element is written before it is read; at prefill they are ~20 MB)
  std::unique_ptr<float[]> h(new float[pl.Pv * I]), o(new float[pl.Pv * H]);
  float* yp = y.data_ptr<float>();
#pragma omp parallel num_threads(nt)
  {
    if (x.scalar_type() == at::kFloat)
      quantize_rows_omp(xc.data_ptr<float>(), T, H, xs);
    else
      quantize_rows_omp(xc.data_ptr<at::BFloat16>(), T, H, xs);
    moe_q4_omp(pl, mw, xs, h.get(), hs, o.get(), yp, nullptr, omp_get_thread_num());
  }
  return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}

at::Tensor attend_rows(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       const at::Tensor& table, const at::Tensor& row_of, const at::Tensor& lens,
                       double scale) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat, "attend_rows: q must be fp32 [T, Hq, D]");
  // v: a pool of its own, or (MLA) a view of k's first Dv columns: each slot's heads
  // contiguous, slots at v.stride(0)
  TORCH_CHECK(k.dim() == 3 && v.dim() == 3 && k.is_contiguous() && v.stride(2) == 1 &&
                  (v.size(1) == 1 || v.stride(1) == v.size(2)) && v.size(0) == k.size(0) &&
                  v.size(1) == k.size(1) && k.scalar_type() == v.scalar_type() &&
                  (k.scalar_type() == at::kFloat || k.scalar_type() == at::kBFloat16 ||
                   k.scalar_type() == at::kHalf),
              "attend_rows: k must be contiguous fp32/bf16/fp16 [S, Hk, D], v [S, Hk, Dv] with "
              "each slot's heads contiguous");
  const int64_t Tn = q.size(0), Hq = q.size(1), D = q.size(2), Hk = k.size(1), Dv = v.size(2);
  TORCH_CHECK(k.size(2) == D && D % 8 == 0 && Dv % 8 == 0 && Hq % Hk == 0 &&
                  D <= kMaxHeadDim && Dv <= kMaxHeadDim,
              "attend_rows: head dims must match, be multiples of 8 and at most ", kMaxHeadDim);
  TORCH_CHECK(table.dim() == 2 && table.scalar_type() == at::kLong && row_of.numel() == Tn &&
                  lens.numel() == Tn,
              "attend_rows: table [R, L] int64, row_of and lens [T] int64");
  auto out = at::empty({Tn, Hq, Dv}, q.options());
  if (Tn == 0) return out;
  const auto qc = q.contiguous();
  const RowTable rt(table, row_of, lens);
  const auto& tc = rt.table;
  const int64_t L = rt.L;
  const int64_t* lp = rt.lens.data_ptr<int64_t>();
  const int64_t* rp = rt.row_of.data_ptr<int64_t>();
  auto run = [&](const auto* kp, const auto* vp) {
    attend_rows_impl(qc.data_ptr<float>(), kp, vp, tc.data_ptr<int64_t>(), rp, lp,
                     out.data_ptr<float>(), Tn, Hq, Hk, D, Dv, L, static_cast<float>(scale),
                     v.stride(0));
  };
  if (k.scalar_type() == at::kFloat)
    run(k.data_ptr<float>(), v.data_ptr<float>());
  else if (k.scalar_type() == at::kHalf)
    run(k.data_ptr<at::Half>(), v.data_ptr<at::Half>());
  else
    run(k.data_ptr<at::BFloat16>(), v.data_ptr<at::BFloat16>());
  return out;
}

at::Tensor q8_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "q8_linear: x must be fp32 [M, K]");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kChar && w.is_contiguous() &&
                  w.size(1) == x.size(1) && x.size(1) % 8 == 0,
              "q8_linear: w must be contiguous int8 [N, K] with K = x's, a multiple of 8");
  TORCH_CHECK(scale.dim() == 1 && scale.numel() == w.size(0) && scale.is_contiguous() &&
                  (scale.scalar_type() == at::kFloat || scale.scalar_type() == at::kBFloat16),
              "q8_linear: scale must be contiguous fp32/bf16 [N]");
  const int64_t M = x.size(0), N = w.size(0), K = x.size(1);
  auto y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const auto xc = x.contiguous();
  if (scale.scalar_type() == at::kFloat)
    q8_linear_impl(xc.data_ptr<float>(), w.data_ptr<int8_t>(), scale.data_ptr<float>(),
                   y.data_ptr<float>(), M, N, K);
  else
    q8_linear_impl(xc.data_ptr<float>(), w.data_ptr<int8_t>(), scale.data_ptr<at::BFloat16>(),
                   y.data_ptr<float>(), M, N, K);
  return y;
}

// Below this many elements in all a kernel runs on the calling thread (a parallel region's
// start and barrier cost more than a decode step's few rows).
constexpr int64_t kRowsParallel = 1 << 15;

// A KV pool's element type as the kernels take it: fp32 or fp16 (K and V alike).
bool kernel_pool(const at::Tensor& k, const at::Tensor& v) {
  return k.dim() == 3 && v.dim() == 3 && k.is_contiguous() && v.is_contiguous() &&
         k.sizes() == v.sizes() && k.scalar_type() == v.scalar_type() &&
         (k.scalar_type() == at::kFloat || k.scalar_type() == at::kHalf);
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat &&
                  w.numel() == x.size(1) && x.size(1) % 8 == 0,
              "rms_norm: x fp32 [M, H] with H a multiple of 8, weight fp32 [H]");
  const auto xc = x.contiguous(), wc = w.contiguous();
  auto y = at::empty_like(xc);
  const int64_t M = xc.size(0), H = xc.size(1);
  const float* xp = xc.data_ptr<float>();
  const float* wp = wc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const float e = static_cast<float>(eps);
#pragma omp parallel for num_threads(threads()) if (M * H >= kRowsParallel) schedule(static)
  for (int64_t r = 0; r < M; ++r) rms_row(xp + r * H, wp, e, H, yp + r * H);
  return y;
}

// silu(g) * u for gu = [g u] fp32 [M, 2I] -> [M, I] (the MoE kernel's silu_mul, exp_vec).
at::Tensor silu_mul_rows(const at::Tensor& gu) {
  TORCH_CHECK(gu.dim() == 2 && gu.scalar_type() == at::kFloat && gu.size(1) % 16 == 0,
              "silu_mul: gu must be fp32 [M, 2I] with I a multiple of 8");
  const auto gc = gu.contiguous();
  const int64_t M = gc.size(0), I = gc.size(1) / 2;
  auto y = at::empty({M, I}, gc.options());
  const float* gp = gc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
#pragma omp parallel for num_threads(threads()) if (M * I >= kRowsParallel) schedule(static)
  for (int64_t r = 0; r < M; ++r) silu_row(gp + r * 2 * I, gp + r * 2 * I + I, I, yp + r * I);
  return y;
}

// The step's K/V slots (contiguous int64), each checked to lie in a pool of S slots.
const int64_t* checked_slots(const at::Tensor& slots, int64_t S) {
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < slots.numel(); ++t)
    TORCH_CHECK(sp[t] >= 0 && sp[t] < S, "rope_write: slot ", sp[t], " outside the pool");
  return sp;
}

// A step's RoPE and K/V write in one pass: qkv fp32 [T, (Hq + 2 Hk) D], cos and signed sin
// [T, 1, D] (RotaryEmbedding.lookup); k rotated and v stored at slots [T] of the fp32 pools
// k, v [S, Hk, D]. Returns the rotated q [T, Hq, D].
at::Tensor rope_write(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                      at::Tensor k, at::Tensor v, const at::Tensor& slots, int64_t num_heads) {
  TORCH_CHECK(kernel_pool(k, v),
              "rope_write: pools must be contiguous fp32 or fp16 [S, Hk, D], K and V alike");
  const int64_t S = k.size(0), Hk = k.size(1), D = k.size(2), Hq = num_heads;
  TORCH_CHECK(qkv.dim() == 2 && qkv.scalar_type() == at::kFloat &&
                  qkv.size(1) == (Hq + 2 * Hk) * D && D % 16 == 0,
              "rope_write: qkv must be fp32 [T, (Hq + 2 Hk) * D], D a multiple of 16");
  const int64_t T = qkv.size(0);
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
                  cos.numel() == T * D && sin.numel() == T * D && slots.numel() == T &&
                  slots.scalar_type() == at::kLong,
              "rope_write: cos/sin fp32 [T, 1, D], slots int64 [T]");
  const auto xc = qkv.contiguous(), cc = cos.contiguous(), sc = sin.contiguous();
  const auto sl = slots.contiguous();
  auto q = at::empty({T, Hq, D}, qkv.options());
  const int64_t* sp = checked_slots(sl, S);
  const float* xp = xc.data_ptr<float>();
  const float* cp = cc.data_ptr<float>();
  const float* snp = sc.data_ptr<float>();
  float* qp = q.data_ptr<float>();
  const int64_t W = (Hq + 2 * Hk) * D;
  auto run = [&](auto* kp, auto* vp) {
#pragma omp parallel for num_threads(threads()) if (T * W >= kRowsParallel) schedule(static)
    for (int64_t t = 0; t < T; ++t)
      rope_row(xp + t * W, cp + t * D, snp + t * D, Hq, Hk, D, qp + t * Hq * D,
               kp + sp[t] * Hk * D, vp + sp[t] * Hk * D);
  };
  if (k.scalar_type() == at::kFloat)
    run(k.data_ptr<float>(), v.data_ptr<float>());
  else
    run(k.data_ptr<at::Half>(), v.data_ptr<at::Half>());
  return q;
}

// The q and k heads of a fused qkv [T, (Hq + 2 Hk) * D] normalized in place by rms_norm with
// the weights qn / kn [D] (Qwen3's q/k norms): the same call, on the same rows, as the eager
// attention makes (kiln/models/llama.py LlamaAttention), so both give the same bits.
void qk_norm_rows(at::Tensor& qkv, const at::Tensor& qn, const at::Tensor& kn, double eps,
                  int64_t Hq, int64_t Hk, int64_t D) {
  const int64_t T = qkv.size(0);
  auto heads = qkv.view({T, Hq + 2 * Hk, D});
  auto q = heads.narrow(1, 0, Hq), k = heads.narrow(1, Hq, Hk);
  q.copy_(rms_norm(q.reshape({T * Hq, D}), qn, eps).view({T, Hq, D}));
  k.copy_(rms_norm(k.reshape({T * Hk, D}), kn, eps).view({T, Hk, D}));
}

// router_logit (kernels.h) of every row and expert
at::Tensor router_logits(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1) &&
                  x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat &&
                  x.size(1) % 8 == 0,
              "router_logits: x fp32 [T, H], w fp32 [E, H], H a multiple of 8");
  const auto xc = x.contiguous(), wc = w.contiguous();
  const int64_t T = xc.size(0), H = xc.size(1), E = wc.size(0);
  auto y = at::empty({T, E}, xc.options());
  const float* xp = xc.data_ptr<float>();
  const float* wp = wc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
#pragma omp parallel for num_threads(threads()) if (T * E * H >= (1 << 16)) schedule(static)
  for (int64_t t = 0; t < T; ++t)
    for (int64_t e = 0; e < E; ++e) yp[t * E + e] = router_logit(xp + t * H, wp + e * H, H);
  return y;
}

// kiln/layers/router.py's softmax_topk (Qwen2/3-MoE, Mixtral) of every row: route_row, the
// routing the one-call MoE layers run, so eager and one-call layers pick the same experts
// with the same weights. logits fp32 [T, E] -> (weights fp32 [T, k], ids int64 [T, k]).
std::tuple<at::Tensor, at::Tensor> softmax_topk(const at::Tensor& logits, int64_t k,
                                                bool renormalize) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && k > 0 &&
                  k <= logits.size(1),
              "softmax_topk: logits fp32 [T, E], 0 < k <= E");
  const auto lc = logits.contiguous();
  const int64_t T = lc.size(0), E = lc.size(1);
  auto w = at::empty({T, k}, lc.options());
  auto ids = at::empty({T, k}, lc.options().dtype(at::kLong));
  softmax_topk_rows(lc.data_ptr<float>(), T, E, E, k, renormalize, ids.data_ptr<int64_t>(),
                    w.data_ptr<float>());
  return {w, ids};
}

// simd.h's prefetch distance (isa.py prefetch_ahead); returns the one it replaces
int64_t set_prefetch_ahead(int64_t bytes) {
  TORCH_CHECK(bytes >= 0 && bytes % 64 == 0, "set_prefetch_ahead: whole cache lines, >= 0");
  const int64_t was = g_prefetch_ahead;
  g_prefetch_ahead = bytes;
  return was;
}

// An embedding lookup on GGUF's legacy blocks: rows `ids` of raw [V, row bytes] (Q4_0, Q4_1,
// Q5_0, Q5_1 or Q8_0, ggml type ids 2, 3, 6, 7, 8) -> fp32 [n, dim], the values
// kiln/layers/kernels/formats.py's dequantize_blocks gives, bit for bit: min + q * d (Q4_0's
// min -8 d; Q5_0: (q - 16) * d, Q8_0: q * d). The product of an fp16 scale (11 significant
// bits) and a code (at most 8) is exact in fp32, so the add's is the one rounding, fused or
// not, as in PyTorch's addcmul. Why: dequantize_blocks is ~12 PyTorch ops a call, 100-160 us
// a decode step whatever its rows (2 cores, Zen 3), 1.5-3% of a c=1 step; this is 15-33 us.
at::Tensor embed_rows(const at::Tensor& raw, const at::Tensor& ids, int64_t type, int64_t dim) {
  int64_t bb = 0, codes = 0, high = -1, has_min = 0;  // block bytes, where codes / 5th bits are
  switch (type) {
    case 2: bb = 18, codes = 2; break;                            // Q4_0
    case 3: bb = 20, codes = 4, has_min = 1; break;               // Q4_1
    case 6: bb = 22, codes = 6, high = 2; break;                  // Q5_0
    case 7: bb = 24, codes = 8, high = 4, has_min = 1; break;     // Q5_1
    case 8: bb = 34, codes = 2; break;                            // Q8_0
    default: TORCH_CHECK(false, "embed_rows: type ", type, " is not Q4_0/Q4_1/Q5_0/Q5_1/Q8_0");
  }
  TORCH_CHECK(raw.dim() == 2 && raw.scalar_type() == at::kByte && raw.stride(1) == 1 &&
                  dim % kGroup == 0 && raw.size(1) == dim / kGroup * bb,
              "embed_rows: raw must be uint8 [V, ", dim / kGroup * bb, "] with contiguous rows");
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong, "embed_rows: ids int64 [n]");
  const auto ic = ids.contiguous();
  const int64_t n = ic.size(0), V = raw.size(0), G = dim / kGroup;
  at::Tensor out = at::empty({n, dim}, raw.options().dtype(at::kFloat));
  const int64_t* ip = ic.data_ptr<int64_t>();
  const uint8_t* rp = raw.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(ip[i] >= 0 && ip[i] < V, "embed_rows: id ", ip[i], " out of range [0, ", V, ")");
    const uint8_t* row = rp + ip[i] * raw.stride(0);
    for (int64_t g = 0; g < G; ++g) {
      const uint8_t* b = row + g * bb;
      uint16_t h16;
      std::memcpy(&h16, b, 2);
      const float d = _cvtsh_ss(h16);
      float mn = 0.0f;
      if (has_min) {
        std::memcpy(&h16, b + 2, 2);
        mn = _cvtsh_ss(h16);
      } else if (type == 2) {
        mn = d * -8.0f;  // exact
      }
      alignas(32) float q[kGroup];
      if (type == 8) {
        for (int j = 0; j < 32; ++j) q[j] = static_cast<float>(static_cast<int8_t>(b[codes + j]));
      } else {
        uint32_t qh = 0;
        if (high >= 0) std::memcpy(&qh, b + high, 4);
        for (int j = 0; j < 16; ++j) {
          q[j] = static_cast<float>((b[codes + j] & 0x0F) | ((qh >> j & 1) << 4));
          q[j + 16] = static_cast<float>((b[codes + j] >> 4) | ((qh >> (j + 16) & 1) << 4));
        }
        if (type == 6)
          for (int j = 0; j < 32; ++j) q[j] -= 16.0f;  // exact
      }
      float* y = op + i * dim + g * kGroup;
      const __m256 dv = _mm256_set1_ps(d), mv = _mm256_set1_ps(mn);
      for (int j = 0; j < 32; j += 8) {
        const __m256 p = _mm256_mul_ps(_mm256_load_ps(q + j), dv);
        _mm256_storeu_ps(y + j, (type == 6 || type == 8) ? p : _mm256_add_ps(mv, p));
      }
    }
  }
  return out;
}

// The library: torch.ops.kiln_<level>'s ops (layers.cpp's one-call layers and kquant.cpp's
// GGUF ops are fragments of it, registered where they are defined).
KILN_LIBRARY(m) {
  m.def("isa() -> str");
  m.def("q4_linear(Tensor x, Tensor packed, int n) -> Tensor");
  m.def("moe_q4(Tensor x, Tensor ids, Tensor weights, Tensor w13, Tensor w2, int threads=0) "
        "-> Tensor");
  m.def("attend_rows(Tensor q, Tensor k, Tensor v, Tensor table, Tensor row_of, Tensor lens, "
        "float scale) -> Tensor");
  m.def("q8_linear(Tensor x, Tensor w, Tensor scale) -> Tensor");
  m.def("softmax_topk(Tensor logits, int k, bool renormalize) -> (Tensor, Tensor)");
  m.def("heads_q4(Tensor x, Tensor w, int n) -> Tensor");
  m.def("pack_q4_blocks(Tensor raw, int block_bytes, Tensor(a!) out) -> ()");
  m.def("lora_add(Tensor(a!) out, Tensor x, Tensor a, Tensor bt, Tensor pieces, Tensor ranks, "
        "Tensor seg, Tensor local) -> ()");
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  m.def("silu_mul(Tensor gu) -> Tensor");
  m.def("rope_write(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) k, Tensor(b!) v, Tensor slots, "
        "int num_heads) -> Tensor");
  m.def("router_logits(Tensor x, Tensor w) -> Tensor");
  m.def("embed_rows(Tensor raw, Tensor ids, int type, int dim) -> Tensor");
  m.impl("isa", [] { return std::string(compiled_isa()); });
  m.def("set_prefetch_ahead(int bytes) -> int");
  m.impl("set_prefetch_ahead", &set_prefetch_ahead);
  m.impl("rms_norm", c10::DispatchKey::CPU, &rms_norm);
  m.impl("silu_mul", c10::DispatchKey::CPU, &silu_mul_rows);
  m.impl("rope_write", c10::DispatchKey::CPU, &rope_write);
  m.impl("router_logits", c10::DispatchKey::CPU, &router_logits);
  m.impl("softmax_topk", c10::DispatchKey::CPU, &softmax_topk);
  m.impl("lora_add", c10::DispatchKey::CPU, &lora_add);
  m.impl("q4_linear", c10::DispatchKey::CPU, &q4_linear);
  m.impl("moe_q4", c10::DispatchKey::CPU, &moe_q4);
  m.impl("attend_rows", c10::DispatchKey::CPU, &attend_rows);
  m.impl("q8_linear", c10::DispatchKey::CPU, &q8_linear);
  m.impl("heads_q4", c10::DispatchKey::CPU, &heads_q4);
  m.impl("pack_q4_blocks", c10::DispatchKey::CPU, &pack_q4_blocks);
  m.impl("embed_rows", c10::DispatchKey::CPU, &embed_rows);
}

}  // namespace KILN_NS
