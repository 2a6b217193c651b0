// kiln's kernels for GGUF's quantized blocks, the file's codes and scales as they are (no
// second rounding; reordered into 8-row tiles): Q8_0, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K. Compiled
// with kernels.cpp into one library per ISA level (kiln/layers/kernels/build.py);
// kiln/layers/kquant.py's KQuantLinear calls `kq_pack` once and `kq_linear` per step.
//
// Weights: one tensor per part, uint8 [rows, row_bytes], each row the GGUF row's blocks as
// they are, or kq_pack's tiles of them (a merged qkv / gate_up layer is several parts, one
// per checkpoint tensor, each of its own type: Q4_K_M files mix Q4_K, Q5_0, Q6_K and Q8_0
// inside one layer). Block layouts
// (ggml's; the same facts as kiln/models/gguf.py's dequantizer):
//
//   Q8_0  34 B / 32:   f16 d, int8 q[32]                        w = d * q
//   Q5_0  22 B / 32:   f16 d, u32 qh, u8 qs[16]                 w = d * (q - 16)
//   Q5_1  24 B / 32:   f16 d, f16 m, u32 qh, u8 qs[16]          w = d * q + m
//         (q = low nibble of qs[j] for j < 16, high nibble of qs[j - 16] after; bit 4 = bit j
//          of qh)
//   Q4_K 144 B / 256:  f16 d, f16 dmin, 12 B of 6-bit scales/mins sc[8], m[8], u8 qs[128]
//                      sub-block j (32 values): w = d * sc[j] * q - dmin * m[j]; sub-blocks
//                      2c and 2c+1 are the low and high nibbles of qs[32c .. 32c+31]
//   Q5_K 176 B / 256:  Q4_K's header, u8 qh[32], u8 qs[128]; bit 4 of sub-block j's value i
//                      is bit j of qh[i]
//   Q6_K 210 B / 256:  u8 ql[128], u8 qh[64], int8 sc[16], f16 d; w = d * sc[i / 16] * (q - 32)
//                      with q = 4 low bits from ql, 2 high bits from qh (see dot_q6_k)
//
// Activations are quantized once per call, per row, in int8 with d = amax / 127 and
// xq = round(x / d) over a span: 32 values for Q8_0 / Q5_0 / Q5_1 (llama.cpp's Q8_0 form),
// 256 for the K-quants (its Q8_K form: one scale per super-block, so a tile sums a whole
// super-block in int32 and does its float work once, not per group of 32). Every dot product
// is then exactly (up to fp32 summation order) the dequantized weight times the dequantized
// activation: sum over a group of w_i * d * xq_i, including the min terms (K-quants' mins use
// the rounded activation's sums, as llama.cpp's Q8_K bsums do). kiln/layers/kquant.py's
// `reference` computes that in PyTorch; the tests compare the two on blocks written by the
// `gguf` package's quantizers.
//
// The integer dot products: _mm256_maddubs_epi16 (u8 x s8 -> pairs summed into int16) then
// _mm256_madd_epi16 with ones (-> int32 sums of 4). Signed weights (Q8_0, Q5_0) use the sign
// trick (|w| as u8, x with w's sign). int16 never saturates: |pair| <= 128 * 127 * 2 = 32512
// (Q8_0), 63 * 127 * 2 = 16002 (Q6_K; minus 32 * 254 for its offset: 24130).
//
// Two layouts: every type is repacked at load (kq_pack, below: the same bits, moved) into
// tiles of 8 output rows in which each 32-bit lane of a 32-byte vector holds one row's codes
// for the same four values: one maddubs against those four activation codes broadcast gives
// the 8 rows' products in row order, and a group's products add up in place (no horizontal
// sums, the float work shared by the 8 rows). The row-at-a-time kernels over the raw rows
// stay as the tiles' reference (tests) and for callers that pass raw rows.
//
// Work: items are (8 weight rows, up to 64 activation rows); each weight vector is expanded
// once and used by up to 4 activation rows in turn, whose integer sums stay in registers
// until the group's float step; a row's 8-64 KB of activations stay in L2 across the item's
// weight rows. Each output is computed alone in a fixed order (its own blocks, its own
// activation row): a row's result does not depend on the other rows of the step
// (batch-invariant).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "simd.h"

