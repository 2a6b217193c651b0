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
// Built only where the compiler targets AVX512-BF16 (-march=native on such a CPU); elsewhere the
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
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define KILN_HAVE_KERNELS 1
#include <immintrin.h>
#else
#define KILN_HAVE_KERNELS 0
#endif

namespace {

#if KILN_HAVE_KERNELS

constexpr int kMaxGroup = 16;  // query heads per KV head handled by one task

// e^x for a vector, x <= 0 or -inf (softmax after the max is subtracted): 2^t with
// t = x log2(e) = n + f, |f| <= 1/2, 2^f by a degree-6 polynomial (relative error ~2e-7),
// scaled by 2^n with vscalefps. t is clamped to -150 so that -inf gives 0, not NaN.
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

constexpr int64_t kW4Group = 32;
constexpr int64_t kW4GroupBytes = 320;

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

#endif  // KILN_HAVE_KERNELS

bool supported() { return KILN_HAVE_KERNELS; }

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
  switch (D) {
    case 64: args(decode_attention_impl<64>); break;
    case 128: args(decode_attention_impl<128>); break;
    case 96: args(decode_attention_impl<96>); break;
    case 256: args(decode_attention_impl<256>); break;
    default: TORCH_CHECK(false, "decode_attention: head_dim ", D, " (64, 96, 128 or 256)");
  }
  TORCH_CHECK(!bad_slot.load(), "decode_attention: a slot lies outside the pool of ", k.size(0));
#else
  TORCH_CHECK(false, "decode_attention: built without AVX512-BF16");
#endif
  return {out, lse};
}


at::Tensor w4_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "w4_linear: x [M, K] bf16");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  packed.size(2) == kW4GroupBytes,
              "w4_linear: packed uint8 [N/16, K/32, 320]");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(packed.size(0) * 16 == n && packed.size(1) * kW4Group == K,
              "w4_linear: packed weight is [", packed.size(0) * 16, ", ", packed.size(1) * 32,
              "], x has K = ", K, " and n = ", n);
  const auto xc = x.contiguous();
  auto y = at::empty({M, n}, x.options());
#if KILN_HAVE_KERNELS
  if (M > 0)
    w4_linear_impl(reinterpret_cast<const uint16_t*>(xc.data_ptr()), packed.data_ptr<uint8_t>(),
                   reinterpret_cast<uint16_t*>(y.data_ptr()), M, K, n);
#else
  TORCH_CHECK(false, "w4_linear: built without AVX512-BF16");
#endif
  return y;
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
  m.def("w4_linear(Tensor x, Tensor packed, int n) -> Tensor");
  m.def("w8_linear(Tensor x, Tensor packed, Tensor scale) -> Tensor");
  m.impl("supported", &supported);
  m.impl("w4_linear", c10::DispatchKey::CPU, &w4_linear);
  m.impl("w8_linear", c10::DispatchKey::CPU, &w8_linear);
  m.impl("decode_attention", c10::DispatchKey::CPU, &decode_attention);
}
