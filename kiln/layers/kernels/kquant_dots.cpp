// kiln's GGUF-block kernels over raw rows, one weight row at a time (the file's blocks as
// they are, no tiles): the tiles' reference in the tests and the path for callers that pass
// raw rows. Formats and the activation's rounding: kquant.cpp's head comment. Compute only: no
// ATen here (kernels.h says why).
//
// The integer dot products: _mm256_maddubs_epi16 (u8 x s8 -> pairs summed into int16) then
// _mm256_madd_epi16 with ones (-> int32 sums of 4). Signed weights (Q8_0, Q5_0) use the sign
// trick (|w| as u8, x with w's sign). int16 never saturates: |pair| <= 128 * 127 * 2 = 32512
// (Q8_0), 63 * 127 * 2 = 16002 (Q6_K; minus 32 * 254 for its offset: 24130).

#include <cstdint>
#include <cstring>

#include "kquant.h"

namespace KILN_NS {
namespace {

inline float f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// int32 sums of 4 products, u8 weights x s8 activations
inline __m256i dot_u8(__m256i w, __m256i x) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1));
}

// the same for s8 weights (sign trick: |w| x sign(w) * x)
inline __m256i dot_s8(__m256i w, __m256i x) {
  return dot_u8(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
}

// Bit j of `bits` -> byte j: 0xFF where set, 0 elsewhere.
inline __m256i bits_to_bytes(uint32_t bits) {
  const __m256i shuf = _mm256_setr_epi64x(0x0000000000000000, 0x0101010101010101,
                                          0x0202020202020202, 0x0303030303030303);
  __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(bits)), shuf);
  v = _mm256_or_si256(v, _mm256_set1_epi64x(0x7FBFDFEFF7FBFDFE));  // all but bit j%8 set
  return _mm256_cmpeq_epi8(v, _mm256_set1_epi64x(-1));
}

// 16 bytes of packed nibbles -> 32 bytes: low nibbles (values 0..15), then high (16..31)
inline __m256i nibbles32(const uint8_t* p) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(v, 4), v), _mm256_set1_epi8(0x0F));
}

// ---- per type: one weight row (nb blocks) against MB activation rows -> out[m] (+=)
// Each function accumulates fp32 vectors per activation row and reduces them at the end.

// Two accumulators per activation row (even and odd blocks or sub-blocks): one chain of
// dependent FMAs per row made M=1 latency-bound (4 cycles a group), not throughput-bound.
template <int MB>
void dot_q8_0(const uint8_t* w, int64_t nb, const XRow* x, float* out) {
  __m256 acc[MB], acc2[MB];
  for (int m = 0; m < MB; ++m) acc[m] = acc2[m] = _mm256_setzero_ps();
  auto step = [&](int64_t b, __m256* a) {
    const uint8_t* blk = w + 34 * b;
    const float d = f16(blk);
    const __m256i q = load32(blk + 2);
    for (int m = 0; m < MB; ++m) {
      const __m256 p = _mm256_cvtepi32_ps(dot_s8(q, load32(x[m].q + 32 * b)));
      a[m] = _mm256_fmadd_ps(p, _mm256_set1_ps(d * x[m].d[b]), a[m]);
    }
  };
  int64_t b = 0;
  for (; b + 2 <= nb; b += 2) step(b, acc), step(b + 1, acc2);
  if (b < nb) step(b, acc);
  for (int m = 0; m < MB; ++m) out[m] = hsum(_mm256_add_ps(acc[m], acc2[m]));
}