namespace KILN_NS {
namespace {

// ggml type ids (GGUF's tensor-table values)
constexpr int64_t kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14;
constexpr int kMaxRows = 4;  // activation rows per register block (row kernels)
// Activation rows per pass of a tile kernel: each weight vector, once expanded, serves them all.
// AVX-512's 32 vector registers hold 8 rows' sums where AVX2's 16 hold 4 (more would spill;
// Zen 4, 2 threads, 16 rows: Q4_K 0.358 -> 0.329 ms, Q6_K 0.421 -> 0.378, Q8_0 3.35 -> 3.10).
// The 5-bit types keep two int16 sums per row without VNNI (kQ5Split, below), one int32 sum
// with it, so they take 8 rows there too. The k loops are unrolled by pragma: left to GCC, the
// 5-bit ones kept a loop whose shift16 became an indirect jump per vector (Zen 4, 1 thread,
// 16 rows, 9728 x 896 Q5_0: 1.35 -> 1.22 ms; the Q8_0 head 26.3 -> 25.3).
constexpr int kTileRows = KILN_VNNI ? 8 : 4;


int64_t block_elems(int64_t type) {
  return (type == kQ4_K || type == kQ5_K || type == kQ6_K) ? 256 : 32;
}

int64_t block_bytes(int64_t type) {
  switch (type) {
    case kQ8_0: return 34;
    case kQ5_0: return 22;
    case kQ5_1: return 24;
    case kQ4_K: return 144;
    case kQ5_K: return 176;
    case kQ6_K: return 210;
    default: return 0;
  }
}

// ---- the tiled layout (kq_pack): 8 output rows per tile, the GGUF blocks' own codes and
// scales reordered so that 32-bit lane r of every 32-byte vector is row r. Per (tile, block),
// with "nib" = 128 bytes of 4-bit codes for one group of 32 values of the 8 rows: 4 vectors,
// vector k byte 4r + i = row r's value 8k + i (low nibble) | value 8k + 4 + i << 4, i < 4;
// with "H" = 32 bytes of fifth bits: byte 4r + i bit 2k = row r's value 8k + i, bit 2k + 1
// = value 8k + 4 + i:
//   Q8_0 272 B / 32:  codes 256 B: vector k byte 4r + i = row r's value 4k + i, as q + 128
//                     (uint8); fp16 d of rows 0..7 at 256
//   Q5_0 176 B / 32:  nib (low 4 bits), H at 128, fp16 d of rows 0..7 at 160
//   Q5_1 192 B / 32:  Q5_0's, then fp16 m of rows 0..7 at 176
//   Q4_K 1184 B / 256: nib of sub-block j at 128j (j = 0..7); 6-bit scales sc[j] of rows 0..7
//                     as bytes at 1024 + 8j, mins at 1088 + 8j; fp16 d at 1152, dmin at 1168
//   Q5_K 1440 B / 256: sub-block j at 160j: nib, then its H at 160j + 128; scales at
//                     1280 + 8j, mins at 1344 + 8j; fp16 d at 1408, dmin at 1424
//   Q6_K 1680 B / 256: group g (32 values, two 16-value scales) at 208g: nib (low 4 bits);
//                     the 2 high bits as two H-like vectors: at 128, byte 4r + i bits 2k, 2k + 1
//                     = row r's value 8k + i, at 160 the same for value 8k + 4 + i; int8
//                     scales (row r: sc[2g], sc[2g + 1]) at 192 + 2r; fp16 d of rows 0..7 at 1664
// Rows past the tensor's end are zero (d = 0: their outputs are 0 and not stored). The map
// below is written once and serves both directions (kq_pack and kq_unpack, its inverse).

int64_t tile_block_bytes(int64_t type) {
  switch (type) {
    case kQ8_0: return 272;
    case kQ5_0: return 176;
    case kQ5_1: return 192;
    case kQ4_K: return 1184;
    case kQ5_K: return 1440;
    case kQ6_K: return 1680;
    default: return 0;
  }
}

bool tiled_type(int64_t type) { return tile_block_bytes(type) > 0; }

// Moves n bits (within one byte on both sides) from src at bit sb to dst at bit db.
inline void move_bits(const uint8_t* src, int64_t sb, uint8_t* dst, int64_t db, int n) {
  const int v = (src[sb >> 3] >> (sb & 7)) & ((1 << n) - 1);
  dst[db >> 3] = static_cast<uint8_t>((dst[db >> 3] & ~(((1 << n) - 1) << (db & 7))) |
                                      (v << (db & 7)));
}

// byte offset in a nib of row t's value i's 4 bits, as a bit offset
inline int64_t nib_bit(int t, int i) {
  return 8 * (32 * (i >> 3) + 4 * t + (i & 3)) + 4 * ((i >> 2) & 1);
}

// bit offset in an H (32 B of fifth bits, Q5_0 / Q5_1 / Q5_K) of row t's value i
inline int64_t h_bit(int t, int i) {
  return 8 * (4 * t + (i & 3)) + 2 * (i >> 3) + ((i >> 2) & 1);
}

// A Q4_K / Q5_K header's 12 bytes of 6-bit scales and mins (see k_scales) at raw bit offset
// rs -> the tile's byte rows of scales (at bit sc) and mins (at bit mn), row t's column.
template <typename Mv>
void map_k_scales(Mv mv, int64_t rs, int64_t sc, int64_t mn, int t) {
  for (int j = 0; j < 4; ++j) {
    mv(rs + 8 * j, sc + 8 * (8 * j + t), 6);
    mv(rs + 8 * (4 + j), mn + 8 * (8 * j + t), 6);
    mv(rs + 8 * (8 + j), sc + 8 * (8 * (j + 4) + t), 4);
    mv(rs + 8 * j + 6, sc + 8 * (8 * (j + 4) + t) + 4, 2);
    mv(rs + 8 * (8 + j) + 4, mn + 8 * (8 * (j + 4) + t), 4);
    mv(rs + 8 * (4 + j) + 6, mn + 8 * (8 * (j + 4) + t) + 4, 2);
  }
}

// One (raw block of row t, tile block) pair: every field of the raw block moved to its place
// in the tile (to_tile) or back.
void map_block(int64_t type, uint8_t* raw, uint8_t* tile, int t, bool to_tile) {
  auto mv = [&](int64_t rb, int64_t tb, int n) {
    if (to_tile) move_bits(raw, rb, tile, tb, n);
    else move_bits(tile, tb, raw, rb, n);
  };
  switch (type) {
    case kQ8_0:
      for (int k = 0; k < 2; ++k) mv(8 * k, 8 * (256 + 2 * t + k), 8);
      // codes stored offset, q + 128 as uint8 (the sign bit flipped): see tile_q8_0
      for (int i = 0; i < 32; ++i) {
        uint8_t& tb = tile[32 * (i >> 2) + 4 * t + (i & 3)];
        uint8_t& rb = raw[2 + i];
        if (to_tile) tb = rb ^ 0x80;
        else rb = tb ^ 0x80;
      }
      break;
    case kQ5_0:
    case kQ5_1: {
      const int qh = type == kQ5_1 ? 4 : 2;  // Q5_1: d, m, qh, qs; Q5_0: d, qh, qs
      for (int k = 0; k < 2; ++k) mv(8 * k, 8 * (160 + 2 * t + k), 8);
      if (type == kQ5_1)
        for (int k = 0; k < 2; ++k) mv(8 * (2 + k), 8 * (176 + 2 * t + k), 8);
      for (int i = 0; i < 32; ++i) {
        mv(8 * (qh + 4 + (i & 15)) + 4 * (i >> 4), nib_bit(t, i), 4);
        mv(8 * qh + i, 8 * 128 + h_bit(t, i), 1);
      }
      break;
    }
    case kQ4_K:
    case kQ5_K: {
      const bool q5 = type == kQ5_K;
      const int64_t sub = q5 ? 160 : 128, sc = q5 ? 1280 : 1024, hd = sc + 128;
      for (int k = 0; k < 2; ++k) {
        mv(8 * k, 8 * (hd + 2 * t + k), 8);
        mv(8 * (2 + k), 8 * (hd + 16 + 2 * t + k), 8);
      }
      map_k_scales(mv, 8 * 4, 8 * sc, 8 * (sc + 64), t);
      const int64_t qs = q5 ? 48 : 16;
      for (int j = 0; j < 8; ++j)
        for (int i = 0; i < 32; ++i) {
          mv(8 * (qs + 32 * (j >> 1) + i) + 4 * (j & 1), 8 * sub * j + nib_bit(t, i), 4);
          if (q5) mv(8 * (16 + i) + j, 8 * (sub * j + 128) + h_bit(t, i), 1);
        }
      break;
    }
    case kQ6_K:
      for (int k = 0; k < 2; ++k) mv(8 * (208 + k), 8 * (1664 + 2 * t + k), 8);
      for (int g = 0; g < 8; ++g) {
        const int hf = g >> 2, r = g & 3;  // the half of 128 values and its quarter
        for (int c = 0; c < 2; ++c) mv(8 * (192 + 2 * g + c), 8 * (208 * g + 192 + 2 * t + c), 8);
        for (int l = 0; l < 32; ++l) {
          mv(8 * (64 * hf + 32 * (r & 1) + l) + 4 * (r >> 1), 8 * 208 * g + nib_bit(t, l), 4);
          mv(8 * (128 + 32 * hf + l) + 2 * r,
             8 * (208 * g + 128 + 32 * ((l >> 2) & 1) + 4 * t + (l & 3)) + 2 * (l >> 3), 2);
        }
      }
      break;
    default: break;
  }
}


// One quantized activation row: codes q [K], per group of 32 its span's scale d [K/32] (the
// same for the 8 groups of a 256-value span) and s [K/32] (d * sum(q)).
struct XRow {
  const int8_t* q;
  const float* d;
  const float* s;
  const int32_t* is;  // sum of the group's codes (the tiles' Q5_0 offset, K-quants' mins)
  const int32_t* h;   // int16 pair: sums of codes 0..15 and 16..31 (the tiles' Q6_K offset)
};

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

using DotFn = void (*)(const uint8_t*, int64_t, const XRow*, float*);

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

inline __m256 u8x8(const uint8_t* p) {  // 8 bytes -> 8 floats
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// The activation rows a tile kernel reads: row m's codes at q + m * K, its per-group scalars
// at d / s / is / h + m * G (the rows of one kq_linear call are consecutive).
struct XTiles {
  const int8_t* q;
  const float* d;
  const float* s;
  const int32_t* is;
  const int32_t* h;
  int64_t K, G;
  int64_t pf = KILN_PF;  // where the kernel's prefetches point (simd.h's pass_prefetch)
};


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
// group's activation code sum `is` being at hand. Without VNNI vpmaddubsw's int16 pairs of
// u x would saturate (2 x 255 x 127), so there the sign bit is flipped back once per vector
// and the signed codes go through the sign trick (|q| x sign(x, q)). Both give sum(q x)
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
        S[m] = v_dp(k ? S[m] : V::zero(), u, V::x4(x.q + m * x.K + 32 * b + 4 * k));
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
#if KILN_VNNI
      S[m] = v_sub32(S[m], V::i32(128 * x.is[m * x.G + b]));
#endif
      acc[m] = v_fmadd(v_cvt(S[m]), v_mul(d, V::f32(x.d[m * x.G + b])), acc[m]);
    }
  }
  for (int m = 0; m < MB; ++m) out[m] = acc[m];
}

