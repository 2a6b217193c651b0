// kiln's CPU kernels, built once per machine by kiln/layers/cpu_kernels.py (see there why).
//
// decode_attention: one query token per sequence attending over its context in the paged KV
// pool, read in place through the sequence's slot list (no gathered copy of the context).
//
//   q      [B, Hq, D]    bf16
//   k, v   [S, Hk, D]    the layer's pool, bf16
//   slots  [B, L] int64  pool slot of each context position (masked positions: any value)
//   mask   [B, L] bool   position is part of the row's context
//   -> out [B, Hq, D] fp32: softmax(scale * q . k) @ v per query head
//      lse [B, Hq]    fp32: log of the softmax denominator (with its max): what a caller needs to
//                     merge this result with attention over other keys (cascade attention)
//
// One task per (sequence, KV head): the G = Hq / Hk query heads of that KV head share every K and
// V row read. Three passes over the row's context, each a short loop the CPU pipelines well:
//   1. scores: q . k with AVX512-BF16 dot products (vdpbf16ps) straight from the bf16 pool, so
//      a K row is never widened; products of two bf16 values are exact in fp32.
//   2. softmax: max, exp (a vectorized 2^x), sum, over the [G, L] scores of the task.
//   3. values: out += p * v, V rows widened to fp32 (a shift), fp32 accumulators in registers.
// inductor's fused loop for the same math (kiln.layers.attention.Attention._decode_fused)
// recomputes the query's RoPE for every key and reduces each dot product serially. At 16 rows x
// 256 positions on 2 Zen 5 cores this kernel measured 184 vs 600-660 us per layer with the pool
// in cache, ~300 vs ~520 us with it in DRAM (where reading the scattered rows bounds both).
//
// Built only where the compiler targets AVX512-BF16 and AVX512-VNNI (-march=native on such a
// CPU: every one with BF16 so far, Cooper Lake, Sapphire Rapids, Zen 4 and 5); elsewhere the
// library still loads and `supported()` says false, and kiln keeps PyTorch's paths.
// Threads: at::parallel_for, i.e. torch's own OpenMP pool.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <atomic>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512VNNI__)
#define KILN_HAVE_KERNELS 1
#include <immintrin.h>
#else
#define KILN_HAVE_KERNELS 0
#endif

namespace {

// The w4 layout's group (see the weight-only linears below); the op wrappers check against it
// in every build.
constexpr int64_t kW4Group = 32;
constexpr int64_t kW4GroupBytes = 320;

#if KILN_HAVE_KERNELS

constexpr int kMaxGroup = 16;  // query heads per KV head handled by one task

// e^x for a vector: 2^t with t = x log2(e) = n + f, |f| <= 1/2, 2^f by a degree-6 polynomial
// (relative error ~2e-7), scaled by 2^n with vscalefps. t is clamped to -150 so that -inf (a
// masked softmax score) gives 0, not NaN; past x ~ 88 the result overflows to inf.
inline __m512 exp_vec(__m512 x) {
  const __m512 t = _mm512_max_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.4426950408889634f)),
                                 _mm512_set1_ps(-150.0f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  // 2^f = e^(f ln2): Taylor coefficients ln2^k / k!
  __m512 p = _mm512_set1_ps(1.5403530393381606e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// Rows are scattered over the pool (one 2*D-byte row per position and head), so the hardware
// prefetcher cannot see them coming: fetch the row kPrefetch positions ahead. (A prefetch never
// faults, so the slot of a masked position needs no check.)
constexpr int64_t kPrefetch = 16;

inline void prefetch(const void* p, int64_t bytes) {
  for (int64_t off = 0; off < bytes; off += 64)
    _mm_prefetch(reinterpret_cast<const char*>(p) + off, _MM_HINT_T0);
}

// bf16 -> fp32 for 16 values: a bf16 is the top half of an fp32.
inline __m512 widen(const uint16_t* src) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

template <int D>
void decode_attention_impl(const uint16_t* q, const uint16_t* k, const uint16_t* v,
                           const int64_t* slots, const bool* mask, float* out, float* lse,
                           int64_t B, int64_t Hq, int64_t Hk, int64_t L, int64_t S, float scale,
                           std::atomic<bool>& bad_slot) {
  static_assert(D % 32 == 0, "head_dim must be a multiple of 32");
  constexpr int C = D / 32;  // 32-wide bf16 chunks of a row
  constexpr int W = D / 16;  // 16-wide fp32 chunks of a row
  const int64_t G = Hq / Hk;
  at::parallel_for(0, B * Hk, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(G * L);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / Hk, h = task % Hk;
      // A slot's heads lie side by side: the first head's task fetches them all, so the next
      // tasks (the same sequence's other heads, usually on this thread) find them in cache and
      // memory is read in whole, contiguous slot rows.
      const int64_t row_bytes = (h == 0 ? Hk : 1) * D * 2;
      const int64_t* srow = slots + b * L;
      const bool* mrow = mask + b * L;
      __m512bh qv[kMaxGroup][C];
      for (int64_t g = 0; g < G; ++g)
        for (int c = 0; c < C; ++c)
          qv[g][c] = (__m512bh)_mm512_loadu_si512(q + (b * Hq + h * G + g) * D + 32 * c);

      // 1. scores (masked positions: -inf)
      const float neg_inf = -std::numeric_limits<float>::infinity();
      for (int64_t l = 0; l < L; ++l) {
        if (!mrow[l]) {
          for (int64_t g = 0; g < G; ++g) scores[g * L + l] = neg_inf;
          continue;
        }
        if (srow[l] < 0 || srow[l] >= S) {  // never read outside the pool
          bad_slot.store(true, std::memory_order_relaxed);
          return;
        }
        if (l + kPrefetch < L) prefetch(k + (srow[l + kPrefetch] * Hk + h) * D, row_bytes);
        const uint16_t* kr = k + (srow[l] * Hk + h) * D;
        __m512bh kc[C];
        for (int c = 0; c < C; ++c) kc[c] = (__m512bh)_mm512_loadu_si512(kr + 32 * c);
        for (int64_t g = 0; g < G; ++g) {
          __m512 acc = _mm512_setzero_ps();
          for (int c = 0; c < C; ++c) acc = _mm512_dpbf16_ps(acc, qv[g][c], kc[c]);
          scores[g * L + l] = _mm512_reduce_add_ps(acc) * scale;
        }
      }

      // 2. softmax numerators in place, and each head's max and sum
      float row_max[kMaxGroup], row_sum[kMaxGroup];
      for (int64_t g = 0; g < G; ++g) {
        float* s = scores.data() + g * L;
        __m512 mx = _mm512_set1_ps(neg_inf);
        int64_t l = 0;
        for (; l + 16 <= L; l += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(s + l));
        float m = _mm512_reduce_max_ps(mx);
        for (; l < L; ++l) m = s[l] > m ? s[l] : m;
        row_max[g] = m;
        if (m == neg_inf) {  // no context at all (cannot happen for a real row)
          row_sum[g] = 0.0f;
          continue;
        }
        const __m512 mv = _mm512_set1_ps(m);
        __m512 sum = _mm512_setzero_ps();
        for (l = 0; l + 16 <= L; l += 16) {
          const __m512 e = exp_vec(_mm512_sub_ps(_mm512_loadu_ps(s + l), mv));
          _mm512_storeu_ps(s + l, e);
          sum = _mm512_add_ps(sum, e);
        }
        if (l < L) {
          const __mmask16 tail = static_cast<__mmask16>((1u << (L - l)) - 1u);
          const __m512 e = exp_vec(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, s + l), mv));
          _mm512_mask_storeu_ps(s + l, tail, e);
          sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(tail, e));
        }
        row_sum[g] = _mm512_reduce_add_ps(sum);
      }

      // 3. values
      __m512 acc[kMaxGroup][W];
      for (int64_t g = 0; g < G; ++g)
        for (int w = 0; w < W; ++w) acc[g][w] = _mm512_setzero_ps();
      for (int64_t l = 0; l < L; ++l) {
        if (!mrow[l]) continue;
        if (l + kPrefetch < L) prefetch(v + (srow[l + kPrefetch] * Hk + h) * D, row_bytes);
        const uint16_t* vr = v + (srow[l] * Hk + h) * D;
        __m512 vf[W];
        for (int w = 0; w < W; ++w) vf[w] = widen(vr + 16 * w);
        for (int64_t g = 0; g < G; ++g) {
          const __m512 p = _mm512_set1_ps(scores[g * L + l]);
          for (int w = 0; w < W; ++w) acc[g][w] = _mm512_fmadd_ps(p, vf[w], acc[g][w]);
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        const int64_t row = b * Hq + h * G + g;
        const float inv = row_sum[g] > 0.0f ? 1.0f / row_sum[g] : 0.0f;
        for (int w = 0; w < W; ++w)
          _mm512_storeu_ps(out + row * D + 16 * w, _mm512_mul_ps(acc[g][w], _mm512_set1_ps(inv)));
        lse[row] = row_sum[g] > 0.0f ? row_max[g] + std::log(row_sum[g]) : neg_inf;
      }
    }
  });
}


