// What kiln's kernel sources share beside simd.h, with no ATen: the int4 tiles' constants and
// activation rows (QRows), the row kernels of a decoder layer, the attention half of the
// one-region layers (AttnQ4) and the declarations one source calls in another. The sources
// that compute (q4_tiles.cpp, moe.cpp, attention.cpp) include only this and simd.h, so they
// compile in a fraction of an ATen source's time; the ATen-facing ops include ops.h on top.
//
// Threads: OpenMP, torch's thread count (a region's team; the thread governor lowers it while
// other processes hold a CPU: kiln/layers/kernels/threads.py). A function whose name ends in
// _omp is run by every thread of an enclosing parallel region (an orphaned `omp for`, implicit
// barrier at its end), so one region can chain several of them.

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "simd.h"

namespace at {
class Tensor;
}

namespace KILN_NS {

constexpr int64_t kGroup = 32;
constexpr int64_t kTile = 8;           // output rows per tile
constexpr int64_t kBlockBytes = 160;  // one (tile, group) block: codes, 8 scales, 8 mins
// The same block without its mins (GGUF Q4_0's symmetric blocks: min = -8 scale, taken from
// the scale in fp32 instead of read): 10% fewer bytes for a step to stream. A packed
// weight's last dimension says which it holds; tile_dot reads either.
constexpr int64_t kSymBlockBytes = 144;
// Activation rows per register block of the int4 tiles: AVX-512's 32 vector registers hold 8
// rows' sums and accumulators, AVX2's 16 hold 4 (more would spill).
constexpr int kMaxBlockRows = KILN_VNNI ? 8 : 4;

// torch's thread count, at least 1 (ops.cpp: ATen's)
int threads();

// Quantized activation rows: codes [rows, K], scale and sum [rows, K/32].
struct QRows {
  std::vector<int8_t> q;
  std::vector<float> d, sum;
  int64_t K = 0, G = 0;
  void resize(int64_t rows, int64_t k) {
    K = k;
    G = k / kGroup;
    q.resize(rows * K);
    d.resize(rows * G);
    sum.resize(rows * G);
  }
  // row r from K values at x (simd.h's quantize_row, per group of 32: codes, scales and the
  // floats' sums)
  template <typename T>
  void quantize(int64_t r, const T* x) {
    quantize_row(x, K, kGroup, q.data() + r * K, d.data() + r * G, sum.data() + r * G, nullptr,
                 nullptr, nullptr);
  }
  const int8_t* qrow(int64_t r) const { return q.data() + r * K; }
  const float* drow(int64_t r) const { return d.data() + r * G; }
  const float* srow(int64_t r) const { return sum.data() + r * G; }
};

// NT tiles (the second `st` bytes on) of the layout in q4_tiles.cpp against `n` activation rows
// of xs -> out[m]; next: the distance to the tiles the caller runs next (0: unknown).
// Instantiated in q4_tiles.cpp for NT = 1 and, on AVX-512, 2.
template <int NT = 1>
void tile_rows(const uint8_t* w, int64_t st, const QRows& xs, const int64_t* rows, int64_t n,
               typename Vec<NT>::F* out, int64_t next = 0);

// Items [a, a + len) as two halves in lockstep, for tile_pair's two weight streams: two(i, j)
// for the pairs (a + k, a + h + k), h = ceil(len / 2), then one(a + h - 1) when len is odd.
template <typename Two, typename One>
inline void in_two_halves(int64_t a, int64_t len, Two&& two, One&& one) {
  const int64_t h = (len + 1) / 2;
  for (int64_t k = 0; k < len / 2; ++k) two(a + k, a + h + k);
  if (len % 2) one(a + h - 1);
}

// Two one-row tile dot products in lockstep (q4_tiles.cpp; two weight streams): tile wa
// against row ra of xs -> oa, tile wb against row rb -> ob, the bits tile_rows gives each.
void tile_pair(const uint8_t* wa, const uint8_t* wb, int64_t tile_bytes, const QRows& xs,
               int64_t ra, int64_t rb, __m256& oa, __m256& ob);

// The tiles' epilogue: y = (dots + bias) + resid, in the order the eager layer adds them (the
// linear's output, then its bias, then the residual: `x + (lin(h) + b)`), each add one fp32 add
// of the same operands, so the bits match; bias / resid null: not added. `valid` < 8: the last,
// partial tile of the output row.
inline void store_tile(float* y, __m256 v, int64_t valid, const float* bias = nullptr,
                       const float* resid = nullptr) {
  if (valid >= kTile) {
    if (bias) v = _mm256_add_ps(v, _mm256_loadu_ps(bias));
    if (resid) v = _mm256_add_ps(_mm256_loadu_ps(resid), v);
    _mm256_storeu_ps(y, v);
  } else {
    alignas(32) float t[kTile];
    _mm256_store_ps(t, v);
    for (int64_t i = 0; i < valid; ++i) {
      float a = t[i];
      if (bias) a = a + bias[i];
      if (resid) a = resid[i] + a;
      y[i] = a;
    }
  }
}


// The tile loop of a q4 linear (q4_tiles.cpp), run by every thread of an enclosing region:
// y [M, n] (+ bias [n]) (+ resid [M, n]) for the quantized rows xs.
void q4_tiles_omp(const uint8_t* w, int64_t tile_bytes, int64_t NT, const QRows& xs,
                  const int64_t* rows, int64_t M, int64_t n, float* y, const float* bias,
                  const float* resid);

// heads_q4's loop (q4_tiles.cpp), in an enclosing region: one linear per head h, rows
// t * Hn + h of xs -> y + (t * Hn + h) * ys (n values; ys: the output rows' stride).
void heads_q4_omp(const uint8_t* w, int64_t NT, int64_t tile_bytes, const QRows& xs, int64_t T,
                  int64_t Hn, int64_t n, float* y, int64_t ys);

// e^x, 2^t with t = x log2(e) = n + f by a degree-6 polynomial in f (relative error ~2e-7);
// t clamped to [-126, 126] so 2^n is a normal float built in its exponent bits.
inline __m256 exp_vec(__m256 x) {
  __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.4426950408889634f));
  t = _mm256_min_ps(_mm256_max_ps(t, _mm256_set1_ps(-126.0f)), _mm256_set1_ps(126.0f));
  const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(t, n);
  __m256 p = _mm256_set1_ps(1.5403530393381606e-4f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.3333558146428443e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.6181291076284772e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.5504108664821580e-2f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.4022650695910071e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.9314718055994531e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n),
                                                       _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

