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

inline void prefetch(const uint16_t* row, int64_t bytes) {
  for (int64_t off = 0; off < bytes; off += 64)
    _mm_prefetch(reinterpret_cast<const char*>(row) + off, _MM_HINT_T0);
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

}  // namespace

TORCH_LIBRARY(kiln_cpu, m) {
  m.def("supported() -> bool");
  m.def("decode_attention(Tensor q, Tensor k, Tensor v, Tensor slots, Tensor mask, float scale)"
        " -> (Tensor, Tensor)");
  m.impl("supported", &supported);
  m.impl("decode_attention", c10::DispatchKey::CPU, &decode_attention);
}