// ---------------------------------------------------------------------------------------------
// Weight-only quantized linears: y [M, N] bf16 = x [M, K] bf16 @ W^T, W read in its packed
// quantized form and never dequantized to memory. Decode steps (M = 1..32) are bound by the
// bytes of weight read at small M and by the dot products at larger M; PyTorch's int4/int8 CPU
// kernels reach ~14 GB/s at M = 1 and do not reuse a weight tile across rows.
//
// Both layouts put 16 output rows side by side, so one 512-bit register holds a pair of k for
// each of 16 rows: exactly the operand of vdpbf16ps, which adds a[2i]*b[2i] + a[2i+1]*b[2i+1]
// into fp32 lane i. x's pair (x[k], x[k+1]) is broadcast to all lanes.
//
// w4: uint8 [N/16, K/32, 320], per block of 16 rows and group of 32 k (GGUF Q4_0/Q4_1 groups):
//   256 bytes of codes: 8 quads of k, 32 bytes each; byte t of quad j holds
//     low nibble  q[n = t/2, k = 4j + t%2],  high nibble  q[n = t/2, k = 4j + 2 + t%2]
//   32 bytes: the 16 rows' scales d (fp16), 32 bytes: their mins m (fp16); w = d * q + m.
//   A code becomes the bf16 128 + q with one OR (0x4300 is 128.0; q fills the low mantissa
//   bits), exact. Per group the row sums P = sum (128 + q) x and S = sum x give
//   sum w x = d * P + (m - 128 d) * S, so the scale is applied once per group, in fp32.
// w8: int8 [N/16, K/2, 32]; byte t of pair j is q[n = t/2, k = 2j + t%2]; w = scale[n] * q.
//   int8 -> fp32 -> bf16 is exact (|q| <= 128 needs 8 significant bits). For M > 4 each tile
//   of rows is converted once into a bf16 scratch (L2) that all row tiles then read.


inline void store_bf16(uint16_t* dst, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), (__m256i)_mm512_cvtneps_pbh(v));
}

inline __m512bh bcast_pair(const uint16_t* x) {
  return (__m512bh)_mm512_set1_epi32(*reinterpret_cast<const int32_t*>(x));
}

constexpr int64_t kW4Ahead = 24;  // groups (of 320 bytes) ahead in each block's stream

// MT rows of x times NT blocks of 16 output rows. Each group's partial sums run in S chains
// (S = 2 when the tile has few accumulators): a vdpbf16ps must wait for the one before it on the
// same register, and at M = 1 one chain per block left the core waiting, not reading memory.
template <int MT, int NT>
inline void w4_tile(const uint16_t* x, int64_t K, const float* xsum, const uint8_t* w,
                    int64_t block_bytes, uint16_t* y, int64_t N) {
  constexpr int S = MT * NT < 8 ? 2 : 1;
  const int64_t G = K / kW4Group;
  const __m512i low = _mm512_set1_epi16(0x000F);
  const __m512i bias = _mm512_set1_epi16(0x4300);
  __m512 acc[MT][NT];
  for (int m = 0; m < MT; ++m)
    for (int b = 0; b < NT; ++b) acc[m][b] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m512 p[MT][NT][S];
    for (int m = 0; m < MT; ++m)
      for (int b = 0; b < NT; ++b)
        for (int c = 0; c < S; ++c) p[m][b][c] = _mm512_setzero_ps();
    // Software prefetch kW4Ahead groups ahead in each block's stream (past a block's end it
    // fetches the next block's start): the hardware prefetcher alone left M = 1 at about half
    // of the bandwidth that 2 cores can read here.
    for (int b = 0; b < NT; ++b)
      prefetch(w + b * block_bytes + (g + kW4Ahead) * kW4GroupBytes, kW4GroupBytes);
    for (int j = 0; j < 8; ++j) {
      __m512bh wa[NT], wb[NT];
      for (int b = 0; b < NT; ++b) {
        const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(w + b * block_bytes + g * kW4GroupBytes + 32 * j)));
        wa[b] = (__m512bh)_mm512_ternarylogic_epi32(v, low, bias, 0xEA);  // (v & low) | bias
        wb[b] = (__m512bh)_mm512_or_si512(_mm512_srli_epi16(v, 4), bias);
      }
      const int64_t k = g * kW4Group + 4 * j;
      for (int m = 0; m < MT; ++m) {
        const __m512bh xa = bcast_pair(x + m * K + k), xb = bcast_pair(x + m * K + k + 2);
        for (int b = 0; b < NT; ++b) {
          p[m][b][0] = _mm512_dpbf16_ps(p[m][b][0], wa[b], xa);
          p[m][b][S - 1] = _mm512_dpbf16_ps(p[m][b][S - 1], wb[b], xb);
        }
      }
    }
    for (int b = 0; b < NT; ++b) {
      const uint8_t* sm = w + b * block_bytes + g * kW4GroupBytes + 256;
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sm)));
      const __m512 mn =
          _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sm + 32)));
      const __m512 mb = _mm512_fnmadd_ps(d, _mm512_set1_ps(128.0f), mn);  // m - 128 d
      for (int m = 0; m < MT; ++m) {
        const __m512 pm = S == 2 ? _mm512_add_ps(p[m][b][0], p[m][b][S - 1]) : p[m][b][0];
        acc[m][b] = _mm512_fmadd_ps(pm, d, acc[m][b]);
        acc[m][b] = _mm512_fmadd_ps(_mm512_set1_ps(xsum[m * G + g]), mb, acc[m][b]);
      }
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int b = 0; b < NT; ++b) store_bf16(y + m * N + 16 * b, acc[m][b]);
}

// Sums of x over each group of 32 k: xsum [M, K/32] fp32.
void group_sums(const uint16_t* x, int64_t M, int64_t K, float* xsum) {
  for (int64_t i = 0; i < M * (K / kW4Group); ++i) {
    const uint16_t* src = x + i * kW4Group;
    xsum[i] = _mm512_reduce_add_ps(_mm512_add_ps(widen(src), widen(src + 16)));
  }
}

// All M rows for NT blocks, in row tiles of up to 4 (the first tile reads the weights from
// memory, the others find them in L1/L2).
template <int NT>
void w4_rows(const uint16_t* x, int64_t M, int64_t K, const float* xsum, const uint8_t* w,
             int64_t block_bytes, uint16_t* y, int64_t N) {
  const int64_t G = K / kW4Group;
  int64_t m = 0;
  for (; m + 4 <= M; m += 4)
    w4_tile<4, NT>(x + m * K, K, xsum + m * G, w, block_bytes, y + m * N, N);
  switch (M - m) {
    case 3: w4_tile<3, NT>(x + m * K, K, xsum + m * G, w, block_bytes, y + m * N, N); break;
    case 2: w4_tile<2, NT>(x + m * K, K, xsum + m * G, w, block_bytes, y + m * N, N); break;
    case 1: w4_tile<1, NT>(x + m * K, K, xsum + m * G, w, block_bytes, y + m * N, N); break;
    default: break;
  }
}

// Tasks of kTask blocks (M <= 2: 4 blocks, whose 4 weight streams keep more loads in flight;
// else 2, so that a 4-row tile's accumulators fit the registers).
template <int kTask>
void w4_tasks(const uint16_t* x, int64_t M, int64_t K, const float* xsum, const uint8_t* w,
              uint16_t* y, int64_t N) {
  const int64_t NB = N / 16, block_bytes = (K / kW4Group) * kW4GroupBytes;
  at::parallel_for(0, (NB + kTask - 1) / kTask, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      int64_t b = kTask * t;
      const int64_t last = std::min(NB, b + kTask);
      if (b + kTask <= last) {
        w4_rows<kTask>(x, M, K, xsum, w + b * block_bytes, block_bytes, y + 16 * b, N);
        continue;
      }
      for (; b < last; ++b)  // a short last task, block by block
        w4_rows<1>(x, M, K, xsum, w + b * block_bytes, block_bytes, y + 16 * b, N);
    }
  });
}

void w4_linear_impl(const uint16_t* x, const uint8_t* w, uint16_t* y, int64_t M, int64_t K,
                    int64_t N) {
  std::vector<float> xsum(M * (K / kW4Group));
  group_sums(x, M, K, xsum.data());
  if (M <= 2)
    w4_tasks<4>(x, M, K, xsum.data(), w, y, N);
  else
    w4_tasks<2>(x, M, K, xsum.data(), w, y, N);
}

// w4 at prefill sizes (w4a8_linear): x quantized to int8 and the weight's 4-bit codes used as
// the unsigned bytes of vpdpbusd, which adds four u8 x s8 products into each int32 lane: 64
// multiply-adds an instruction, twice vdpbf16ps's.
//
// x's scale: per row D = max |x| / 127, refined per group of 32 k by a power of two, 2^-t with
// t = floor(log2(max_row / max_group)) (<= 15): a group of small values keeps its resolution,
// within 2x of its own scale (llama.cpp's Q8_1 gives each group an fp16 scale). With
// P = sum q_w q_x (exact, < 2^16 in magnitude) per group,
//   sum w x = sum_g d_w D 2^-t P + m_w S        (S: the group's exact sum of x)
//           = D 2^-15 (sum_g d_w (P << (15 - t)) + m_w S 2^15 / D)
// The shift is an integer op, off the FMA ports that vpdpbusd also needs; an fp32 scale per
// group would cost one multiply there per int32 result (measured: 68% vs 76-78% of vpdpbusd's
// peak in the inner loop). A task first expands its blocks' codes into a scratch that the
// instruction reads as it is (per quad of k, 16 rows x 4 bytes, fp32 d and m after each group),
// then runs every row over it: at M = 512 the expansion is under 1% of the instructions.
constexpr int64_t kA8GroupBytes = 640;  // 8 quads x 64 bytes of codes, 16 fp32 d, 16 fp32 m
constexpr int kA8MaxShift = 15;

