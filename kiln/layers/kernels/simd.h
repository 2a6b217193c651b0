// What kiln's kernel sources share: the build's ISA level (its namespace), the vector helpers
// (hsum, hmax, load8 / store8, prefetch_ahead), the integer dot product of 4 byte pairs, and the
// declarations one source calls in the other. One copy, included by kernels.cpp and kquant.cpp.
//
// ISA levels. Every source is compiled once per level of kiln/layers/kernels/isa.py's table,
// with explicit -m flags (never -march=native: CI compiles the levels its CPU cannot run too),
// and -DKILN_NS=kiln_<level>: the ops of a level live in torch.ops.kiln_<level>, so every level
// a CPU runs loads into one process (the tests run each). The code is one: a level changes
// instructions, never the arithmetic. `dot4` is the only fork: AVX512-VNNI's vpdpbusd where the
// level has it, vpmaddubsw + vpmaddwd elsewhere; both give the exact int32 sums (the callers'
// int16 pair sums never saturate: see their comments), so every level computes the same bits.

#pragma once

#include <ATen/ATen.h>
#include <immintrin.h>

#include <cstdint>

#if !(defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#error "kiln's kernels are built with -mavx2 -mfma -mf16c at least (kiln/layers/kernels/isa.py)"
#endif
#ifndef KILN_NS
#error "built with -DKILN_NS=kiln_<level> (kiln/layers/kernels/build.py)"
#endif

// AVX512-VNNI on 256-bit vectors (needs AVX512VL for the VEX/EVEX ymm form).
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define KILN_VNNI 1
#else
#define KILN_VNNI 0
#endif

// TORCH_LIBRARY pastes its namespace argument: this indirection expands KILN_NS first.
#define KILN_LIBRARY_(ns, m) TORCH_LIBRARY(ns, m)
#define KILN_LIBRARY(m) KILN_LIBRARY_(KILN_NS, m)
#define KILN_LIBRARY_FRAGMENT_(ns, m) TORCH_LIBRARY_FRAGMENT(ns, m)
#define KILN_LIBRARY_FRAGMENT(m) KILN_LIBRARY_FRAGMENT_(KILN_NS, m)
#define KILN_STR_(x) #x
#define KILN_STR(x) KILN_STR_(x)

namespace KILN_NS {

// The library's instruction level, as compiled: what `isa()` reports to Python.
inline const char* compiled_isa() { return KILN_VNNI ? "avx512" : "avx2"; }

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline float hmax(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
// fp16 (a KV pool's keys and values, llama.cpp's default storage), exactly (F16C)
inline __m256 load8(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
// int8 weights (q8_linear's rows) converted exactly, as q8_linear's L1 buffer holds them
inline __m256 load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
      _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
// 8 floats into a KV pool: fp32 as they are, fp16 rounded to nearest even (F16C)
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(at::Half* p, __m256 v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}

// acc + the int32 sums of 4 products u8 w x s8 x per 32-bit lane. The caller guarantees that
// no pair w[2i] x[2i] + w[2i+1] x[2i+1] leaves int16 (vpmaddubsw saturates there, vpdpbusd
// does not): then both forms are exact and equal.
inline __m256i dot4(__m256i acc, __m256i w, __m256i x) {
#if KILN_VNNI
  return _mm256_dpbusd_epi32(acc, w, x);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x),
                                                 _mm256_set1_epi16(1)));
#endif
}

// Software prefetch, 1 KB ahead of the weight stream. A decode step reads each weight once, from
// DRAM, while computing on it; left to the hardware prefetcher the kernels reached ~40% of the
// measured read bandwidth (2-core Zen 2), which the explicit requests raise to ~60-70%: Qwen2.5
// 1.5B Q4_K_M b=1 10.7 -> 18.4 tok/s, 0.5B 35 -> 45, SmolLM2 Q4_1 +10%. The distance, measured
// interleaved in one process (SmolLM2's 120 int4 linears back to back at one row, 2 threads,
// ms): 0 B 3.86, 512 3.46, 1 KB 3.29-3.31, 1.25 KB 3.28, 1.5 KB 3.61, 2 KB 3.60, 3 KB 3.50,
// 4 KB 3.49; one thread 1 KB 4.68 vs 2 KB 5.44. The GGUF-block tiles (kquant.cpp), 1 KB vs
// 2 KB: Qwen2.5-Coder-0.5B Q4_K_M layers 10.16 vs 11.32 ms, its Q8_0 head 4.85 vs 5.76; 1.5B
// layers 30.4 vs 32.7, Q6_K head 6.17 vs 7.43. Past a thread's last tile it touches the next
// thread's lines: harmless.
#ifndef KILN_PF
#define KILN_PF 1024
#endif
// Asks for the cache lines of [p, p + bytes) into the level kHint names (_MM_HINT_T0: L1,
// _MM_HINT_T1: L2).
template <int kHint = _MM_HINT_T0>
inline void prefetch_lines(const void* p, int64_t bytes) {
  for (int64_t o = 0; o < bytes; o += 64)
    _mm_prefetch(static_cast<const char*>(p) + o, static_cast<_mm_hint>(kHint));
}
// Asks for the cache lines of [p + KILN_PF, p + KILN_PF + bytes) ahead of use.
inline void prefetch_ahead(const void* p, int64_t bytes) {
  prefetch_lines(static_cast<const char*>(p) + KILN_PF, bytes);
}