// Without VNNI a group of 5-bit codes' int16 sums would reach 8 x 2 x 31 x 127: two sums per
// row, S (vectors 0, 1) and S2 (2, 3), each at most 31496. With VNNI the sums are int32: one.
constexpr bool kQ5Split = !KILN_VNNI;

// The sums of a group of 5-bit codes (nib + H at w) against MB rows: S, and S2 if kQ5Split
template <int MB, int NT>
inline void q5_sums(const uint8_t* w, int64_t st, const int8_t* xq, int64_t K,
                    typename Vec<NT>::I* S, typename Vec<NT>::I* S2) {
#pragma GCC unroll 4
  for (int k = 0; k < 4; ++k) {
    typename Vec<NT>::I lo, hi;
    nib_k<NT>(w, st, k, lo, hi);
    bit4_k<NT>(w + 128, st, k, lo, hi);
    for (int m = 0; m < MB; ++m) {
      if (kQ5Split)
        acc_k(k < 2 ? S[m] : S2[m], lo, hi, xq + m * K, k, !(k & 1));
      else
        acc_k(S[m], lo, hi, xq + m * K, k, k == 0);
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
    q5_sums<MB, NT>(w, st, x.q + 32 * b, x.K, S, S2);
    const auto d = f16s<NT>(w + 160, st);
    for (int m = 0; m < MB; ++m) {
      auto t = kQ5Split ? v_add32(sum32(S[m]), sum32(S2[m])) : sum32(S[m]);
      // Q5_0's codes are q - 16: minus 16 x the group's sum of activation codes
      if (!kMin) t = v_sub32(t, V::i32(16 * x.is[m * x.G + b]));
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

// A tile kernel on NT tiles (st: the second tile's offset) and MB activation rows
template <int NT>
using TileFn = void (*)(const uint8_t*, int64_t, int64_t, const XTiles&, typename Vec<NT>::F*);

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

// f[mb] = the kernel for mb activation rows, mb = 1..kTileRows (f[0] unused)
template <int NT, int MB = 1>
void fill_tiles(TileFn<NT>* f, int64_t type) {
  f[MB] = tile_for<MB, NT>(type);
  if constexpr (MB < kTileRows) fill_tiles<NT, MB + 1>(f, type);
}

struct Part {
  const uint8_t* w;
  int64_t row_bytes, rows, row0, nb;
  bool tiled;  // kq_pack's layout (tile_bytes per 8 rows) or raw rows
  int64_t slot;  // which rounding of the activation it reads (kq_linear's `spans`)
  int64_t tile_bytes;
  DotFn fn[kMaxRows + 1];  // fn[mb]: mb activation rows at once
  TileFn<1> tfn[kTileRows + 1];
#if KILN_VNNI
  TileFn<2> tfn2[kTileRows + 1];  // two tiles in one 512-bit vector
#endif
};


// y [M, N] = x [M, K] @ W^T, W = the parts' rows stacked (N = the sum of `rows`), in x's
// dtype. A part is raw rows (uint8 [rows, row_bytes]) or kq_pack's tiles (uint8
// [ceil(rows / 8), K / block, tile block bytes]).
at::Tensor kq_linear_impl(const at::Tensor& x, at::TensorList weights, at::IntArrayRef types,
                          at::IntArrayRef rows) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "kq_linear: x must be [M, K] float32 or bfloat16");
  TORCH_CHECK(weights.size() == types.size() && weights.size() == rows.size() && !weights.empty(),
              "kq_linear: one type and one row count per weight part");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K % 32 == 0, "kq_linear: K must be a multiple of 32");
  int64_t N = 0;
  for (size_t i = 0; i < weights.size(); ++i) {
    const auto& w = weights[i];
    const int64_t be = block_elems(types[i]), bb = block_bytes(types[i]);
    TORCH_CHECK(bb > 0, "kq_linear: unsupported ggml type ", types[i]);
    TORCH_CHECK(w.scalar_type() == at::kByte && w.is_contiguous() && K % be == 0,
                "kq_linear: part ", i, " must be contiguous uint8 with K a multiple of ", be);
    if (w.dim() == 3) {
      TORCH_CHECK(tiled_type(types[i]) && w.size(0) == (rows[i] + 7) / 8 && w.size(1) == K / be &&
                      w.size(2) == tile_block_bytes(types[i]),
                  "kq_linear: tiled part ", i, " does not match K = ", K, " and ", rows[i], " rows");
    } else {
      TORCH_CHECK(w.dim() == 2 && w.size(0) == rows[i] && w.size(1) == K / be * bb,
                  "kq_linear: part ", i, " must be [", rows[i], ", ", K / be * bb, "]");
    }
    N += rows[i];
  }
  auto y = at::empty({M, N}, x.options().dtype(at::kFloat));
  if (M == 0 || N == 0) return y.to(x.scalar_type());
  std::vector<Part> parts;
  // the activation rounded per span of the parts' block size (32, or 256 for the K-quants; a
  // Q4_K_M layer can mix both): spans[s]'s rows sit at s * M rows in each buffer below
  std::vector<int64_t> spans;
  int64_t row0 = 0;
  for (size_t i = 0; i < weights.size(); ++i) {
    Part p;
    p.w = weights[i].data_ptr<uint8_t>();
    p.rows = rows[i];
    p.tiled = weights[i].dim() == 3;
    p.row_bytes = p.tiled ? 0 : weights[i].size(1);
    p.tile_bytes = p.tiled ? weights[i].size(1) * weights[i].size(2) : 0;
    p.row0 = row0;
    p.nb = K / block_elems(types[i]);
    const auto sp = std::find(spans.begin(), spans.end(), block_elems(types[i]));
    p.slot = sp - spans.begin();
    if (sp == spans.end()) spans.push_back(block_elems(types[i]));
    p.fn[0] = nullptr;
    p.fn[1] = dot_for<1>(types[i]);
    p.fn[2] = dot_for<2>(types[i]);
    p.fn[3] = dot_for<3>(types[i]);
    p.fn[4] = dot_for<4>(types[i]);
    fill_tiles<1>(p.tfn, types[i]);
#if KILN_VNNI
    fill_tiles<2>(p.tfn2, types[i]);
#endif
    parts.push_back(p);
    row0 += p.rows;
  }
  // Pairs of tiles (512-bit kernels) from one full pass of activation rows up: below it a step
  // streams its weights from memory and one tile at a time streams faster (Zen 4, 1 thread,
  // 152k x 896 Q8_0 from DRAM: 1 row 8.1-8.4 ms single vs 11.9-13.2 paired), at and above it
  // the dot products bound the call and pairs do twice the work per instruction (16 rows,
  // Qwen2.5-0.5B's shapes: Q5_0 -24%, Q4_K -12%, Q6_K -9%, the Q8_0 head -12%).
  const bool pairs = M >= kTileRows;
  // work items' weight rows: (part, first row) of up to 8 rows (raw rows), or kMaxTiles tiles
  constexpr int64_t kTile = 8, kChunk = 64;
  std::vector<int64_t> tile_part, tile_row;
  for (size_t i = 0; i < parts.size(); ++i)
    for (int64_t r = 0; r < parts[i].rows; r += parts[i].tiled && pairs ? kTile * kMaxTiles : kTile) {
      tile_part.push_back(static_cast<int64_t>(i));
      tile_row.push_back(r);
    }
  const int64_t NT = static_cast<int64_t>(tile_part.size());
  const int64_t chunks = (M + kChunk - 1) / kChunk, G = K / 32;
  const int64_t F = static_cast<int64_t>(spans.size());
  std::vector<int8_t> xq(F * M * K);
  std::vector<float> xd(F * M * G), xs(F * M * G);
  std::vector<int32_t> xi(F * M * G), xh(F * M * G);
  const auto xc = x.contiguous();
  float* yp = y.data_ptr<float>();
  auto xrow = [&](int64_t slot, int64_t r) -> XRow {
    r += slot * M;
    return {xq.data() + r * K, xd.data() + r * G, xs.data() + r * G, xi.data() + r * G,
            xh.data() + r * G};
  };
  const int nthreads = std::max(1, at::get_num_threads());
#pragma omp parallel num_threads(nthreads)
  {
#pragma omp for schedule(static)
    for (int64_t fr = 0; fr < F * M; ++fr) {  // fr = slot * M + r
      const int64_t r = fr % M, span = spans[fr / M];
      int8_t* q = xq.data() + fr * K;
      float *d = xd.data() + fr * G, *s = xs.data() + fr * G;
      int32_t *is = xi.data() + fr * G, *h = xh.data() + fr * G;
      if (x.scalar_type() == at::kFloat)
        quantize_row(xc.data_ptr<float>() + r * K, K, span, q, d, nullptr, s, is, h);
      else
        quantize_row(xc.data_ptr<at::BFloat16>() + r * K, K, span, q, d, nullptr, s, is, h);
    }
#pragma omp for schedule(static)
    for (int64_t item = 0; item < NT * chunks; ++item) {
      const int64_t t = item % NT, c = item / NT;
      const Part& p = parts[tile_part[t]];
      const int64_t r0 = tile_row[t], m0 = c * kChunk, mn = std::min(kChunk, M - m0);
      if (p.tiled) {
        const int64_t nr = std::min(pairs ? kTile * kMaxTiles : kTile, p.rows - r0);
        const uint8_t* wt = p.w + (r0 / kTile) * p.tile_bytes;
        const int64_t step = (nr + kTile - 1) / kTile * p.tile_bytes;  // to the next item's tiles
        for (int64_t m = m0; m < m0 + mn; m += kTileRows) {
          const int mb = static_cast<int>(std::min<int64_t>(kTileRows, m0 + mn - m));
          const XRow x0 = xrow(p.slot, m);
          const int64_t pf = pass_prefetch(static_cast<int>((m - m0) / kTileRows), step);
          const XTiles xt{x0.q, x0.d, x0.s, x0.is, x0.h, K, G, pf};
          alignas(64) float tmp[kTile * kMaxTiles];
          auto store = [&](int i) {
            std::memcpy(yp + (m + i) * N + p.row0 + r0, tmp, nr * sizeof(float));
          };
#if KILN_VNNI
          if (nr > kTile) {
            __m512 out[kTileRows];
            p.tfn2[mb](wt, p.tile_bytes, p.nb, xt, out);
            for (int i = 0; i < mb; ++i) {
              _mm512_store_ps(tmp, out[i]);
              store(i);
            }
            continue;
          }
#endif
          __m256 out[kTileRows];
          p.tfn[mb](wt, p.tile_bytes, p.nb, xt, out);
          for (int i = 0; i < mb; ++i) {
            _mm256_store_ps(tmp, out[i]);
            store(i);
          }
        }
        continue;
      }
      const int64_t nr = std::min(kTile, p.rows - r0);
      for (int64_t r = r0; r < r0 + nr; ++r) {
        const uint8_t* wr = p.w + r * p.row_bytes;
        for (int64_t m = m0; m < m0 + mn; m += kMaxRows) {
          const int mb = static_cast<int>(std::min<int64_t>(kMaxRows, m0 + mn - m));
          XRow xr[kMaxRows];
          float out[kMaxRows];
          for (int i = 0; i < mb; ++i) xr[i] = xrow(p.slot, m + i);
          p.fn[mb](wr, p.nb, xr, out);
          for (int i = 0; i < mb; ++i) yp[(m + i) * N + p.row0 + r] = out[i];
        }
      }
    }
  }
  return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}

// Raw GGUF rows uint8 [rows, row_bytes] of `type` <-> the tiled layout uint8 [ceil(rows / 8),
// blocks per row, tile block bytes]: the same bits, moved (map_block), nothing rounded.
at::Tensor kq_pack(const at::Tensor& raw, int64_t type) {
  TORCH_CHECK(tiled_type(type), "kq_pack: no tiled layout for ggml type ", type);
  TORCH_CHECK(raw.dim() == 2 && raw.scalar_type() == at::kByte && raw.size(1) % block_bytes(type) == 0,
              "kq_pack: raw must be uint8 [rows, blocks * ", block_bytes(type), "]");
  const auto rc = raw.contiguous();
  const int64_t R = rc.size(0), nb = rc.size(1) / block_bytes(type), NT = (R + 7) / 8;
  const int64_t bb = block_bytes(type), tb = tile_block_bytes(type);
  auto out = at::zeros({NT, nb, tb}, raw.options());
  uint8_t* src = rc.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, NT, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t r = 8 * t; r < std::min(R, 8 * t + 8); ++r)
        for (int64_t b = 0; b < nb; ++b)
          map_block(type, src + (r * nb + b) * bb, dst + (t * nb + b) * tb, static_cast<int>(r - 8 * t),
                    true);
  });
  return out;
}