struct QuantizedRows {  // x [M, K] as above
  std::vector<int8_t> q;     // [M, K]
  std::vector<int32_t> sh;   // [M, G]: 15 - t
  std::vector<float> s;      // [M, G]: S 2^15 / D
  std::vector<float> scale;  // [M]: D 2^-15
};

QuantizedRows quantize_rows(const uint16_t* x, int64_t M, int64_t K) {
  const int64_t G = K / kW4Group;
  QuantizedRows r{std::vector<int8_t>(M * K), std::vector<int32_t>(M * G),
                  std::vector<float>(M * G), std::vector<float>(M)};
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> gmax(G);
    for (int64_t m = begin; m < end; ++m) {
      const uint16_t* xr = x + m * K;
      float rmax = 0.0f;
      for (int64_t g = 0; g < G; ++g) {
        const __m512 a = widen(xr + 32 * g), b = widen(xr + 32 * g + 16);
        gmax[g] = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
        rmax = std::max(rmax, gmax[g]);
      }
      const float inv = rmax > 0.0f ? 127.0f / rmax : 0.0f;
      r.scale[m] = std::ldexp(rmax / 127.0f, -kA8MaxShift);
      for (int64_t g = 0; g < G; ++g) {
        // (clamped: a NaN group would give ilogb's INT_MIN)
        const int t = gmax[g] > 0.0f ? std::clamp(std::ilogb(rmax / gmax[g]), 0, kA8MaxShift)
                                     : kA8MaxShift;
        const __m512 a = widen(xr + 32 * g), b = widen(xr + 32 * g + 16);
        const __m512 f = _mm512_set1_ps(std::ldexp(inv, t));
        // cvtps rounds to nearest even; |x| 127 2^t / max_row <= 127 (the saturating pack
        // guards the last ulp)
        int8_t* q = r.q.data() + m * K + 32 * g;
        _mm_storeu_si128(reinterpret_cast<__m128i*>(q),
                         _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(a, f))));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16),
                         _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(b, f))));
        r.sh[m * G + g] = kA8MaxShift - t;
        const float sum = _mm512_reduce_add_ps(_mm512_add_ps(a, b));
        r.s[m * G + g] = rmax > 0.0f ? sum / r.scale[m] : 0.0f;
      }
    }
  });
  return r;
}

// One block of 16 rows, all K, from w4's layout into the scratch layout. A quad's 32 bytes hold
// row r's codes in bytes 2r (k = 4j, 4j + 2) and 2r + 1 (k = 4j + 1, 4j + 3); widened to one
// 32-bit lane per row (b0 | b1 << 8), (v | v << 12) & 0x0F0F0F0F puts them in k order.
void a8_expand_block(const uint8_t* w, int64_t G, uint8_t* dst) {
  const __m512i nib = _mm512_set1_epi32(0x0F0F0F0F);
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* src = w + g * kW4GroupBytes;
    uint8_t* out = dst + g * kA8GroupBytes;
    for (int j = 0; j < 8; ++j) {
      const __m512i v = _mm512_cvtepu16_epi32(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 32 * j)));
      _mm512_storeu_si512(out + 64 * j,
                          _mm512_ternarylogic_epi32(v, _mm512_slli_epi32(v, 12), nib, 0xA8));
    }
    _mm512_storeu_ps(out + 512, _mm512_cvtph_ps(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 256))));
    _mm512_storeu_ps(out + 576, _mm512_cvtph_ps(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 288))));
  }
}

// MT rows times NT expanded blocks (block b at ws + b * wstride).
template <int MT, int NT>
inline void a8_tile(const QuantizedRows& x, int64_t m0, int64_t K, const uint8_t* ws,
                    int64_t wstride, uint16_t* y, int64_t N) {
  const int64_t G = K / kW4Group;
  const int8_t* qx = x.q.data() + m0 * K;
  const int32_t* sh = x.sh.data() + m0 * G;
  const float* sx = x.s.data() + m0 * G;
  __m512 acc[MT][NT];
  for (int m = 0; m < MT; ++m)
    for (int b = 0; b < NT; ++b) acc[m][b] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* wg = ws + g * kA8GroupBytes;
    __m512i p[MT][NT];
    for (int m = 0; m < MT; ++m)
      for (int b = 0; b < NT; ++b) p[m][b] = _mm512_setzero_si512();
    for (int j = 0; j < 8; ++j) {
      __m512i wv[NT];
      for (int b = 0; b < NT; ++b) wv[b] = _mm512_loadu_si512(wg + b * wstride + 64 * j);
      for (int m = 0; m < MT; ++m) {
        const __m512i xb =
            _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(qx + m * K + g * 32 + 4 * j));
        for (int b = 0; b < NT; ++b) p[m][b] = _mm512_dpbusd_epi32(p[m][b], wv[b], xb);
      }
    }
    for (int b = 0; b < NT; ++b) {
      const __m512 d = _mm512_loadu_ps(reinterpret_cast<const float*>(wg + b * wstride + 512));
      const __m512 mn = _mm512_loadu_ps(reinterpret_cast<const float*>(wg + b * wstride + 576));
      for (int m = 0; m < MT; ++m) {
        const __m512i shifted = _mm512_sllv_epi32(p[m][b], _mm512_set1_epi32(sh[m * G + g]));
        acc[m][b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(shifted), d, acc[m][b]);
        acc[m][b] = _mm512_fmadd_ps(_mm512_set1_ps(sx[m * G + g]), mn, acc[m][b]);
      }
    }
  }
  for (int m = 0; m < MT; ++m) {
    const __m512 rs = _mm512_set1_ps(x.scale[m0 + m]);
    for (int b = 0; b < NT; ++b) store_bf16(y + m * N + 16 * b, _mm512_mul_ps(acc[m][b], rs));
  }
}

template <int NT>
void a8_rows(const QuantizedRows& x, int64_t M, int64_t K, const uint8_t* ws, int64_t wstride,
             uint16_t* y, int64_t N) {
  constexpr int MT = 4;
  int64_t m = 0;
  for (; m + MT <= M; m += MT) a8_tile<MT, NT>(x, m, K, ws, wstride, y + m * N, N);
  for (; m < M; ++m) a8_tile<1, NT>(x, m, K, ws, wstride, y + m * N, N);
}

void w4a8_linear_impl(const uint16_t* x, const uint8_t* w, uint16_t* y, int64_t M, int64_t K,
                      int64_t N) {
  constexpr int NT = 3;  // 3 x 4 rows: 12 int32 and 12 fp32 accumulators
  const int64_t G = K / kW4Group, NB = N / 16, block_bytes = G * kW4GroupBytes;
  const int64_t wstride = G * kA8GroupBytes;
  const QuantizedRows xq = quantize_rows(x, M, K);
  at::parallel_for(0, (NB + NT - 1) / NT, 1, [&](int64_t begin, int64_t end) {
    std::vector<uint8_t> scratch(NT * wstride);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t b0 = NT * t, nb = std::min<int64_t>(NT, NB - b0);
      for (int64_t b = 0; b < nb; ++b)
        a8_expand_block(w + (b0 + b) * block_bytes, G, scratch.data() + b * wstride);
      uint16_t* yt = y + 16 * b0;
      if (nb == NT) {
        a8_rows<NT>(xq, M, K, scratch.data(), wstride, yt, N);
      } else {
        for (int64_t b = 0; b < nb; ++b)
          a8_rows<1>(xq, M, K, scratch.data() + b * wstride, wstride, yt + 16 * b, N);
      }
    }
  });
}

// int8 -> bf16 of one pair of k for 16 rows (32 bytes).
inline __m512bh w8_pair(const int8_t* src) {
  const __m512 lo = _mm512_cvtepi32_ps(
      _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src))));
  const __m512 hi = _mm512_cvtepi32_ps(
      _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 16))));
  return _mm512_cvtne2ps_pbh(hi, lo);
}

constexpr int64_t kW8Ahead = 4096;  // bytes ahead in each block's stream (see kW4Ahead)