template <int MB, bool kMin>
void dot_q5(const uint8_t* w, int64_t nb, const XRow* x, float* out) {
  // Q5_0 (kMin false): signed q - 16; Q5_1: unsigned q, plus m * sum(x)
  constexpr int64_t kBytes = kMin ? 24 : 22;
  constexpr int64_t kQh = kMin ? 4 : 2;
  __m256 acc[MB], acc2[MB];
  float msum[MB];
  for (int m = 0; m < MB; ++m) acc[m] = acc2[m] = _mm256_setzero_ps(), msum[m] = 0.0f;
  auto step = [&](int64_t b, __m256* a) {
    const uint8_t* blk = w + kBytes * b;
    const float d = f16(blk);
    uint32_t qh;
    std::memcpy(&qh, blk + kQh, 4);
    __m256i q = _mm256_or_si256(nibbles32(blk + kQh + 4),
                                _mm256_and_si256(bits_to_bytes(qh), _mm256_set1_epi8(0x10)));
    if (!kMin) q = _mm256_sub_epi8(q, _mm256_set1_epi8(16));
    for (int m = 0; m < MB; ++m) {
      const __m256i xv = load32(x[m].q + 32 * b);
      const __m256 p = _mm256_cvtepi32_ps(kMin ? dot_u8(q, xv) : dot_s8(q, xv));
      a[m] = _mm256_fmadd_ps(p, _mm256_set1_ps(d * x[m].d[b]), a[m]);
      if (kMin) msum[m] += f16(blk + 2) * x[m].s[b];
    }
  };
  int64_t b = 0;
  for (; b + 2 <= nb; b += 2) step(b, acc), step(b + 1, acc2);
  if (b < nb) step(b, acc);
  for (int m = 0; m < MB; ++m) out[m] = hsum(_mm256_add_ps(acc[m], acc2[m])) + msum[m];
}

// Q4_K / Q5_K's 12 bytes -> 6-bit scales sc[8] and mins mn[8]
inline void k_scales(const uint8_t* s, uint8_t* sc, uint8_t* mn) {
  for (int j = 0; j < 4; ++j) {
    sc[j] = s[j] & 63;
    mn[j] = s[j + 4] & 63;
    sc[j + 4] = (s[j + 8] & 0x0F) | ((s[j] >> 6) << 4);
    mn[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4);
  }
}

template <int MB, bool kQ5>
void dot_qk(const uint8_t* w, int64_t nb, const XRow* x, float* out) {
  constexpr int64_t kBytes = kQ5 ? 176 : 144;
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  const __m256i one = _mm256_set1_epi8(0x01);
  __m256 acc[MB], acc2[MB];
  float msum[MB];
  for (int m = 0; m < MB; ++m) acc[m] = acc2[m] = _mm256_setzero_ps(), msum[m] = 0.0f;
  for (int64_t b = 0; b < nb; ++b, w += kBytes) {
    const float d = f16(w), dmin = f16(w + 2);
    uint8_t sc[8], mn[8];
    k_scales(w + 4, sc, mn);
    const uint8_t* qs = w + (kQ5 ? 48 : 16);
    const __m256i qh = kQ5 ? load32(w + 16) : _mm256_setzero_si256();
    for (int c = 0; c < 4; ++c) {
      const __m256i v = load32(qs + 32 * c);
      __m256i lo = _mm256_and_si256(v, m4);
      __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
      if (kQ5) {  // bit 4 of sub-block j = bit j of qh (j = 2c, 2c + 1)
        const __m256i h0 = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * c)), one);
        const __m256i h1 =
            _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * c + 1)), one);
        lo = _mm256_or_si256(lo, _mm256_slli_epi16(h0, 4));
        hi = _mm256_or_si256(hi, _mm256_slli_epi16(h1, 4));
      }
      const int64_t g = 8 * b + 2 * c;  // the activation's group of sub-block 2c
      const float s0 = d * sc[2 * c], s1 = d * sc[2 * c + 1];
      const float n0 = dmin * mn[2 * c], n1 = dmin * mn[2 * c + 1];
      for (int m = 0; m < MB; ++m) {
        const __m256 p0 = _mm256_cvtepi32_ps(dot_u8(lo, load32(x[m].q + 32 * g)));
        const __m256 p1 = _mm256_cvtepi32_ps(dot_u8(hi, load32(x[m].q + 32 * g + 32)));
        acc[m] = _mm256_fmadd_ps(p0, _mm256_set1_ps(s0 * x[m].d[g]), acc[m]);
        acc2[m] = _mm256_fmadd_ps(p1, _mm256_set1_ps(s1 * x[m].d[g + 1]), acc2[m]);
        msum[m] += n0 * x[m].s[g] + n1 * x[m].s[g + 1];
      }
    }
  }
  for (int m = 0; m < MB; ++m) out[m] = hsum(_mm256_add_ps(acc[m], acc2[m])) - msum[m];
}