at::Tensor kq_unpack(const at::Tensor& packed, int64_t type, int64_t rows) {
  TORCH_CHECK(tiled_type(type) && packed.dim() == 3 && packed.scalar_type() == at::kByte &&
                  packed.size(2) == tile_block_bytes(type) && packed.size(0) == (rows + 7) / 8,
              "kq_unpack: not kq_pack's layout of ", rows, " rows of type ", type);
  const auto pc = packed.contiguous();
  const int64_t nb = pc.size(1), bb = block_bytes(type), tb = tile_block_bytes(type);
  auto out = at::zeros({rows, nb * bb}, packed.options());
  uint8_t* src = pc.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, rows, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t b = 0; b < nb; ++b)
        map_block(type, dst + (r * nb + b) * bb, src + ((r / 8) * nb + b) * tb,
                  static_cast<int>(r % 8), false);
  });
  return out;
}

bool has_tiles(int64_t type) { return tiled_type(type); }

}  // namespace

at::Tensor kq_linear(const at::Tensor& x, at::TensorList weights, at::IntArrayRef types,
                     at::IntArrayRef rows) {
  return kq_linear_impl(x, weights, types, rows);
}

KILN_LIBRARY_FRAGMENT(m) {
  m.def("kq_linear(Tensor x, Tensor[] weights, int[] types, int[] rows) -> Tensor");
  m.def("kq_pack(Tensor raw, int type) -> Tensor");
  m.def("kq_unpack(Tensor packed, int type, int rows) -> Tensor");
  m.def("has_tiles(int type) -> bool");
  m.impl("has_tiles", &has_tiles);
  m.impl("kq_linear", c10::DispatchKey::CPU, &kq_linear);
  m.impl("kq_pack", c10::DispatchKey::CPU, &kq_pack);
  m.impl("kq_unpack", c10::DispatchKey::CPU, &kq_unpack);
}

}  // namespace KILN_NS