// MT rows x NT blocks; the weight comes as int8 (kDirect) or as its bf16 scratch.
template <int MT, int NT, bool kDirect>
inline void w8_tile(const uint16_t* x, int64_t K, const int8_t* w8, const uint16_t* wbf,
                    int64_t block_pairs_stride, const float* scale, uint16_t* y, int64_t N) {
  __m512 acc[MT][NT];
  for (int m = 0; m < MT; ++m)
    for (int b = 0; b < NT; ++b) acc[m][b] = _mm512_setzero_ps();
  for (int64_t j = 0; j < K / 2; ++j) {
    __m512bh wv[NT];
    for (int b = 0; b < NT; ++b) {
      if constexpr (kDirect) {
        if ((j & 1) == 0)
          _mm_prefetch(reinterpret_cast<const char*>(w8 + b * block_pairs_stride + 32 * j) +
                           kW8Ahead, _MM_HINT_T0);
        wv[b] = w8_pair(w8 + b * block_pairs_stride + 32 * j);
      }
      else
        wv[b] = (__m512bh)_mm512_loadu_si512(wbf + b * block_pairs_stride + 32 * j);
    }
    for (int m = 0; m < MT; ++m) {
      const __m512bh xv = bcast_pair(x + m * K + 2 * j);
      for (int b = 0; b < NT; ++b) acc[m][b] = _mm512_dpbf16_ps(acc[m][b], wv[b], xv);
    }
  }
  for (int b = 0; b < NT; ++b) {
    const __m512 s = _mm512_loadu_ps(scale + 16 * b);
    for (int m = 0; m < MT; ++m) store_bf16(y + m * N + 16 * b, _mm512_mul_ps(acc[m][b], s));
  }
}

template <int NT, bool kDirect>
void w8_rows(const uint16_t* x, int64_t M, int64_t K, const int8_t* w8, const uint16_t* wbf,
             int64_t stride, const float* scale, uint16_t* y, int64_t N) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4)
    w8_tile<4, NT, kDirect>(x + m * K, K, w8, wbf, stride, scale, y + m * N, N);
  switch (M - m) {
    case 3: w8_tile<3, NT, kDirect>(x + m * K, K, w8, wbf, stride, scale, y + m * N, N); break;
    case 2: w8_tile<2, NT, kDirect>(x + m * K, K, w8, wbf, stride, scale, y + m * N, N); break;
    case 1: w8_tile<1, NT, kDirect>(x + m * K, K, w8, wbf, stride, scale, y + m * N, N); break;
    default: break;
  }
}

constexpr int64_t kW8TaskBlocks = 4;

void w8_linear_impl(const uint16_t* x, const int8_t* w, const float* scale, uint16_t* y,
                    int64_t M, int64_t K, int64_t N) {
  const int64_t NB = N / 16, block = 16 * K;  // bytes (= int8 values) per block
  const int64_t tasks = (NB + kW8TaskBlocks - 1) / kW8TaskBlocks;
  const bool direct = M <= 4;
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    std::vector<uint16_t> scratch(direct ? 0 : kW8TaskBlocks * block);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t b0 = kW8TaskBlocks * t, nb = std::min(kW8TaskBlocks, NB - b0);
      const int8_t* wb = w + b0 * block;
      uint16_t* yb = y + 16 * b0;
      const float* sb = scale + 16 * b0;
      if (direct) {  // 4 blocks at a time (4 weight streams, 4 independent sums per row)
        if (nb == kW8TaskBlocks) {
          w8_rows<kW8TaskBlocks, true>(x, M, K, wb, nullptr, block, sb, yb, N);
          continue;
        }
        for (int64_t b = 0; b < nb; ++b)
          w8_rows<1, true>(x, M, K, wb + b * block, nullptr, block, sb + 16 * b, yb + 16 * b, N);
        continue;
      }
      for (int64_t i = 0; i < nb * K / 2; ++i)
        _mm512_storeu_si512(scratch.data() + 32 * i, (__m512i)w8_pair(wb + 32 * i));
      int64_t b = 0;
      for (; b + 4 <= nb; b += 4)
        w8_rows<4, false>(x, M, K, nullptr, scratch.data() + b * block, block, sb + 16 * b,
                          yb + 16 * b, N);
      for (; b < nb; ++b)
        w8_rows<1, false>(x, M, K, nullptr, scratch.data() + b * block, block, sb + 16 * b,
                          yb + 16 * b, N);
    }
  });
}

// ---------------------------------------------------------------------------------------------
// prefill_attention: the queries of one prefill chunk attending causally over their sequence's
// context in the pool, which already holds the chunk's own K/V (the layer writes it first).
//
//   q      [T, Hq, D]  bf16   query t sits at position start + t
//   k, v   [S, Hk, D]  bf16   the layer's pool
//   slots  [L] int64          pool slot of context positions 0..L-1, L = start + T
//   -> out [T, Hq, D]  bf16
//
// Flash attention (FlashAttention-2's loop) on vdpbf16ps. PyTorch's CPU flash kernel reached
// ~50 GFLOPS here (6 ms per SmolLM2 layer at 512 causal tokens, a third of the prefill), and
// the masked form a prefix-cache hit needs is slower still.
//   1. The context's K and V are copied once per call into the two layouts vdpbf16ps reads
//      (per KV head, blocks of kKB keys): K as [D/2][kKB] pairs of dims, so one register holds
//      the pair (2i, 2i+1) of 16 keys; V as [kKB/2][D] pairs of keys, so one register holds two
//      keys' values of 16 dims. The copy is as big as the context, read from the scattered
//      pool once instead of once per query block.
//   2. One task per (KV head, block of kTQ query tokens): its rows are the tokens x the G
//      query heads sharing that KV head. Per key block: scores into an L1 tile (each q pair is
//      broadcast against 2 registers of keys), causal mask on the diagonal blocks only, the
//      online softmax (running max and sum per row, the output rescaled when the max grows),
//      then probabilities (rounded to bf16) times V into fp32 rows. Key blocks wholly after a
//      task's last query are never touched, so causal prefill does half the work.
//   3. Tasks go to the threads from a shared counter, largest (latest queries) first: causal
//      tasks differ in cost up to T / kTQ times.

constexpr int64_t kKB = 32;  // keys per block: two registers of scores per row
constexpr int64_t kTQ = 16;  // query tokens per task