inline __m256 silu_mul(__m256 g, __m256 u) {
  const __m256 one = _mm256_set1_ps(1.0f);
  const __m256 e = exp_vec(_mm256_sub_ps(_mm256_setzero_ps(), g));
  return _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, e)), u);
}

template <typename T>
void quantize_rows_omp(const T* x, int64_t rows, int64_t K, QRows& xs) {
#pragma omp for schedule(static)
  for (int64_t r = 0; r < rows; ++r) xs.quantize(r, x + r * K);
}

// ---- routing: a token's experts and weights from its router logits (moe.cpp)
// How the experts are picked (kiln/layers/router.py grouped_topk's `method`): the top k
// (softmax_topk, V2-Lite), or only from the best `topk_group` of `n_group` groups, a group
// scored by its best (V2) or the sum of its two best (V3's noaux_tc).
enum RouteMethod : int64_t { kGreedy = 0, kGroupLimited = 1, kNoauxTc = 2 };

// One MoE block's routing rule: router.py's softmax_topk (softmax scores, greedy, maybe
// renormalized) and grouped_topk (DeepSeek: sigmoid or softmax scores, the selection shifted by
// `bias` [E], groups, renormalized, scaled) are both this; then `shared` virtual experts E..
// (Experts.absorb_shared) with weight 1.
struct RouteRule {
  int64_t E = 0, top_k = 0, n_group = 1, topk_group = 1, method = kGreedy, shared = 0;
  bool sigmoid = false, renormalize = false;
  float scale = 1.0f;
  const float* bias = nullptr;
};

