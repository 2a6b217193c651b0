// kiln's GGUF-block tile kernels: 8 output rows a tile (kquant.cpp's kq_pack layout), one row
// per 32-bit lane, NT tiles side by side (simd.h's Vec), against int8 activation rows: the
// per-type block dot products that kq_linear runs (kquant.cpp). Formats and the activation's
// rounding: kquant.cpp's head comment. Compute only: no ATen here (kernels.h says why).

#include <cstdint>
#include <cstring>

#include "kquant.h"

namespace KILN_NS {
namespace {

// acc_k's sums times the rows' scales: sc32 (int32, row r's in lane r; VNNI) or scv16 (the
// same scale in both int16 halves of lane r: one vpmaddwd)
template <typename I>
inline I scaled32(I S, I sc32, I scv16) {
#if KILN_VNNI
  (void)scv16;
  return v_mullo32(S, sc32);
#else
  (void)sc32;
  return _mm256_madd_epi16(S, scv16);
#endif
}

// Each tile_* computes NT tiles (8 rows each, nb blocks at w, the next tile `st` bytes on)
// against MB activation rows: out[m] = the rows' fp32 results for activation row m (one row
// per lane: no horizontal sums). The weight vectors are expanded once per group and used by
// the MB rows in turn (vector-outer, row-inner: two weight registers live, not eight), each
// row's integer sums kept in a register until the float step (per group of 32; per
// super-block for the K-quants). Every output is computed alone in a fixed order
// (batch-invariant).

// Q8_0's codes sit in the tile as u = q + 128 (uint8), so that with VNNI one vpdpbusd per
// row and vector takes the unsigned codes as they are: sum(q x) = sum(u x) - 128 sum(x), the
// group's activation code sum `is` being at hand (the sums start at -128 sum(x) rather than
// subtract it after: one vpsubd less per row and group). Without VNNI vpmaddubsw's int16
// pairs of u x would saturate (2 x 255 x 127), so there the sign bit is flipped back once per
// vector and the signed codes go through the sign trick (|q| x sign(x, q)). Both give sum(q x)
// exactly: the same int32s, the same bits. Why: the sign trick costs a vpsignb per row and
// vector, half of the VNNI inner loop, and a Q8_0 head (Qwen2.5-0.5B's 152k x 896) is a
// quarter of a 16-row decode step.
template <int MB, int NT>
void tile_q8_0(const uint8_t* w, int64_t st, int64_t nb, const XTiles& x,
               typename Vec<NT>::F* out) {
  using V = Vec<NT>;
  using I = typename V::I;
  typename V::F acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = V::fzero();
  for (int64_t b = 0; b < nb; ++b, w += 272) {
    prefetch_tiles<NT>(w, st, x.pf, 272);
    I S[MB];
#pragma GCC unroll 8
    for (int k = 0; k < 8; ++k) {  // vector k: values 4k..4k+3 of the 8 rows
#if KILN_VNNI
      const I u = V::each([&](int64_t o) { return load32(w + o + 32 * k); }, st);
      for (int m = 0; m < MB; ++m) {
        // the sums start at -128 x the group's activation code sum (see above)
        S[m] = v_dp(k ? S[m] : V::i32(-128 * x.is[m * x.G + b]), u,
                    V::x4(x.q + m * x.K + 32 * b + 4 * k));
        pin(S[m]);
      }
#else
      const __m256i v = _mm256_xor_si256(load32(w + 32 * k), _mm256_set1_epi8(-128));
      const __m256i a = _mm256_sign_epi8(v, v);
      for (int m = 0; m < MB; ++m) {
        // int16 pairs reach 2 x 128 x 127: widened to int32 before anything is added
        const __m256i xs = _mm256_sign_epi8(V::x4(x.q + m * x.K + 32 * b + 4 * k), v);
        const __m256i t = _mm256_madd_epi16(_mm256_maddubs_epi16(a, xs), _mm256_set1_epi16(1));
        S[m] = k ? _mm256_add_epi32(S[m], t) : t;
        pin(S[m]);
      }
#endif
    }
    const auto d = f16s<NT>(w + 256, st);
    for (int m = 0; m < MB; ++m) {
      acc[m] = v_fmadd(v_cvt(S[m]), v_mul(d, V::f32(x.d[m * x.G + b])), acc[m]);
    }
  }
  for (int m = 0; m < MB; ++m) out[m] = acc[m];
}

// Without VNNI a group of 5-bit codes' int16 sums would reach 8 x 2 x 31 x 127: two sums per
// row, S (vectors 0, 1) and S2 (2, 3), each at most 31496. With VNNI the sums are int32: one.
constexpr bool kQ5Split = !KILN_VNNI;

// The sums of a group of 5-bit codes (nib + H at w) against MB rows: S, and S2 if kQ5Split
// off (with VNNI): S[m] starts at off[m] instead of 0.
template <int MB, int NT>
inline void q5_sums(const uint8_t* w, int64_t st, const int8_t* xq, int64_t K,
                    typename Vec<NT>::I* S, typename Vec<NT>::I* S2,
                    const int32_t* off = nullptr) {
  if (!kQ5Split && off)
    for (int m = 0; m < MB; ++m) S[m] = Vec<NT>::i32(off[m]);
#pragma GCC unroll 4
  for (int k = 0; k < 4; ++k) {
    typename Vec<NT>::I lo, hi;
    nib_k<NT>(w, st, k, lo, hi);
    bit4_k<NT>(w + 128, st, k, lo, hi);
    for (int m = 0; m < MB; ++m) {
      if (kQ5Split)
        acc_k(k < 2 ? S[m] : S2[m], lo, hi, xq + m * K, k, !(k & 1));
      else
        acc_k(S[m], lo, hi, xq + m * K, k, k == 0 && !off);
    }
  }
}

// Q5_0 (kMin false: codes q - 16, d only) and Q5_1 (codes q, plus m x the group's sum)
template <int MB, int NT, bool kMin>
void tile_q5(const uint8_t* w, int64_t st, int64_t nb, const XTiles& x,
             typename Vec<NT>::F* out) {
  using V = Vec<NT>;
  constexpr int64_t kBytes = kMin ? 192 : 176;
  typename V::F acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = V::fzero();
  for (int64_t b = 0; b < nb; ++b, w += kBytes) {
    prefetch_tiles<NT>(w, st, x.pf, kBytes);
    typename V::I S[MB], S2[MB];
    // Q5_0's codes are q - 16: minus 16 x the group's sum of activation codes (with VNNI
    // the sums start there: one vpsubd less per row and group; Zen 4, 2 threads, 16 rows,
    // 4864 x 896 streamed from DRAM: 0.404 -> 0.367 ms, the same integers)
    int32_t off[MB];
    for (int m = 0; m < MB; ++m) off[m] = -16 * x.is[m * x.G + b];
    q5_sums<MB, NT>(w, st, x.q + 32 * b, x.K, S, S2, !kMin && !kQ5Split ? off : nullptr);
    const auto d = f16s<NT>(w + 160, st);
    for (int m = 0; m < MB; ++m) {
      auto t = kQ5Split ? v_add32(sum32(S[m]), sum32(S2[m])) : sum32(S[m]);
      if (!kMin && kQ5Split) t = v_add32(t, V::i32(off[m]));
      acc[m] = v_fmadd(v_cvt(t), v_mul(d, V::f32(x.d[m * x.G + b])), acc[m]);
      if (kMin) acc[m] = v_fmadd(f16s<NT>(w + 176, st), V::f32(x.s[m * x.G + b]), acc[m]);
    }
  }
  for (int m = 0; m < MB; ++m) out[m] = acc[m];
}

// Q4_K (kQ5 false) and Q5_K, against Q8_K-form activations (one d per super-block): a
// super-block's scaled sums and min sums stay int32, one float step per super-block.
template <int MB, int NT, bool kQ5>
void tile_qk(const uint8_t* w, int64_t st, int64_t nb, const XTiles& x,
             typename Vec<NT>::F* out) {
  using V = Vec<NT>;
  using I = typename V::I;
  constexpr int64_t kSub = kQ5 ? 160 : 128, kSc = 8 * kSub, kBytes = kSc + 160;
  typename V::F acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = V::fzero();
  for (int64_t b = 0; b < nb; ++b, w += kBytes) {
    I Iacc[MB];  // sum over j of sc[j] x the sub-block's code products: < 8 x 63 x 61K
    for (int j = 0; j < 8; ++j) {
      const uint8_t* sw = w + kSub * j;
      prefetch_tiles<NT>(sw, st, x.pf, kSub);
      const int64_t g = 8 * b + j;
      I S[MB], S2[MB];
      if (kQ5) {
        q5_sums<MB, NT>(sw, st, x.q + 32 * g, x.K, S, S2);
      } else {
#pragma GCC unroll 4
        for (int k = 0; k < 4; ++k) {  // int16: at most 4 x 4 products of 15 x 127 (30480)
          I lo, hi;
          nib_k<NT>(sw, st, k, lo, hi);
          for (int m = 0; m < MB; ++m) acc_k(S[m], lo, hi, x.q + m * x.K + 32 * g, k, k == 0);
        }
      }
      // the rows' 6-bit scales sc[j] as int16 pairs (sc, sc), one row per 32-bit lane
      const I v = V::each([&](int64_t o) {
        return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + o + kSc + 8 * j)));
      }, st);
      const I scv = v_or(v, v_slli32(v, 16));
      for (int m = 0; m < MB; ++m) {
        I t = scaled32(S[m], v, scv);
        if (kQ5 && kQ5Split) t = v_add32(t, scaled32(S2[m], v, scv));
        Iacc[m] = j ? v_add32(Iacc[m], t) : t;
        pin(Iacc[m]);
      }
    }
    // the mins: sum over j of m[j] x the group's code sum, sub-blocks 2c and 2c + 1 in one madd
    I N[MB];
    for (int c = 0; c < 4; ++c) {
      const I mp = V::each([&](int64_t o) {
        const uint8_t* mn = w + o + kSc + 64 + 16 * c;
        return _mm256_cvtepu8_epi16(
            _mm_unpacklo_epi8(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(mn)),
                              _mm_loadl_epi64(reinterpret_cast<const __m128i*>(mn + 8))));
      }, st);
      for (int m = 0; m < MB; ++m) {
        const int32_t* is = x.is + m * x.G + 8 * b + 2 * c;  // |sum| <= 32 x 127: an int16
        const I t = v_madd16(
            mp, V::i32(static_cast<int32_t>((static_cast<uint32_t>(is[0]) & 0xFFFF) |
                                            (static_cast<uint32_t>(is[1]) << 16))));
        N[m] = c ? v_add32(N[m], t) : t;
      }
    }
    const auto d = f16s<NT>(w + kSc + 128, st), dmin = f16s<NT>(w + kSc + 144, st);
    for (int m = 0; m < MB; ++m) {
      const auto xd = V::f32(x.d[m * x.G + 8 * b]);
      acc[m] = v_fmadd(v_cvt(Iacc[m]), v_mul(d, xd), acc[m]);
      acc[m] = v_fnmadd(v_cvt(N[m]), v_mul(dmin, xd), acc[m]);
    }
  }
  for (int m = 0; m < MB; ++m) out[m] = acc[m];
}