// Scores of MR rows against one key block: S[r][0..31] = q_r . k_j (unscaled).
template <int MR, int D>
inline void qk_tile(const uint16_t* const* qrow, const uint32_t* kb, float* s) {
  __m512 acc[MR][2];
  for (int i = 0; i < MR; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
  for (int p = 0; p < D / 2; ++p) {
    const __m512bh k0 = (__m512bh)_mm512_loadu_si512(kb + p * kKB);
    const __m512bh k1 = (__m512bh)_mm512_loadu_si512(kb + p * kKB + 16);
    for (int i = 0; i < MR; ++i) {
      const __m512bh b = bcast_pair(qrow[i] + 2 * p);
      acc[i][0] = _mm512_dpbf16_ps(acc[i][0], b, k0);
      acc[i][1] = _mm512_dpbf16_ps(acc[i][1], b, k1);
    }
  }
  for (int i = 0; i < MR; ++i) {
    _mm512_storeu_ps(s + i * kKB, acc[i][0]);
    _mm512_storeu_ps(s + i * kKB + 16, acc[i][1]);
  }
}

// O[r] = alpha[r] * O[r] + P[r] @ V for MR rows (P: kKB bf16 per row, V: one packed block).
template <int MR, int D>
inline void pv_tile(const uint16_t* p, const float* alpha, const uint32_t* vb, float* o) {
  constexpr int W = D / 16;
  __m512 acc[MR][W];
  for (int i = 0; i < MR; ++i) {
    const __m512 a = _mm512_set1_ps(alpha[i]);
    for (int w = 0; w < W; ++w) acc[i][w] = _mm512_mul_ps(a, _mm512_loadu_ps(o + i * D + 16 * w));
  }
  for (int jp = 0; jp < kKB / 2; ++jp) {
    __m512bh vv[W];
    for (int w = 0; w < W; ++w) vv[w] = (__m512bh)_mm512_loadu_si512(vb + jp * D + 16 * w);
    for (int i = 0; i < MR; ++i) {
      const __m512bh b = bcast_pair(p + i * kKB + 2 * jp);
      for (int w = 0; w < W; ++w) acc[i][w] = _mm512_dpbf16_ps(acc[i][w], b, vv[w]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int w = 0; w < W; ++w) _mm512_storeu_ps(o + i * D + 16 * w, acc[i][w]);
}

inline void store_row(float* dst, __m512 v) { _mm512_storeu_ps(dst, v); }
inline void store_row(uint16_t* dst, __m512 v) { store_bf16(dst, v); }

// causal: query t sees positions <= start + t (a prefill chunk, L = start + T); otherwise every
// query sees all L keys (a cascade's shared prefix). lse (may be null): per (token, query head)
// log of the softmax denominator, with its max.
template <int D, typename OutT>
void flash_attention_impl(const uint16_t* q, const uint16_t* k, const uint16_t* v,
                          const int64_t* slots, OutT* out, float* lse, int64_t T, int64_t Hq,
                          int64_t Hk, int64_t L, bool causal, int64_t start, float scale) {
  constexpr int MQ = 6;  // score rows per register tile: 12 accumulators, 2 key registers
  constexpr int W = D / 16;
  constexpr int MV = W >= 16 ? 1 : 16 / W > 4 ? 4 : 16 / W;  // P @ V rows: MV * W accumulators
  constexpr int64_t block = kKB * D / 2;  // uint32 (bf16 pairs) per packed K or V block
  const int64_t G = Hq / Hk;
  const int64_t NB = (L + kKB - 1) / kKB;
  std::vector<uint32_t> kp(Hk * NB * block), vp(Hk * NB * block);
  at::parallel_for(0, Hk * NB, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t h = task / NB, nb = task % NB;
      uint32_t* kd = kp.data() + task * block;
      uint32_t* vd = vp.data() + task * block;
      for (int64_t j = 0; j < kKB; ++j) {
        const int64_t pos = nb * kKB + j;
        const uint32_t* kr = pos < L ? reinterpret_cast<const uint32_t*>(
                                           k + (slots[pos] * Hk + h) * D) : nullptr;
        for (int64_t p = 0; p < D / 2; ++p) kd[p * kKB + j] = kr ? kr[p] : 0u;
      }
      for (int64_t jp = 0; jp < kKB / 2; ++jp) {
        const int64_t pos = nb * kKB + 2 * jp;
        const uint16_t* v0 = pos < L ? v + (slots[pos] * Hk + h) * D : nullptr;
        const uint16_t* v1 = pos + 1 < L ? v + (slots[pos + 1] * Hk + h) * D : nullptr;
        for (int64_t d = 0; d < D; ++d)
          vd[jp * D + d] = (v0 ? v0[d] : 0u) | (static_cast<uint32_t>(v1 ? v1[d] : 0u) << 16);
      }
    }
  });

  // Query blocks of up to kTQ tokens, smaller when that leaves threads without tasks (a
  // cascade's 16 decode rows would be one block per head).
  const int64_t want = 4 * at::get_num_threads();
  const int64_t tq = std::clamp<int64_t>((T * Hk + want - 1) / want, 1, kTQ);
  const int64_t QB = (T + tq - 1) / tq;
  const int64_t R_max = tq * G;
  std::atomic<int64_t> next{0};
  const float neg_inf = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    std::vector<float> s(R_max * kKB), o(R_max * D), mx(R_max), alpha(R_max);
    std::vector<uint16_t> pr(R_max * kKB);
    std::vector<__m512> sum(R_max);
    std::vector<const uint16_t*> qrow(R_max);
    for (int64_t task; (task = next.fetch_add(1)) < Hk * QB;) {
      const int64_t qb = QB - 1 - task / Hk, h = task % Hk;  // latest (largest) blocks first
      const int64_t t0 = qb * tq, nt = std::min(tq, T - t0), R = nt * G;
      for (int64_t r = 0; r < R; ++r) {
        qrow[r] = q + ((t0 + r / G) * Hq + h * G + r % G) * D;
        mx[r] = neg_inf;
        sum[r] = _mm512_setzero_ps();
      }
      std::fill(o.begin(), o.begin() + R * D, 0.0f);
      // Keys visible to the task's first and last rows: blocks past the last are skipped,
      // blocks past the first need a mask.
      const int64_t first_sees = causal ? start + t0 + 1 : L;
      const int64_t last_sees = causal ? start + t0 + nt : L;
      const int64_t nkb = (last_sees + kKB - 1) / kKB;
      for (int64_t kb = 0; kb < nkb; ++kb) {
        const uint32_t* kblk = kp.data() + (h * NB + kb) * block;
        const uint32_t* vblk = vp.data() + (h * NB + kb) * block;
        int64_t r = 0;
        for (; r + MQ <= R; r += MQ) qk_tile<MQ, D>(qrow.data() + r, kblk, s.data() + r * kKB);
        switch (R - r) {
          case 5: qk_tile<5, D>(qrow.data() + r, kblk, s.data() + r * kKB); break;
          case 4: qk_tile<4, D>(qrow.data() + r, kblk, s.data() + r * kKB); break;
          case 3: qk_tile<3, D>(qrow.data() + r, kblk, s.data() + r * kKB); break;
          case 2: qk_tile<2, D>(qrow.data() + r, kblk, s.data() + r * kKB); break;
          case 1: qk_tile<1, D>(qrow.data() + r, kblk, s.data() + r * kKB); break;
          default: break;
        }
        // Online softmax. Every row sees position 0, so after block 0 its max is finite.
        const bool masked = kb * kKB + kKB > first_sees;
        const __m512 sc = _mm512_set1_ps(scale);
        for (r = 0; r < R; ++r) {
          __m512 s0 = _mm512_mul_ps(_mm512_loadu_ps(s.data() + r * kKB), sc);
          __m512 s1 = _mm512_mul_ps(_mm512_loadu_ps(s.data() + r * kKB + 16), sc);
          if (masked) {
            const int64_t visible = (causal ? start + t0 + r / G + 1 : L) - kb * kKB;
            const __mmask16 m0 = visible >= 16 ? 0xFFFF : visible <= 0 ? 0
                               : static_cast<__mmask16>((1u << visible) - 1u);
            const __mmask16 m1 = visible >= 32 ? 0xFFFF : visible <= 16 ? 0
                               : static_cast<__mmask16>((1u << (visible - 16)) - 1u);
            s0 = _mm512_mask_mov_ps(_mm512_set1_ps(neg_inf), m0, s0);
            s1 = _mm512_mask_mov_ps(_mm512_set1_ps(neg_inf), m1, s1);
          }
          const float m_new = std::max(mx[r], _mm512_reduce_max_ps(_mm512_max_ps(s0, s1)));
          const float a = std::exp(mx[r] - m_new);  // 0 on the first block (mx = -inf)
          mx[r] = m_new;
          alpha[r] = a;
          const __m512 mv = _mm512_set1_ps(m_new);
          const __m512 e0 = exp_vec(_mm512_sub_ps(s0, mv));
          const __m512 e1 = exp_vec(_mm512_sub_ps(s1, mv));
          sum[r] = _mm512_fmadd_ps(sum[r], _mm512_set1_ps(a), _mm512_add_ps(e0, e1));
          store_bf16(pr.data() + r * kKB, e0);
          store_bf16(pr.data() + r * kKB + 16, e1);
        }
        for (r = 0; r + MV <= R; r += MV)
          pv_tile<MV, D>(pr.data() + r * kKB, alpha.data() + r, vblk, o.data() + r * D);
        for (; r < R; ++r)
          pv_tile<1, D>(pr.data() + r * kKB, alpha.data() + r, vblk, o.data() + r * D);
      }
      for (int64_t r = 0; r < R; ++r) {
        const float total = _mm512_reduce_add_ps(sum[r]);
        const __m512 inv = _mm512_set1_ps(1.0f / total);
        const int64_t row = (t0 + r / G) * Hq + h * G + r % G;
        for (int w = 0; w < W; ++w)
          store_row(out + row * D + 16 * w,
                    _mm512_mul_ps(_mm512_loadu_ps(o.data() + r * D + 16 * w), inv));
        if (lse) lse[row] = mx[r] + std::log(total);
      }
    }
  });
}

// ---------------------------------------------------------------------------------------------
// decode_layer: one Llama decoder layer of a decode step (one token per row), in one call:
//
//   h = rmsnorm(x) ; qkv = h W_qkv ; rotate q, k ; write k, v to the pool
//   x += attention(q, pool) W_o ; h = rmsnorm(x) ; x += (silu(g) * u) W_down, [g u] = h W_gate_up
//
// What it replaces is the same layer as a torch.compile'd graph: at one row the graph's kernels
// take ~6 ms of a ~11 ms step and its calls, guards and per-op parallel regions ~2.4 ms more.
// Here the linears (w4/w8 above) and the attention (decode_attention, plus shared_attention
// for a cascade) are the parallel regions; the elementwise steps between them are short loops
// over the rows. Numerics: bf16 tensors between steps, as the graph has them; RMSNorm in fp32
// rounded to bf16 before its weight (the module's casts), RoPE and SiLU in fp32, rounded once.

struct PackedLinear {
  const uint8_t* w4 = nullptr;  // w4 layout, or
  const int8_t* w8 = nullptr;   // w8 layout with its per-row scale
  const float* scale = nullptr;
  int64_t n = 0, k = 0;
  void operator()(const uint16_t* x, uint16_t* y, int64_t M) const {
    if (w4)
      w4_linear_impl(x, w4, y, M, k, n);
    else
      w8_linear_impl(x, w8, scale, y, M, k, n);
  }
};

struct LayerArgs {
  const uint16_t *ln1, *ln2;  // RMSNorm weights [H] bf16
  float eps;
  PackedLinear qkv, o, gate_up, down;
  int64_t H, Hq, Hk, D, I;
};

inline __m512 bf16_round(__m512 v) {  // v rounded to bf16 and back
  return _mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
}

// y = w * bf16(x / rms(x)) for each of M rows of H (a multiple of 16).
void rmsnorm_rows(const uint16_t* x, const uint16_t* w, float eps, uint16_t* y, int64_t M,
                  int64_t H) {
  for (int64_t m = 0; m < M; ++m) {
    const uint16_t* xr = x + m * H;
    __m512 ss = _mm512_setzero_ps();
    for (int64_t i = 0; i < H; i += 16) {
      const __m512 v = widen(xr + i);
      ss = _mm512_fmadd_ps(v, v, ss);
    }
    const __m512 inv = _mm512_set1_ps(1.0f / std::sqrt(_mm512_reduce_add_ps(ss) / H + eps));
    for (int64_t i = 0; i < H; i += 16)
      store_bf16(y + m * H + i,
                 _mm512_mul_ps(widen(w + i), bf16_round(_mm512_mul_ps(widen(xr + i), inv))));
  }
}