// One token's routing by `r`: logit [E] -> ids [top_k + shared], w [top_k + shared], the
// routed ones best first (ties to the lower id). Scalar code, a row from its own logits alone:
// the same bits at every ISA level, alone or in a batch. The one implementation: the one-call
// MoE and MLA layers and the eager layers' op (ops.cpp softmax_topk) all run it.
void route_row(const RouteRule& r, const float* logit, int64_t* ids, float* w);

// router.py's softmax_topk (route_row with softmax scores, greedy) of T rows of logits (row
// stride R) over their first E: ids, w [T, k]. The eager layers' op and the one-call MoE
// layers both route through it.
inline void softmax_topk_rows(const float* lp, int64_t T, int64_t R, int64_t E, int64_t k,
                              bool renormalize, int64_t* ids, float* w) {
  RouteRule r;
  r.E = E, r.top_k = k, r.renormalize = renormalize;
  for (int64_t t = 0; t < T; ++t) route_row(r, lp + t * R, ids + t * k, w + t * k);
}

// ---- the grouped MoE op's plan and work (moe.cpp)
// moe_q4's plan of one call: the (token, expert) pairs sorted by expert (a counting sort,
// stable), the active experts and each thread's range of work items (split_items).
struct MoePlan {
  std::vector<int64_t> offsets;    // [E + 1]: expert e's sorted rows are offsets[e]..[e + 1]
  std::vector<int64_t> token_of;   // sorted row -> its token
  std::vector<int64_t> slot_of;    // pair p = (token p / k, its (p % k)-th expert) -> sorted row
  std::vector<float> weight_of;    // sorted row -> its routing weight
  std::vector<int64_t> active, pair_rows, split1, split2;
  int64_t T = 0, k = 0, Pv = 0;    // Pv: the pairs run here
  int64_t per = 1;                 // tiles a work item (moe_units)
  // Every range of split1 and split2 starts at the same expert's first item: each range's
  // phase-2 items read only the rows of the experts its phase 1 ran (moe_q4_omp: no barrier
  // between the phases)
  bool same_experts = false;
};

// moe_q4's work items hold `per` tiles of an expert's matrix (the last maybe fewer): on AVX-512,
// when the experts average a full register block of rows (prefill), a pair, which an expert
// with that many rows runs as one 512-bit pair (tile_dot's NT = 2) and one with fewer as two
// single tiles in turn; otherwise (decode) one tile. (Pairs at 16 rows, ~2 an expert: 2%
// slower, the ranges coarser; at 256 rows 1.14x faster, Qwen3-MoE shape, Zen 4.)
inline int64_t moe_units(int64_t tiles, int64_t per) { return (tiles + per - 1) / per; }

// The plan of one call for T tokens' k pairs (ids at idp, -1: skipped; weights at wp) over E
// experts, it1 / it2: the tiles of gate (or up) and of down, nt: the team's threads.
MoePlan moe_plan(const int64_t* idp, const float* wp, int64_t T, int64_t k, int64_t E,
                 int64_t it1, int64_t it2, int nt);

// The experts' weights and the call's buffers, as moe_q4_omp reads them (the constructor is
// ops.cpp's: it reads the tensors).
struct MoeWeights {
  const uint8_t *w13, *w2;
  int64_t H, I, w13_expert, w13_tile, w2_expert, w2_tile;
  MoeWeights(const at::Tensor& a, const at::Tensor& b);
};

// moe_q4's work, run by every thread `tid` of an enclosing parallel region (moe.cpp)
void moe_q4_omp(const MoePlan& pl, const MoeWeights& mw, const QRows& xs, float* h, QRows& hs,
                float* o, float* y, const float* resid, int tid);

// ---- batch-invariant attention and the int8 head (attention.cpp)
// One fixed tree: (lanes 0-3 + 4-7), then pairs, then the last two.
inline float hsum8(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  x = _mm_add_ss(x, _mm_shuffle_ps(x, x, 1));
  return _mm_cvtss_f32(x);
}

constexpr int64_t kMaxHeadDim = 576;  // DeepSeek-V3's MLA latent row: 512 + 64

