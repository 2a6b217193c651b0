// What kiln's kernel sources share: the build's ISA level (its namespace), the vector helpers
// (hsum, hmax, load8 / store8, prefetch_ahead), the integer dot product of 4 byte pairs, the
// activation quantizer and the tile kernels' pieces. One copy, included by every source; no ATen
// (c10's Half and BFloat16 only), so that the compute-only sources stay light (kernels.h).
//
// ISA levels. Every source is compiled once per level of kiln/layers/kernels/isa.py's table,
// with explicit -m flags (never -march=native: CI compiles the levels its CPU cannot run too),
// and -DKILN_NS=kiln_<level>: the ops of a level live in torch.ops.kiln_<level>, so every level
// a CPU runs loads into one process (the tests run each). The code is one: a level changes
// instructions, never the arithmetic. `dot4` is the only fork: AVX512-VNNI's vpdpbusd where the
// level has it, vpmaddubsw + vpmaddwd elsewhere; both give the exact int32 sums (the callers'
// int16 pair sums never saturate: see their comments), so every level computes the same bits.

#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

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
inline __m256 load8(const c10::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
// fp16 (a KV pool's keys and values, llama.cpp's default storage), exactly (F16C)
inline __m256 load8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
// int8 weights (q8_linear's rows) converted exactly, as q8_linear's L1 buffer holds them
inline __m256 load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
      _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
// 8 floats into a KV pool: fp32 as they are, fp16 rounded to nearest even (F16C)
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(c10::Half* p, __m256 v) {
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
// How far ahead of the weights they read (bytes) the kernels' software prefetch asks for
// lines: the kernel layer sets it once when it loads the library, by CPU (isa.py
// prefetch_ahead: 2 KB on Zen 3, 1 KB elsewhere); one variable for the whole library.
inline int64_t g_prefetch_ahead = 1024;
#define KILN_PF g_prefetch_ahead
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

// ---- the tile kernels' shared pieces (kquant_tiles.cpp's GGUF-block tiles and q4_tiles.cpp's
// int4 tiles): one row per 32-bit lane, the vector width as a parameter.

inline __m256i load32(const void* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}

// An empty asm that takes v and gives it back "changed": the compiler keeps the sums in the
// order written. Without it GCC moved every product of a group ahead of the first addition
// (integer adds reassociate) and spilled 32 of them to the stack: 1.5-2x slower.
inline void pin(__m256i& v) { __asm__("" : "+v"(v)); }

// ---- the vector width as a parameter. A tile kernel runs on NT tiles side by side: NT = 1,
// one 256-bit vector (8 weight rows, one per 32-bit lane; every level), or NT = 2, one
// 512-bit vector whose low half is tile t and high half tile t + 1 (16 rows; AVX-512 levels).
// The tiles' layout is the same: a 512-bit kernel loads the same 32 bytes of two tiles (the
// second `stride` bytes on) into one vector. Every lane computes what the 256-bit kernel
// computes for its row, the same integer sums and the same float operations in the same order:
// the same bits at both widths and at every level. Why: beyond one activation row the tile
// kernels are bound by instructions, not memory, and half of them surround the dot products
// (the activation broadcasts, the weight decode, the float step), which a pair does once for
// 16 rows instead of 8. The dot products themselves run at one rate on Zen 4 (one 512-bit
// vpdpbusd a cycle or two 256-bit ones: 3.6 vs 6.8 G/s on one core, 10 independent chains,
// /tmp microbenchmark, ~225 G multiply-adds/s either way); CPUs with two 512-bit pipes (Intel
// Xeon) also double those.
//
// One struct for both widths: each member picks its 256- or 512-bit intrinsic at compile time
// (the 512-bit ones are only instantiated on AVX-512 levels, where kMaxTiles is 2).
template <int NT>
struct Vec {
  static_assert(NT == 1 || NT == 2, "one or two tiles per vector");
  using I = std::conditional_t<NT == 1, __m256i, __m512i>;
  using F = std::conditional_t<NT == 1, __m256, __m512>;
  // a per-tile 256-bit value (f(offset of the tile)), for every tile
  template <typename Fn>
  static I each(Fn f, int64_t stride) {
    if constexpr (NT == 1) {
      (void)stride;
      return f(0);
    } else {
      return _mm512_inserti64x4(_mm512_castsi256_si512(f(0)), f(stride), 1);
    }
  }
  template <typename Fn>
  static F eachf(Fn f, int64_t stride) {
    if constexpr (NT == 1) {
      (void)stride;
      return f(0);
    } else {
      return _mm512_insertf32x8(_mm512_castps256_ps512(f(0)), f(stride), 1);
    }
  }
  static I zero() {
    if constexpr (NT == 1) return _mm256_setzero_si256(); else return _mm512_setzero_si512();
  }
  static I i8(int8_t v) {
    if constexpr (NT == 1) return _mm256_set1_epi8(v); else return _mm512_set1_epi8(v);
  }
  static I i32(int32_t v) {
    if constexpr (NT == 1) return _mm256_set1_epi32(v); else return _mm512_set1_epi32(v);
  }
  static F f32(float v) {
    if constexpr (NT == 1) return _mm256_set1_ps(v); else return _mm512_set1_ps(v);
  }
  static F fzero() {
    if constexpr (NT == 1) return _mm256_setzero_ps(); else return _mm512_setzero_ps();
  }
  static I x4(const int8_t* p) {  // four activation codes in every 32-bit lane
    int32_t v;
    std::memcpy(&v, p, 4);
    return i32(v);
  }
};

// The lane operations at both widths, one line each: NAME on a 256-bit vector runs OP256, on a
// 512-bit one (two tiles, AVX-512 levels only) OP512, the same operation.
template <typename V>
constexpr bool kWide = sizeof(V) == 64;
#define KILN_LANE(NAME, PARAMS, ARGS, OP256, OP512)               \
  template <typename V>                                         \
  inline auto NAME PARAMS {                                     \
    if constexpr (kWide<V>) return OP512 ARGS; else return OP256 ARGS; \
  }
KILN_LANE(v_and, (V a, V b), (a, b), _mm256_and_si256, _mm512_and_si512)
KILN_LANE(v_or, (V a, V b), (a, b), _mm256_or_si256, _mm512_or_si512)
KILN_LANE(v_add32, (V a, V b), (a, b), _mm256_add_epi32, _mm512_add_epi32)
KILN_LANE(v_sub32, (V a, V b), (a, b), _mm256_sub_epi32, _mm512_sub_epi32)
KILN_LANE(v_mullo32, (V a, V b), (a, b), _mm256_mullo_epi32, _mm512_mullo_epi32)
KILN_LANE(v_madd16, (V a, V b), (a, b), _mm256_madd_epi16, _mm512_madd_epi16)
KILN_LANE(v_slli32, (V a, int n), (a, n), _mm256_slli_epi32, _mm512_slli_epi32)
KILN_LANE(v_srai32, (V a, int n), (a, n), _mm256_srai_epi32, _mm512_srai_epi32)
KILN_LANE(v_srli16, (V a, int n), (a, n), _mm256_srli_epi16, _mm512_srli_epi16)
KILN_LANE(v_slli16, (V a, int n), (a, n), _mm256_slli_epi16, _mm512_slli_epi16)
KILN_LANE(v_cvt, (V a), (a), _mm256_cvtepi32_ps, _mm512_cvtepi32_ps)
KILN_LANE(v_mul, (V a, V b), (a, b), _mm256_mul_ps, _mm512_mul_ps)
KILN_LANE(v_addf, (V a, V b), (a, b), _mm256_add_ps, _mm512_add_ps)
KILN_LANE(v_fmadd, (V a, V b, V c), (a, b, c), _mm256_fmadd_ps, _mm512_fmadd_ps)
KILN_LANE(v_fnmadd, (V a, V b, V c), (a, b, c), _mm256_fnmadd_ps, _mm512_fnmadd_ps)
#if KILN_VNNI
KILN_LANE(v_dp, (V acc, V w, V x), (acc, w, x), _mm256_dpbusd_epi32, _mm512_dpbusd_epi32)
inline void pin(__m512i& v) { __asm__("" : "+v"(v)); }
constexpr int kMaxTiles = 2;  // tiles per vector on this level
#else
constexpr int kMaxTiles = 1;
#endif
#undef KILN_LANE

// v << n (n > 0) or v >> -n in 16-bit lanes; n is a constant once the k loops unroll.
template <typename I>
inline I shift16(I v, int n) {
  return n > 0 ? v_slli16(v, n) : (n < 0 ? v_srli16(v, -n) : v);
}

// A nib's vector k (values 8k..8k+7 of the 8 rows) as lo (values 8k..8k+3) and hi
// (8k+4..8k+7) codes, one row per 32-bit lane; st: the next tile's offset (NT = 2).
template <int NT>
inline void nib_k(const uint8_t* nib, int64_t st, int k, typename Vec<NT>::I& lo,
                  typename Vec<NT>::I& hi) {
  using V = Vec<NT>;
  const auto m4 = V::i8(0x0F);
  const auto v = V::each([&](int64_t o) { return load32(nib + o + 32 * k); }, st);
  lo = v_and(v, m4);
  hi = v_and(v_srli16(v, 4), m4);
}

// Vector k's fifth bits from an H (lo: bit 2k, hi: bit 2k + 1): codes become 0..31.
template <int NT>
inline void bit4_k(const uint8_t* hp, int64_t st, int k, typename Vec<NT>::I& lo,
                   typename Vec<NT>::I& hi) {
  using V = Vec<NT>;
  const auto b4 = V::i8(0x10);
  const auto H = V::each([&](int64_t o) { return load32(hp + o); }, st);
  lo = v_or(lo, v_and(shift16(H, 4 - 2 * k), b4));
  hi = v_or(hi, v_and(shift16(H, 3 - 2 * k), b4));
}

// lo / hi codes of vector k against activation row xq (the group's codes): int16, row r's
// 4 products in lanes 2r, 2r + 1
inline __m256i pair_k(__m256i lo, __m256i hi, const int8_t* xq, int k) {
  return _mm256_add_epi16(_mm256_maddubs_epi16(lo, Vec<1>::x4(xq + 8 * k)),
                          _mm256_maddubs_epi16(hi, Vec<1>::x4(xq + 8 * k + 4)));
}

// A group's code sums, one row per 32-bit lane, accumulated over vectors (lo's codes against
// the four activation codes at xl, hi's against xh): with VNNI int32
// sums of the products straight from vpdpbusd; without, pair_k's int16 pairs (row r's in
// lanes 2r, 2r + 1), which `sum32` / `scaled32` then widen. Either way the same integers: the
// int16 pairs never saturate (see each caller's bound). NT = 2 exists only with VNNI.
template <typename I>
inline void acc4(I& S, I lo, I hi, const int8_t* xl, const int8_t* xh, bool first) {
#if KILN_VNNI
  constexpr int NT = sizeof(I) / 32;
  using V = Vec<NT>;
  const I a = first ? V::zero() : S;
  S = v_dp(v_dp(a, lo, V::x4(xl)), hi, V::x4(xh));
#else
  const __m256i t = _mm256_add_epi16(_mm256_maddubs_epi16(lo, Vec<1>::x4(xl)),
                                     _mm256_maddubs_epi16(hi, Vec<1>::x4(xh)));
  S = first ? t : _mm256_add_epi16(S, t);
#endif
  pin(S);
}
// the GGUF-block tiles' vector k: lo holds values 8k..8k+3, hi 8k+4..8k+7
template <typename I>
inline void acc_k(I& S, I lo, I hi, const int8_t* xq, int k, bool first) {
  acc4(S, lo, hi, xq + 8 * k, xq + 8 * k + 4, first);
}

// acc_k's sums as int32, one row per lane
template <typename I>
inline I sum32(I S) {
#if KILN_VNNI
  return S;
#else
  return _mm256_madd_epi16(S, _mm256_set1_epi16(1));
#endif
}

inline __m256 f16x8(const uint8_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// The prefetches of one block of each of the NT tiles (the second `st` bytes on)
template <int NT>
inline void prefetch_tiles(const uint8_t* w, int64_t st, int64_t pf, int64_t bytes) {
  prefetch_at(w, pf, bytes);
  if (NT == 2) prefetch_at(w + st, pf, bytes);
}

// the rows' fp16 scales at p (8 per tile) as floats
template <int NT>
inline typename Vec<NT>::F f16s(const uint8_t* p, int64_t st) {
  return Vec<NT>::eachf([&](int64_t o) { return f16x8(p + o); }, st);
}

}  // namespace KILN_NS