// act = silu(g) * u for M rows of [g u] (2 * I values each; I a multiple of 16).
void silu_mul_rows(const uint16_t* gu, uint16_t* act, int64_t M, int64_t I) {
  for (int64_t b = 0; b < M; ++b)
    for (int64_t i = 0; i < I; i += 16) {
      // silu(g) = g / (1 + e^-g). e^-g may overflow to inf for g < -88: then g / inf = -0,
      // silu's limit. The reciprocal's 2^-14 relative error is far below bf16's 2^-9.
      const __m512 g = widen(gu + b * 2 * I + i), u = widen(gu + b * 2 * I + I + i);
      const __m512 e = exp_vec(_mm512_sub_ps(_mm512_setzero_ps(), g));
      const __m512 sig = _mm512_rcp14_ps(_mm512_add_ps(_mm512_set1_ps(1.0f), e));
      store_bf16(act + b * I + i, _mm512_mul_ps(_mm512_mul_ps(g, sig), u));
    }
}

// x += y, in place, M * H values.
void add_rows(uint16_t* x, const uint16_t* y, int64_t count) {
  for (int64_t i = 0; i < count; i += 16)
    store_bf16(x + i, _mm512_add_ps(widen(x + i), widen(y + i)));
}

// One head of D values: x * cos + rotate_half(x) * sin_signed (sin carries rotate_half's sign).
template <int D>
inline void rope_head(const uint16_t* x, const uint16_t* cos, const uint16_t* sin, uint16_t* y) {
  constexpr int W = D / 16, half = W / 2;  // D/2 is a multiple of 16: whole registers swap
  __m512 v[W];
  for (int w = 0; w < W; ++w) v[w] = widen(x + 16 * w);
  for (int w = 0; w < W; ++w)
    store_bf16(y + 16 * w, _mm512_fmadd_ps(v[w], widen(cos + 16 * w),
                                           _mm512_mul_ps(v[(w + half) % W], widen(sin + 16 * w))));
}

// RoPE and the K/V write for T tokens (the eager steps' rope_write, and decode_layer's rows):
// per token, q's and k's heads rotated (rope_head, fp32, one rounding), q's into q [T, Hq, D],
// k's and v's rows stored at the token's pool slot (checked by the caller). PyTorch spends 6
// ops on it (two muls, a cat, an add, two index_copy_), ~1 ms a layer at 512 tokens.
template <int D>
void rope_write_impl(const uint16_t* qkv, const uint16_t* cos, const uint16_t* sin,
                     uint16_t* kpool, uint16_t* vpool, const int64_t* slots, uint16_t* q,
                     int64_t T, int64_t Hq, int64_t Hk) {
  const int64_t row = (Hq + 2 * Hk) * D;
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const uint16_t* x = qkv + t * row;
      const uint16_t *c = cos + t * D, *sn = sin + t * D;
      for (int64_t h = 0; h < Hq; ++h) rope_head<D>(x + h * D, c, sn, q + (t * Hq + h) * D);
      for (int64_t h = 0; h < Hk; ++h) {
        rope_head<D>(x + (Hq + h) * D, c, sn, kpool + (slots[t] * Hk + h) * D);
        std::copy_n(x + (Hq + Hk + h) * D, D, vpool + (slots[t] * Hk + h) * D);
      }
    }
  });
}

template <int D>
at::Tensor decode_layer_impl(const LayerArgs& a, const at::Tensor& x, const uint16_t* cos,
                             const uint16_t* sin, uint16_t* kpool, uint16_t* vpool, int64_t S,
                             const int64_t* slot_mapping, const int64_t* gather, const bool* mask,
                             int64_t L, const int64_t* shared, int64_t P, float scale) {
  const int64_t B = x.size(0), H = a.H, Hq = a.Hq, Hk = a.Hk, I = a.I;
  const int64_t QKV = (Hq + 2 * Hk) * D;
  auto out = x.clone();  // the residual stream, updated in place
  uint16_t* xs = reinterpret_cast<uint16_t*>(out.data_ptr());
  std::vector<uint16_t> h(B * H), qkv(B * QKV), q(B * Hq * D), attn(B * Hq * D),
      gu(B * 2 * I), act(B * I);
  // attention
  rmsnorm_rows(xs, a.ln1, a.eps, h.data(), B, H);
  a.qkv(h.data(), qkv.data(), B);
  rope_write_impl<D>(qkv.data(), cos, sin, kpool, vpool, slot_mapping, q.data(), B, Hq, Hk);
  std::vector<float> o(B * Hq * D), lse(B * Hq);
  std::atomic<bool> bad_slot{false};
  decode_attention_impl<D>(q.data(), kpool, vpool, gather, mask, o.data(), lse.data(), B, Hq,
                           Hk, L, S, scale, bad_slot);
  TORCH_CHECK(!bad_slot.load(), "decode_layer: a slot lies outside the pool of ", S);
  if (P > 0) {  // cascade: the shared prefix once for all rows, merged by log-sum-exp
    std::vector<float> os(B * Hq * D), lses(B * Hq);
    flash_attention_impl<D, float>(q.data(), kpool, vpool, shared, os.data(), lses.data(), B,
                                   Hq, Hk, P, false, 0, scale);
    for (int64_t r = 0; r < B * Hq; ++r) {
      const float top = std::max(lse[r], lses[r]);
      const float w = std::exp(lse[r] - top), ws = std::exp(lses[r] - top);
      const __m512 wv = _mm512_set1_ps(w / (w + ws)), wsv = _mm512_set1_ps(ws / (w + ws));
      for (int64_t d = 0; d < D; d += 16)
        _mm512_storeu_ps(o.data() + r * D + d,
                         _mm512_fmadd_ps(_mm512_loadu_ps(o.data() + r * D + d), wv,
                                         _mm512_mul_ps(_mm512_loadu_ps(os.data() + r * D + d),
                                                       wsv)));
    }
  }
  for (int64_t i = 0; i < B * Hq * D; i += 16) store_bf16(attn.data() + i, _mm512_loadu_ps(&o[i]));
  a.o(attn.data(), h.data(), B);
  add_rows(xs, h.data(), B * H);
  // MLP
  rmsnorm_rows(xs, a.ln2, a.eps, h.data(), B, H);
  a.gate_up(h.data(), gu.data(), B);
  silu_mul_rows(gu.data(), act.data(), B, I);
  a.down(act.data(), h.data(), B);
  add_rows(xs, h.data(), B * H);
  return out;
}

#endif  // KILN_HAVE_KERNELS

bool supported() { return KILN_HAVE_KERNELS; }

#if KILN_HAVE_KERNELS
// f(std::integral_constant<int, D>{}) for the head dims the kernels are instantiated for.
template <typename F>
void for_head_dim(const char* name, int64_t D, F&& f) {
  switch (D) {
    case 64: f(std::integral_constant<int, 64>{}); break;
    case 96: f(std::integral_constant<int, 96>{}); break;
    case 128: f(std::integral_constant<int, 128>{}); break;
    case 256: f(std::integral_constant<int, 256>{}); break;
    default: TORCH_CHECK(false, name, ": head_dim ", D, " (64, 96, 128 or 256)");
  }
}
#endif

std::tuple<at::Tensor, at::Tensor> decode_attention(const at::Tensor& q, const at::Tensor& k,
                                                    const at::Tensor& v, const at::Tensor& slots,
                                                    const at::Tensor& mask, double scale) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3,
              "decode_attention: q [B, Hq, D], k/v [S, Hk, D]");
  TORCH_CHECK(k.sizes() == v.sizes() && q.size(2) == k.size(2) && q.size(1) % k.size(1) == 0 &&
                  q.size(1) / k.size(1) <= 16,
              "decode_attention: mismatched head shapes");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 &&
                  v.scalar_type() == at::kBFloat16,
              "decode_attention: bf16 q, k and v");
  TORCH_CHECK(slots.scalar_type() == at::kLong && mask.scalar_type() == at::kBool &&
                  slots.dim() == 2 && slots.sizes() == mask.sizes() && slots.size(0) == q.size(0),
              "decode_attention: slots int64 [B, L] and mask bool [B, L]");
  TORCH_CHECK(k.is_contiguous() && v.is_contiguous(), "decode_attention: contiguous pools");
  const auto qc = q.contiguous();
  const auto sc = slots.contiguous();
  const auto mc = mask.contiguous();
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2), Hk = k.size(1), L = slots.size(1);
  auto out = at::empty({B, Hq, D}, q.options().dtype(at::kFloat));
  auto lse = at::empty({B, Hq}, q.options().dtype(at::kFloat));
#if KILN_HAVE_KERNELS
  std::atomic<bool> bad_slot{false};
  auto args = [&](auto impl) {
    impl(reinterpret_cast<const uint16_t*>(qc.data_ptr()),
         reinterpret_cast<const uint16_t*>(k.data_ptr()),
         reinterpret_cast<const uint16_t*>(v.data_ptr()), sc.data_ptr<int64_t>(),
         mc.data_ptr<bool>(), out.data_ptr<float>(), lse.data_ptr<float>(), B, Hq, Hk, L,
         k.size(0), static_cast<float>(scale), bad_slot);
  };
  for_head_dim("decode_attention", D,
               [&](auto d) { args(decode_attention_impl<decltype(d)::value>); });
  TORCH_CHECK(!bad_slot.load(), "decode_attention: a slot lies outside the pool of ", k.size(0));