// attend_rows' body, run by every thread of an enclosing region of `nt` threads; vrow: elements
// from one slot's values to the next (0: Hk * Dv). T: float, c10::Half, c10::BFloat16.
template <typename T>
void attend_rows_omp(const float* q, const T* k, const T* v, const int64_t* table,
                     const int64_t* row_of, const int64_t* lens, float* out, int64_t Tn,
                     int64_t Hq, int64_t Hk, int64_t D, int64_t Dv, int64_t L, float scale,
                     int nt, int64_t vrow = 0);

// attend_rows_omp in a parallel region of its own
template <typename T>
void attend_rows_impl(const float* q, const T* k, const T* v, const int64_t* table,
                      const int64_t* row_of, const int64_t* lens, float* out, int64_t Tn,
                      int64_t Hq, int64_t Hk, int64_t D, int64_t Dv, int64_t L, float scale,
                      int64_t vrow);

// y [M, N] = x [M, K] @ (w * scale)^T, int8 w; S: float or c10::BFloat16
template <typename S>
void q8_linear_impl(const float* x, const int8_t* w, const S* scale, float* y, int64_t M,
                    int64_t N, int64_t K);

// ---------------------------------------------------------------- the rows of a decoder layer
// Each row's numbers come from its own row alone, in an order fixed by the row: none of these
// kernels mixes rows (the ops are layers.cpp's).

// y = w * (x * 1/sqrt(mean(x^2) + eps)), kiln/layers/norm.py's fp32 math: the sum of squares
// in 8 lanes by column mod 8 from 0, then hsum8's fixed tree.
inline void rms_row(const float* x, const float* w, float eps, int64_t H, float* y) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t c = 0; c < H; c += 8) {
    const __m256 v = _mm256_loadu_ps(x + c);
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  const float mean = hsum8(acc) / static_cast<float>(H);
  const __m256 inv = _mm256_set1_ps(1.0f / std::sqrt(mean + eps));
  for (int64_t c = 0; c < H; c += 8)
    _mm256_storeu_ps(y + c, _mm256_mul_ps(_mm256_loadu_ps(w + c),
                                          _mm256_mul_ps(_mm256_loadu_ps(x + c), inv)));
}

// One head of D values rotated: y = x * cos + cat(x2, x1) * sin_signed (RotaryEmbedding's
// signed sin: HF's rotate_half folded in).
// y: the query's fp32 rows, or a KV pool's (fp32 or fp16: the same floats, stored rounded).
template <typename T>
inline void rope_head(const float* x, const float* cs, const float* sn, int64_t D, T* y) {
  const int64_t half = D / 2;
  for (int64_t i = 0; i < half; i += 8) {
    const __m256 a = _mm256_loadu_ps(x + i), b = _mm256_loadu_ps(x + half + i);
    store8(y + i, _mm256_add_ps(_mm256_mul_ps(a, _mm256_loadu_ps(cs + i)),
                                _mm256_mul_ps(b, _mm256_loadu_ps(sn + i))));
    store8(y + half + i, _mm256_add_ps(_mm256_mul_ps(b, _mm256_loadu_ps(cs + half + i)),
                                       _mm256_mul_ps(a, _mm256_loadu_ps(sn + half + i))));
  }
}

// One row of qkv [(Hq + 2 Hk) D]: its q heads rotated into qd [Hq, D], its k heads rotated into
// the pool at kd [Hk, D], its v heads copied to vd (T: the pool's fp32 or fp16).
template <typename T>
inline void rope_row(const float* row, const float* cs, const float* sn, int64_t Hq, int64_t Hk,
                     int64_t D, float* qd, T* kd, T* vd) {
  for (int64_t h = 0; h < Hq; ++h) rope_head(row + h * D, cs, sn, D, qd + h * D);
  for (int64_t h = 0; h < Hk; ++h) rope_head(row + (Hq + h) * D, cs, sn, D, kd + h * D);
  const float* vs = row + (Hq + Hk) * D;
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(vd, vs, Hk * D * sizeof(float));
  } else {
    for (int64_t i = 0; i < Hk * D; i += 8) store8(vd + i, _mm256_loadu_ps(vs + i));
  }
}