// Q6_K, against Q8_K-form activations: a super-block's sums stay int32 (|sum| < 256 x 32 x
// 127 x 127), one float step per super-block.
template <int MB, int NT>
void tile_q6_k(const uint8_t* w, int64_t st, int64_t nb, const XTiles& x,
               typename Vec<NT>::F* out) {
  using V = Vec<NT>;
  using I = typename V::I;
  const I m30 = V::i8(0x30);
  typename V::F acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = V::fzero();
#if !KILN_VNNI
  // pshufb controls: row r's (sc[2g], sc[2g + 1]) pair -> (sc[2g], sc[2g]) / (sc[2g + 1], ...)
  const __m256i ctl_a = _mm256_setr_epi8(0, 1, 0, 1, 4, 5, 4, 5, 8, 9, 8, 9, 12, 13, 12, 13, 0, 1,
                                         0, 1, 4, 5, 4, 5, 8, 9, 8, 9, 12, 13, 12, 13);
  const __m256i ctl_b = _mm256_add_epi8(ctl_a, _mm256_set1_epi8(2));
#endif
  for (int64_t b = 0; b < nb; ++b, w += 1680) {
    I Iacc[MB];
    for (int j = 0; j < 8; ++j) {
      const uint8_t* gw = w + 208 * j;
      prefetch_tiles<NT>(gw, st, x.pf, 208);
      const int64_t g = 8 * b + j;
      // T: int16 (sc[2g], sc[2g + 1]) of row r in 32-bit lane r
      const I T = V::each([&](int64_t o) {
        return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(gw + o + 192)));
      }, st);
      I S[MB];
#if KILN_VNNI
      // values 0..15 (k = 0, 1) and 16..31 (k = 2, 3) summed apart in int32, then times
      // sc[2g] and sc[2g + 1] (T's low and high int16, sign-extended)
      I S2[MB];
#pragma GCC unroll 4
      for (int k = 0; k < 4; ++k) {
        I lo, hi;
        nib_k<NT>(gw, st, k, lo, hi);
        const I h0 = V::each([&](int64_t o) { return load32(gw + o + 128); }, st);
        const I h1 = V::each([&](int64_t o) { return load32(gw + o + 160); }, st);
        lo = v_or(lo, v_and(shift16(h0, 4 - 2 * k), m30));
        hi = v_or(hi, v_and(shift16(h1, 4 - 2 * k), m30));
        for (int m = 0; m < MB; ++m)
          acc_k(k < 2 ? S[m] : S2[m], lo, hi, x.q + m * x.K + 32 * g, k, !(k & 1));
      }
      const I sca = v_srai32(v_slli32(T, 16), 16);
      const I scb = v_srai32(T, 16);
      for (int m = 0; m < MB; ++m)
        S[m] = v_add32(v_mullo32(S[m], sca), v_mullo32(S2[m], scb));
#else
#pragma GCC unroll 4
      for (int k = 0; k < 4; ++k) {
        __m256i lo, hi;
        nib_k<1>(gw, st, k, lo, hi);  // the 2 high bits: lo's at 128, hi's at 160, bits 2k, 2k + 1
        lo = _mm256_or_si256(lo, _mm256_and_si256(shift16(load32(gw + 128), 4 - 2 * k), m30));
        hi = _mm256_or_si256(hi, _mm256_and_si256(shift16(load32(gw + 160), 4 - 2 * k), m30));
        const __m256i scl = _mm256_shuffle_epi8(T, k < 2 ? ctl_a : ctl_b);
        for (int m = 0; m < MB; ++m) {  // int16: 4 products of at most 63 x 127 (32004)
          const __m256i t = _mm256_madd_epi16(pair_k(lo, hi, x.q + m * x.K + 32 * g, k), scl);
          S[m] = k ? _mm256_add_epi32(S[m], t) : t;
          pin(S[m]);
        }
      }
#endif
      for (int m = 0; m < MB; ++m) {
        // codes are q - 32: minus 32 x (sc[2g] x sum of codes 0..15 + sc[2g + 1] x 16..31)
        const I off = v_madd16(T, V::i32(x.h[m * x.G + g]));
        const I t = v_sub32(S[m], v_slli32(off, 5));
        Iacc[m] = j ? v_add32(Iacc[m], t) : t;
        pin(Iacc[m]);
      }
    }
    const auto d = f16s<NT>(w + 1664, st);
    for (int m = 0; m < MB; ++m)
      acc[m] = v_fmadd(v_cvt(Iacc[m]), v_mul(d, V::f32(x.d[m * x.G + 8 * b])), acc[m]);
  }
  for (int m = 0; m < MB; ++m) out[m] = acc[m];
}

template <int MB, int NT>
TileFn<NT> tile_for(int64_t type) {
  switch (type) {
    case kQ8_0: return &tile_q8_0<MB, NT>;
    case kQ5_0: return &tile_q5<MB, NT, false>;
    case kQ5_1: return &tile_q5<MB, NT, true>;
    case kQ4_K: return &tile_qk<MB, NT, false>;
    case kQ5_K: return &tile_qk<MB, NT, true>;
    case kQ6_K: return &tile_q6_k<MB, NT>;
    default: return nullptr;
  }
}

}  // namespace

template <int NT, int MB>
void fill_tiles(TileFn<NT>* f, int64_t type) {
  f[MB] = tile_for<MB, NT>(type);
  if constexpr (MB < kTileRows) fill_tiles<NT, MB + 1>(f, type);
}

template void fill_tiles<1>(TileFn<1>*, int64_t);
#if KILN_VNNI
template void fill_tiles<2>(TileFn<2>*, int64_t);

TileFn<2> wide_tile(int64_t type) { return type == kQ8_0 ? &tile_q8_0<kWideRows, 2> : nullptr; }
#endif

}  // namespace KILN_NS