#else
  TORCH_CHECK(false, "decode_attention: built without AVX512-BF16");
#endif
  return {out, lse};
}


// slots: int64 [L], every one inside a pool of S slots (so no kernel reads outside it);
// returns them contiguous.
at::Tensor check_slots(const char* name, const at::Tensor& slots, int64_t S) {
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1, name, ": slots int64 [L]");
  auto sc = slots.contiguous();
  const int64_t* sp = sc.data_ptr<int64_t>();
  for (int64_t i = 0; i < sc.size(0); ++i)
    TORCH_CHECK(sp[i] >= 0 && sp[i] < S, name, ": slot ", sp[i], " lies outside the pool of ", S);
  return sc;
}

// Checks shared by prefill_attention and shared_attention; returns the contiguous slots.
at::Tensor check_flash_args(const char* name, const at::Tensor& q, const at::Tensor& k,
                            const at::Tensor& v, const at::Tensor& slots) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, name, ": q [T, Hq, D], k/v [S, Hk, D]");
  TORCH_CHECK(k.sizes() == v.sizes() && q.size(2) == k.size(2) && q.size(1) % k.size(1) == 0,
              name, ": mismatched head shapes");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 &&
                  v.scalar_type() == at::kBFloat16,
              name, ": bf16 q, k and v");
  TORCH_CHECK(k.is_contiguous() && v.is_contiguous(), name, ": contiguous pools");
  auto sc = check_slots(name, slots, k.size(0));
  const int64_t D = q.size(2);
  TORCH_CHECK(D == 64 || D == 96 || D == 128 || D == 256, name, ": head_dim ", D,
              " (64, 96, 128 or 256)");
  return sc;
}

template <typename OutT>
void run_flash(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
               const at::Tensor& slots, OutT* out, float* lse, bool causal, int64_t start,
               double scale) {
#if KILN_HAVE_KERNELS
  const auto qc = q.contiguous();
  const int64_t T = q.size(0), Hq = q.size(1), Hk = k.size(1), L = slots.size(0);
  if (T == 0) return;
  auto args = [&](auto impl) {
    impl(reinterpret_cast<const uint16_t*>(qc.data_ptr()),
         reinterpret_cast<const uint16_t*>(k.data_ptr()),
         reinterpret_cast<const uint16_t*>(v.data_ptr()), slots.data_ptr<int64_t>(), out, lse,
         T, Hq, Hk, L, causal, start, static_cast<float>(scale));
  };
  for_head_dim("flash_attention", q.size(2),
               [&](auto d) { args(flash_attention_impl<decltype(d)::value, OutT>); });
#else
  TORCH_CHECK(false, "flash attention: built without AVX512-BF16");
#endif
}

at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const at::Tensor& slots, int64_t start, double scale) {
  const auto sc = check_flash_args("prefill_attention", q, k, v, slots);
  TORCH_CHECK(start >= 0 && sc.size(0) == start + q.size(0),
              "prefill_attention: slots [start + T]: ", sc.size(0), " for start ", start,
              " and T ", q.size(0));
  auto out = at::empty(q.sizes(), q.options());
  run_flash(q, k, v, sc, reinterpret_cast<uint16_t*>(out.data_ptr()), nullptr, true, start,
            scale);
  return out;
}

std::tuple<at::Tensor, at::Tensor> shared_attention(const at::Tensor& q, const at::Tensor& k,
                                                    const at::Tensor& v, const at::Tensor& slots,
                                                    double scale) {
  const auto sc = check_flash_args("shared_attention", q, k, v, slots);
  TORCH_CHECK(sc.size(0) > 0, "shared_attention: no shared keys");
  auto out = at::empty(q.sizes(), q.options().dtype(at::kFloat));
  auto lse = at::empty({q.size(0), q.size(1)}, q.options().dtype(at::kFloat));
  run_flash(q, k, v, sc, out.data_ptr<float>(), lse.data_ptr<float>(), false, 0, scale);
  return {out, lse};
}

#if KILN_HAVE_KERNELS
PackedLinear packed_linear_arg(const at::Tensor& w, const at::Tensor& scale) {
  PackedLinear l;
  TORCH_CHECK(w.dim() == 3 && w.is_contiguous(), "decode_layer: packed weights [N/16, ., .]");
  l.n = w.size(0) * 16;
  if (w.scalar_type() == at::kByte) {
    TORCH_CHECK(w.size(2) == kW4GroupBytes, "decode_layer: w4 weights [N/16, K/32, 320]");
    l.k = w.size(1) * kW4Group;
    l.w4 = w.data_ptr<uint8_t>();
  } else {
    TORCH_CHECK(w.scalar_type() == at::kChar && w.size(2) == 32,
                "decode_layer: w8 weights int8 [N/16, K/2, 32]");
    TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() &&
                    scale.numel() == l.n,
                "decode_layer: w8 scale fp32 [N]");
    l.k = w.size(1) * 2;
    l.w8 = w.data_ptr<int8_t>();
    l.scale = scale.data_ptr<float>();
  }
  return l;
}
#endif

at::Tensor decode_layer(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                        const at::Tensor& ln1, const at::Tensor& ln2, double eps,
                        at::TensorList weights, at::TensorList scales, const at::Tensor& k,
                        const at::Tensor& v, const at::Tensor& slot_mapping,
                        const at::Tensor& gather, const at::Tensor& mask,
                        const c10::optional<at::Tensor>& shared, int64_t num_heads,
                        double scale) {
#if KILN_HAVE_KERNELS
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(),
              "decode_layer: x [B, H] bf16");
  TORCH_CHECK(weights.size() == 4 && scales.size() == 4,
              "decode_layer: 4 weights and scales (qkv, o, gate_up, down)");
  TORCH_CHECK(k.dim() == 3 && k.sizes() == v.sizes() && k.scalar_type() == at::kBFloat16 &&
                  v.scalar_type() == at::kBFloat16 && k.is_contiguous() && v.is_contiguous(),
              "decode_layer: bf16 pools k/v [S, Hk, D]");
  const int64_t B = x.size(0), H = x.size(1), Hk = k.size(1), D = k.size(2), Hq = num_heads;
  TORCH_CHECK(Hq % Hk == 0 && Hq / Hk <= kMaxGroup, "decode_layer: mismatched head counts");
  LayerArgs a{reinterpret_cast<const uint16_t*>(ln1.data_ptr()),
              reinterpret_cast<const uint16_t*>(ln2.data_ptr()), static_cast<float>(eps),
              packed_linear_arg(weights[0], scales[0]), packed_linear_arg(weights[1], scales[1]),
              packed_linear_arg(weights[2], scales[2]), packed_linear_arg(weights[3], scales[3]),
              H, Hq, Hk, D, 0};
  a.I = a.gate_up.n / 2;
  TORCH_CHECK(a.qkv.k == H && a.qkv.n == (Hq + 2 * Hk) * D && a.o.k == Hq * D && a.o.n == H &&
                  a.gate_up.k == H && a.down.k == a.I && a.down.n == H && H % 16 == 0 &&
                  a.I % 16 == 0,
              "decode_layer: weight shapes do not make a layer of hidden size ", H);
  TORCH_CHECK(ln1.scalar_type() == at::kBFloat16 && ln2.scalar_type() == at::kBFloat16 &&
                  ln1.numel() == H && ln2.numel() == H && ln1.is_contiguous() &&
                  ln2.is_contiguous(),
              "decode_layer: bf16 norm weights [H]");
  const auto cc = cos.contiguous(), sc = sin.contiguous();
  TORCH_CHECK(cc.scalar_type() == at::kBFloat16 && sc.scalar_type() == at::kBFloat16 &&
                  cc.numel() == B * D && sc.numel() == B * D,
              "decode_layer: bf16 cos/sin [B, D]");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.numel() == B &&
                  gather.scalar_type() == at::kLong && mask.scalar_type() == at::kBool &&
                  gather.dim() == 2 && gather.size(0) == B && mask.numel() == gather.numel(),
              "decode_layer: slot_mapping [B], gather int64 [B, L], mask bool [B, L]");
  const auto sm = check_slots("decode_layer", slot_mapping, k.size(0));
  const auto gc = gather.contiguous(), mc = mask.contiguous();
  at::Tensor sh;
  if (shared.has_value()) {
    sh = check_slots("decode_layer", *shared, k.size(0));
    TORCH_CHECK(sh.size(0) > 0, "decode_layer: no shared keys");
  }
  auto args = [&](auto impl) {
    return impl(a, x, reinterpret_cast<const uint16_t*>(cc.data_ptr()),
                reinterpret_cast<const uint16_t*>(sc.data_ptr()),
                reinterpret_cast<uint16_t*>(k.data_ptr()),
                reinterpret_cast<uint16_t*>(v.data_ptr()), k.size(0), sm.data_ptr<int64_t>(),
                gc.data_ptr<int64_t>(), mc.data_ptr<bool>(), gc.size(1),
                sh.defined() ? sh.data_ptr<int64_t>() : nullptr,
                sh.defined() ? sh.size(0) : 0, static_cast<float>(scale));
  };
  at::Tensor out;
  for_head_dim("decode_layer", D,
               [&](auto d) { out = args(decode_layer_impl<decltype(d)::value>); });
  return out;