// A tile kernel's prefetches when an item runs several passes of activation rows over its
// tiles: the first pass streams them (pf = KILN_PF ahead, into L1), the second, its tiles in
// cache, asks for the next item's (pf = the distance to them, into L2: in L1 they would evict
// this item's tiles and the activation rows), later passes for nothing (pf < 0). Without it an
// item read its tiles and then computed with the memory idle: Qwen2.5-Coder-0.5B's GGUF
// linears at 16 rows, 2 threads, 49.5-56.6 -> 33.1-37.4 ms a step (Zen 4).
inline int64_t pass_prefetch(int pass, int64_t next) {
  return pass == 0 ? KILN_PF : (pass == 1 && next > 0 ? next : -1);
}
// Asks for the cache lines of [p + pf, p + pf + bytes) as pass_prefetch chose (pf < 0: none)
inline void prefetch_at(const void* p, int64_t pf, int64_t bytes) {
  if (pf < 0) return;
  const char* q = static_cast<const char*>(p) + pf;
  if (pf == KILN_PF)
    prefetch_lines<_MM_HINT_T0>(q, bytes);
  else
    prefetch_lines<_MM_HINT_T1>(q, bytes);
}

// The one activation quantizer (llama.cpp's Q8_0 / Q8_K forms): x [K] -> int8 codes q [K] with
// one d = amax / 127 per span of `span` values (32, or 256 for the K-quants' super-blocks),
// codes round(x * 127 / amax) (half to even). Per group g of 32, each output where asked
// (nullptr: not): d[g] (its span's d), fsum[g] = the sum of the unrounded floats (the int4
// tiles' min term), s[g] = d * sum(xq), is[g] = sum(xq) (the GGUF tiles' offsets and mins), h[g]
// = the sums of codes 0..15 and 16..31 as two int16s (Q6_K's offset).
template <typename T>
void quantize_row(const T* x, int64_t K, int64_t span, int8_t* q, float* d, float* fsum,
                  float* s, int32_t* is, int32_t* h) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256i perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t g0 = 0; g0 < K / 32; g0 += span / 32) {
    __m256 mx = _mm256_setzero_ps();
    for (int64_t i = 32 * g0; i < 32 * g0 + span; i += 8)
      mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, load8(x + i)));
    const float amax = hmax(mx);
    const float dg = amax / 127.0f;
    const __m256 id = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
    auto cvt = [&](__m256 v) {
      return _mm256_cvtps_epi32(
          _mm256_round_ps(_mm256_mul_ps(v, id), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    };
    for (int64_t g = g0; g < g0 + span / 32; ++g) {
      const T* p = x + g * 32;
      const __m256 v0 = load8(p), v1 = load8(p + 8), v2 = load8(p + 16), v3 = load8(p + 24);
      const __m256i i0 = cvt(v0), i1 = cvt(v1), i2 = cvt(v2), i3 = cvt(v3);
      // packs work per 128-bit lane: the permute puts the 32 codes back in order
      const __m256i a = _mm256_packs_epi32(i0, i1);
      const __m256i b = _mm256_packs_epi32(i2, i3);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + g * 32),
                          _mm256_permutevar8x32_epi32(_mm256_packs_epi16(a, b), perm));
      if (d) d[g] = dg;
      if (fsum) fsum[g] = hsum(_mm256_add_ps(_mm256_add_ps(v0, v1), _mm256_add_ps(v2, v3)));
      if (s || is || h) {
        // exact in fp32: |sum| <= 32 * 127
        const int h0 = static_cast<int>(hsum(_mm256_cvtepi32_ps(_mm256_add_epi32(i0, i1))));
        const int h1 = static_cast<int>(hsum(_mm256_cvtepi32_ps(_mm256_add_epi32(i2, i3))));
        if (s) s[g] = dg * static_cast<float>(h0 + h1);
        if (is) is[g] = h0 + h1;
        if (h)
          h[g] = static_cast<int32_t>((static_cast<uint32_t>(h0) & 0xFFFF) |
                                      (static_cast<uint32_t>(h1) << 16));
      }
    }
  }
}

// kquant.cpp's GGUF-block linear, called by kernels.cpp's layer kernels (one library).
at::Tensor kq_linear(const at::Tensor& x, at::TensorList weights, at::IntArrayRef types,
                     at::IntArrayRef rows);

}  // namespace KILN_NS