template <int MB>
void dot_q6_k(const uint8_t* w, int64_t nb, const XRow* x, float* out) {
  // Per half h (128 values): ql[64h .. 64h+63] = A (bytes 0..31) and B (32..63), qh[32h ..]
  // = H. Quarter r of the half (32 values, scales sc[8h + 2r], sc[8h + 2r + 1]):
  //   r=0: A & 15 | (H & 3) << 4      r=1: B & 15 | (H >> 2 & 3) << 4
  //   r=2: A >> 4 | (H >> 4 & 3) << 4  r=3: B >> 4 | (H >> 6 & 3) << 4       (q - 32)
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  const __m256i m3 = _mm256_set1_epi8(0x03);
  const __m256i k32 = _mm256_set1_epi8(32);
  __m256 acc[MB], acc2[MB];
  for (int m = 0; m < MB; ++m) acc[m] = acc2[m] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b, w += 210) {
    const float d = f16(w + 208);
    const int8_t* sc = reinterpret_cast<const int8_t*>(w + 192);
    for (int h = 0; h < 2; ++h) {
      const __m256i A = load32(w + 64 * h), B = load32(w + 64 * h + 32);
      const __m256i H = load32(w + 128 + 32 * h);
      __m256i q[4];
      q[0] = _mm256_or_si256(_mm256_and_si256(A, m4),
                             _mm256_slli_epi16(_mm256_and_si256(H, m3), 4));
      q[1] = _mm256_or_si256(_mm256_and_si256(B, m4),
                             _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(H, 2), m3), 4));
      q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(A, 4), m4),
                             _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(H, 4), m3), 4));
      q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(B, 4), m4),
                             _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(H, 6), m3), 4));
      for (int r = 0; r < 4; ++r) {
        // int16 lanes 0..7 (values 0..15) take sc[2r], 8..15 (values 16..31) sc[2r + 1]
        const __m256i scl = _mm256_set_m128i(_mm_set1_epi16(sc[8 * h + 2 * r + 1]),
                                             _mm_set1_epi16(sc[8 * h + 2 * r]));
        const int64_t g = 8 * b + 4 * h + r;
        for (int m = 0; m < MB; ++m) {
          const __m256i xv = load32(x[m].q + 32 * g);
          const __m256i p16 = _mm256_sub_epi16(_mm256_maddubs_epi16(q[r], xv),
                                               _mm256_maddubs_epi16(k32, xv));
          const __m256 p = _mm256_cvtepi32_ps(_mm256_madd_epi16(p16, scl));
          __m256& a = (r & 1) ? acc2[m] : acc[m];
          a = _mm256_fmadd_ps(p, _mm256_set1_ps(d * x[m].d[g]), a);
        }
      }
    }
  }
  for (int m = 0; m < MB; ++m) out[m] = hsum(_mm256_add_ps(acc[m], acc2[m]));
}

}  // namespace

template <int MB>
DotFn dot_for(int64_t type) {
  switch (type) {
    case kQ8_0: return &dot_q8_0<MB>;
    case kQ5_0: return &dot_q5<MB, false>;
    case kQ5_1: return &dot_q5<MB, true>;
    case kQ4_K: return &dot_qk<MB, false>;
    case kQ5_K: return &dot_qk<MB, true>;
    case kQ6_K: return &dot_q6_k<MB>;
    default: return nullptr;
  }
}

template DotFn dot_for<1>(int64_t);
template DotFn dot_for<2>(int64_t);
template DotFn dot_for<3>(int64_t);
template DotFn dot_for<4>(int64_t);

}  // namespace KILN_NS