#else
  TORCH_CHECK(false, "decode_layer: built without AVX512-BF16");
#endif
}

at::Tensor rope_write(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                      const at::Tensor& k, const at::Tensor& v, const at::Tensor& slots,
                      int64_t num_heads) {
#if KILN_HAVE_KERNELS
  TORCH_CHECK(k.dim() == 3 && k.sizes() == v.sizes() && k.scalar_type() == at::kBFloat16 &&
                  v.scalar_type() == at::kBFloat16 && k.is_contiguous() && v.is_contiguous(),
              "rope_write: bf16 pools k/v [S, Hk, D]");
  const int64_t T = qkv.size(0), Hk = k.size(1), D = k.size(2), Hq = num_heads;
  TORCH_CHECK(qkv.dim() == 2 && qkv.scalar_type() == at::kBFloat16 &&
                  qkv.size(1) == (Hq + 2 * Hk) * D,
              "rope_write: qkv [T, (Hq + 2 Hk) * D] bf16");
  const auto xc = qkv.contiguous(), cc = cos.contiguous(), sc = sin.contiguous();
  TORCH_CHECK(cc.scalar_type() == at::kBFloat16 && sc.scalar_type() == at::kBFloat16 &&
                  cc.numel() == T * D && sc.numel() == T * D,
              "rope_write: bf16 cos/sin [T, D]");
  TORCH_CHECK(slots.numel() == T, "rope_write: one slot per token");
  const auto sl = check_slots("rope_write", slots, k.size(0));
  auto q = at::empty({T, Hq, D}, qkv.options());
  auto args = [&](auto impl) {
    impl(reinterpret_cast<const uint16_t*>(xc.data_ptr()),
         reinterpret_cast<const uint16_t*>(cc.data_ptr()),
         reinterpret_cast<const uint16_t*>(sc.data_ptr()),
         reinterpret_cast<uint16_t*>(k.data_ptr()), reinterpret_cast<uint16_t*>(v.data_ptr()),
         sl.data_ptr<int64_t>(),
         reinterpret_cast<uint16_t*>(q.data_ptr()), T, Hq, Hk);
  };
  for_head_dim("rope_write", D, [&](auto d) { args(rope_write_impl<decltype(d)::value>); });
  return q;
#else
  TORCH_CHECK(false, "rope_write: built without AVX512-BF16");
#endif
}

// The eager steps' (prefill's) RMSNorm and SiLU-and-mul as one pass each: PyTorch runs them as
// 6 and 3 ops over the step's activations (512 rows: ~12 and ~10 ms of SmolLM2's prefill).
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 &&
                  w.scalar_type() == at::kBFloat16 && w.dim() == 1 && w.size(0) == x.size(1) &&
                  x.size(1) % 16 == 0,
              "rms_norm: x [M, H] and w [H] bf16, H a multiple of 16");
  const auto xc = x.contiguous(), wc = w.contiguous();
  auto y = at::empty_like(xc);
#if KILN_HAVE_KERNELS
  const int64_t H = x.size(1);
  const auto* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr());
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
  at::parallel_for(0, x.size(0), 16, [&](int64_t b, int64_t e) {
    rmsnorm_rows(xp + b * H, reinterpret_cast<const uint16_t*>(wc.data_ptr()),
                 static_cast<float>(eps), yp + b * H, e - b, H);
  });
#else
  TORCH_CHECK(false, "rms_norm: built without AVX512-BF16");
#endif
  return y;
}

at::Tensor silu_mul(const at::Tensor& gu) {
  TORCH_CHECK(gu.dim() == 2 && gu.scalar_type() == at::kBFloat16 && gu.size(1) % 32 == 0,
              "silu_mul: gu [M, 2 I] bf16, I a multiple of 16");
  const auto gc = gu.contiguous();
  const int64_t I = gu.size(1) / 2;
  auto act = at::empty({gu.size(0), I}, gu.options());
#if KILN_HAVE_KERNELS
  const auto* gp = reinterpret_cast<const uint16_t*>(gc.data_ptr());
  auto* ap = reinterpret_cast<uint16_t*>(act.data_ptr());
  at::parallel_for(0, gu.size(0), 8, [&](int64_t b, int64_t e) {
    silu_mul_rows(gp + b * 2 * I, ap + b * I, e - b, I);
  });
#else
  TORCH_CHECK(false, "silu_mul: built without AVX512-BF16");
#endif
  return act;
}

// w4_linear and w4a8_linear: the same inputs and checks, two kernels.
at::Tensor run_w4(const char* name, bool a8, const at::Tensor& x, const at::Tensor& packed,
                  int64_t n) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, name, ": x [M, K] bf16");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  packed.size(2) == kW4GroupBytes,
              name, ": packed uint8 [N/16, K/32, 320]");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(packed.size(0) * 16 == n && packed.size(1) * kW4Group == K, name,
              ": packed weight is [", packed.size(0) * 16, ", ", packed.size(1) * 32,
              "], x has K = ", K, " and n = ", n);
  const auto xc = x.contiguous();
  auto y = at::empty({M, n}, x.options());
#if KILN_HAVE_KERNELS
  const auto* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr());
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
  if (M > 0 && a8)
    w4a8_linear_impl(xp, packed.data_ptr<uint8_t>(), yp, M, K, n);
  else if (M > 0)
    w4_linear_impl(xp, packed.data_ptr<uint8_t>(), yp, M, K, n);
#else
  TORCH_CHECK(false, name, ": built without AVX512-BF16");
#endif
  return y;
}

at::Tensor w4_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n) {
  return run_w4("w4_linear", false, x, packed, n);
}

at::Tensor w4a8_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n) {
  return run_w4("w4a8_linear", true, x, packed, n);
}

at::Tensor w8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "w8_linear: x [M, K] bf16");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kChar && packed.is_contiguous() &&
                  packed.size(2) == 32,
              "w8_linear: packed int8 [N/16, K/2, 32]");
  const int64_t M = x.size(0), K = x.size(1), N = packed.size(0) * 16;
  TORCH_CHECK(packed.size(1) * 2 == K, "w8_linear: packed weight has K = ", packed.size(1) * 2,
              ", x has ", K);
  TORCH_CHECK(scale.dim() == 1 && scale.size(0) == N && scale.scalar_type() == at::kFloat &&
                  scale.is_contiguous(),
              "w8_linear: scale fp32 [N]");
  const auto xc = x.contiguous();
  auto y = at::empty({M, N}, x.options());
#if KILN_HAVE_KERNELS
  if (M > 0)
    w8_linear_impl(reinterpret_cast<const uint16_t*>(xc.data_ptr()), packed.data_ptr<int8_t>(),
                   scale.data_ptr<float>(), reinterpret_cast<uint16_t*>(y.data_ptr()), M, K, N);
#else
  TORCH_CHECK(false, "w8_linear: built without AVX512-BF16");
#endif
  return y;
}

}  // namespace

TORCH_LIBRARY(kiln_cpu, m) {
  m.def("supported() -> bool");
  m.def("decode_attention(Tensor q, Tensor k, Tensor v, Tensor slots, Tensor mask, float scale)"
        " -> (Tensor, Tensor)");
  m.def("prefill_attention(Tensor q, Tensor k, Tensor v, Tensor slots, int start, float scale)"
        " -> Tensor");
  m.def("shared_attention(Tensor q, Tensor k, Tensor v, Tensor slots, float scale)"
        " -> (Tensor, Tensor)");
  m.def("decode_layer(Tensor x, Tensor cos, Tensor sin, Tensor ln1, Tensor ln2, float eps,"
        " Tensor[] weights, Tensor[] scales, Tensor(a!) k, Tensor(b!) v, Tensor slot_mapping,"
        " Tensor gather, Tensor mask, Tensor? shared, int num_heads, float scale) -> Tensor");
  m.def("rope_write(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) k, Tensor(b!) v, Tensor slots,"
        " int num_heads) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  m.def("silu_mul(Tensor gu) -> Tensor");
  m.def("w4_linear(Tensor x, Tensor packed, int n) -> Tensor");
  m.def("w4a8_linear(Tensor x, Tensor packed, int n) -> Tensor");
  m.def("w8_linear(Tensor x, Tensor packed, Tensor scale) -> Tensor");
  m.impl("supported", &supported);
  m.impl("w4_linear", c10::DispatchKey::CPU, &w4_linear);
  m.impl("w4a8_linear", c10::DispatchKey::CPU, &w4a8_linear);
  m.impl("w8_linear", c10::DispatchKey::CPU, &w8_linear);
  m.impl("decode_attention", c10::DispatchKey::CPU, &decode_attention);
  m.impl("prefill_attention", c10::DispatchKey::CPU, &prefill_attention);
  m.impl("shared_attention", c10::DispatchKey::CPU, &shared_attention);
  m.impl("decode_layer", c10::DispatchKey::CPU, &decode_layer);
  m.impl("rope_write", c10::DispatchKey::CPU, &rope_write);
  m.impl("rms_norm", c10::DispatchKey::CPU, &rms_norm);
  m.impl("silu_mul", c10::DispatchKey::CPU, &silu_mul);
}