// silu(g) * u of one row: g, u [I] -> y [I].
inline void silu_row(const float* g, const float* u, int64_t I, float* y) {
  for (int64_t c = 0; c < I; c += 8)
    _mm256_storeu_ps(y + c, silu_mul(_mm256_loadu_ps(g + c), _mm256_loadu_ps(u + c)));
}

// y = rms_norm(x) row by row, each row quantized into q as it is written: the one-call layers'
// norm before their MLP, run by every thread of an enclosing region (an orphaned `omp for`).
inline void norm_rows_omp(const float* x, const float* w, float eps, int64_t T, int64_t H,
                          float* y, QRows& q) {
#pragma omp for schedule(static)
  for (int64_t t = 0; t < T; ++t) {
    rms_row(x + t * H, w, eps, H, y + t * H);
    q.quantize(t, y + t * H);
  }
}

// A router's fp32 logits x [T, H] @ w [E, H]^T, each one FMA chain over H (8 lanes, then one
// fixed reduction): a row's logits do not depend on the other rows of the step (a GEMM's
// blocking does, and a flipped top-k choice changes a token's whole MoE output).
inline float router_logit(const float* x, const float* w, int64_t H) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t i = 0; i < H; i += 8) acc = _mm256_fmadd_ps(load8(x + i), load8(w + i), acc);
  return hsum(acc);
}

// The attention half of the one-region layers (decode_layer_q4, moe_layer_q4), whose qkv and o
// linears are q4 tiles: x1 = x + o(attend(rope(qk_norms(qkv(rms_norm(x)))))), the step's K/V
// written to the pools; `run` is called by every thread of the caller's parallel region (the
// stages separated by the implicit barriers of their `omp for` loops). The functions and their
// order are the eager layer's (rms_row, q4 tiles with the bias, rms_row per q/k head, rope_row,
// attend_rows, the o tiles with the bias and the residual): the same bits.
template <typename KT>
struct AttnQ4 {
  const float *x, *ln1, *cos, *sin;
  const float *qn = nullptr, *kn = nullptr;  // Qwen3's q/k norm weights [D], or none
  float eps, qk_eps, scale;
  const uint8_t *wqkv, *wo;
  int64_t qkv_tiles, qkv_tile_bytes, o_tiles, o_tile_bytes;
  const float *bqkv, *bo;
  KT *k, *v;
  const int64_t *slots, *table, *row_of, *lens, *rows;
  int64_t T, H, Hq, Hk, D, L;
  float *h, *qkv, *qb, *ctx, *x1;  // workspace rows: [T, H], [T, W], [T, Hq D] x 2, [T, H]
  QRows *xh, *xc;

  void run(int nt) const {
    const int64_t W = (Hq + 2 * Hk) * D;
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; ++t) {
      rms_row(x + t * H, ln1, eps, H, h + t * H);
      xh->quantize(t, h + t * H);
    }
    q4_tiles_omp(wqkv, qkv_tile_bytes, qkv_tiles, *xh, rows, T, W, qkv, bqkv, nullptr);
    if (qn != nullptr) {
      // each q and k head of each row one rms_row, in place (qk_norm_rows' calls)
#pragma omp for schedule(static)
      for (int64_t r = 0; r < T * (Hq + Hk); ++r) {
        const int64_t t = r / (Hq + Hk), hh = r % (Hq + Hk);
        float* head = qkv + t * W + hh * D;
        rms_row(head, hh < Hq ? qn : kn, qk_eps, D, head);
      }
    }
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; ++t)
      rope_row(qkv + t * W, cos + t * D, sin + t * D, Hq, Hk, D, qb + t * Hq * D,
               k + slots[t] * Hk * D, v + slots[t] * Hk * D);
    attend_rows_omp(qb, static_cast<const KT*>(k), static_cast<const KT*>(v), table, row_of,
                    lens, ctx, T, Hq, Hk, D, D, L, scale, nt);
    quantize_rows_omp(static_cast<const float*>(ctx), T, Hq * D, *xc);
    q4_tiles_omp(wo, o_tile_bytes, o_tiles, *xc, rows, T, H, x1, bo, x);
  }
};

}  // namespace KILN_NS
