// kiln's kernels for GGUF's quantized blocks, the file's codes and scales as they are (no
// second rounding; reordered into 8-row tiles): Q8_0, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K. Compiled
// with the other kernel sources into one library per ISA level (kiln/layers/kernels/build.py);
// kiln/layers/quant/gguf_blocks.py's KQuantLinear calls `kq_pack` once and `kq_linear` per step.
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
// the rounded activation's sums, as llama.cpp's Q8_K bsums do).
// kiln/layers/kernels/reference.py's `kq_reference` computes that in PyTorch; the tests
// compare the two on blocks written by the `gguf` package's quantizers.
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
//
// Files: kquant.h (what they share), kquant_dots.cpp (the raw rows' kernels), kquant_tiles.cpp
// (the tile kernels); here the op (kq_linear), the packing (kq_pack / kq_unpack) and their
// registration.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kquant.h"
#include "ops.h"

namespace KILN_NS {
namespace {

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
// in the tile (to_tile) or back, bit by bit: the layout's one definition (kq_unpack runs it
// whole). codes = false: the scales, mins and d only; kq_pack moves the codes with pack_codes,
// which the pack round trip tests hold to this map.
void map_block(int64_t type, uint8_t* raw, uint8_t* tile, int t, bool to_tile,
               bool codes = true) {
  auto mv = [&](int64_t rb, int64_t tb, int n) {
    if (to_tile) move_bits(raw, rb, tile, tb, n);
    else move_bits(tile, tb, raw, rb, n);
  };
  switch (type) {
    case kQ8_0:
      for (int k = 0; k < 2; ++k) mv(8 * k, 8 * (256 + 2 * t + k), 8);
      // codes stored offset, q + 128 as uint8 (the sign bit flipped): see tile_q8_0
      for (int i = 0; i < 32 && codes; ++i) {
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
      for (int i = 0; i < 32 && codes; ++i) {
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
      for (int j = 0; j < 8 && codes; ++j)
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
        for (int l = 0; l < 32 && codes; ++l) {
          mv(8 * (64 * hf + 32 * (r & 1) + l) + 4 * (r >> 1), 8 * 208 * g + nib_bit(t, l), 4);
          mv(8 * (128 + 32 * hf + l) + 2 * r,
             8 * (208 * g + 128 + 32 * ((l >> 2) & 1) + 4 * t + (l & 3)) + 2 * (l >> 3), 2);
        }
      }
      break;
    default: break;
  }
}

// Row t's 32 values' low 4 bits into a tile's nib at `nib`: byte 32k + 4t + c = value
// 8k + c | value 8k + 4 + c << 4 (nib_bit's places, whole bytes at once).
inline void put_nib(const uint8_t* v, uint8_t* nib, int t) {
  for (int k = 0; k < 4; ++k)
    for (int c = 0; c < 4; ++c)
      nib[32 * k + 4 * t + c] =
          static_cast<uint8_t>((v[8 * k + c] & 15) | (v[8 * k + 4 + c] & 15) << 4);
}

// Row t's 32 values' fifth bits (bit 4) into an H at `h`: byte 4t + c holds value 8q + 4s + c's
// at bit 2q + s (h_bit's places).
inline void put_h(const uint8_t* v, uint8_t* h, int t) {
  for (int c = 0; c < 4; ++c) {
    int byte = 0;
    for (int q = 0; q < 4; ++q)
      for (int s = 0; s < 2; ++s) byte |= ((v[8 * q + 4 * s + c] >> 4) & 1) << (2 * q + s);
    h[4 * t + c] = static_cast<uint8_t>(byte);
  }
}

// Row t's 32 values' two high bits (bits 4, 5: Q6_K) into the two H-like vectors at `h`:
// byte 32s + 4t + c holds value 8q + 4s + c's at bits 2q, 2q + 1.
inline void put_h2(const uint8_t* v, uint8_t* h, int t) {
  for (int s = 0; s < 2; ++s)
    for (int c = 0; c < 4; ++c) {
      int byte = 0;
      for (int q = 0; q < 4; ++q) byte |= ((v[8 * q + 4 * s + c] >> 4) & 3) << (2 * q);
      h[32 * s + 4 * t + c] = static_cast<uint8_t>(byte);
    }
}

// The codes of row t's raw block into its tile block, as map_block moves them bit by bit (a
// byte a field there: 0.2-0.3 GB/s, 1.6 s of Qwen2.5-0.5B Q4_K_M's start on 2 cores), here a
// group of 32 values at a time: the values gathered into bytes, then placed whole.
void pack_codes(int64_t type, const uint8_t* raw, uint8_t* tile, int t) {
  uint8_t v[32];
  switch (type) {
    case kQ8_0:
      for (int i = 0; i < 32; ++i) tile[32 * (i >> 2) + 4 * t + (i & 3)] = raw[2 + i] ^ 0x80;
      break;
    case kQ5_0:
    case kQ5_1: {
      const int qh = type == kQ5_1 ? 4 : 2;
      for (int i = 0; i < 32; ++i)
        v[i] = static_cast<uint8_t>(((raw[qh + 4 + (i & 15)] >> (4 * (i >> 4))) & 15) |
                                    ((raw[qh + (i >> 3)] >> (i & 7)) & 1) << 4);
      put_nib(v, tile, t);
      put_h(v, tile + 128, t);
      break;
    }
    case kQ4_K:
    case kQ5_K: {
      const bool q5 = type == kQ5_K;
      const int64_t sub = q5 ? 160 : 128, qs = q5 ? 48 : 16;
      for (int j = 0; j < 8; ++j) {
        for (int i = 0; i < 32; ++i) {
          v[i] = (raw[qs + 32 * (j >> 1) + i] >> (4 * (j & 1))) & 15;
          if (q5) v[i] |= ((raw[16 + i] >> j) & 1) << 4;
        }
        put_nib(v, tile + sub * j, t);
        if (q5) put_h(v, tile + sub * j + 128, t);
      }
      break;
    }
    case kQ6_K:
      for (int g = 0; g < 8; ++g) {
        const int hf = g >> 2, r = g & 3;
        for (int l = 0; l < 32; ++l)
          v[l] = static_cast<uint8_t>(((raw[64 * hf + 32 * (r & 1) + l] >> (4 * (r >> 1))) & 15) |
                                      ((raw[128 + 32 * hf + l] >> (2 * r)) & 3) << 4);
        put_nib(v, tile + 208 * g, t);
        put_h2(v, tile + 208 * g + 128, t);
      }
      break;
    default: break;
  }
}

}  // namespace

void KqLinear::add(const uint8_t* w, int64_t type, int64_t rows, bool tiled, int64_t bytes) {
  KqPart p;
  p.w = w;
  p.rows = rows;
  p.tiled = tiled;
  p.row_bytes = tiled ? 0 : bytes;
  p.tile_bytes = tiled ? bytes : 0;
  p.row0 = N;
  p.nb = K / block_elems(type);
  const auto sp = std::find(spans.begin(), spans.end(), block_elems(type));
  p.slot = sp - spans.begin();
  if (sp == spans.end()) spans.push_back(block_elems(type));
  p.fn[0] = nullptr;
  p.fn[1] = dot_for<1>(type);
  p.fn[2] = dot_for<2>(type);
  p.fn[3] = dot_for<3>(type);
  p.fn[4] = dot_for<4>(type);
  fill_tiles<1>(p.tfn, type);
#if KILN_VNNI
  fill_tiles<2>(p.tfn2, type);
  p.wide = wide_tile(type);
#endif
  parts.push_back(p);
  N += rows;
}

void KqLinear::prepare(int64_t m) {
  M = m;
  // Pairs of tiles (512-bit kernels) from one full pass of activation rows up: below it a step
  // streams its weights from memory and one tile at a time streams faster (Zen 4, 1 thread,
  // 152k x 896 Q8_0 from DRAM: 1 row 8.1-8.4 ms single vs 11.9-13.2 paired), at and above it
  // the dot products bound the call and pairs do twice the work per instruction (16 rows,
  // Qwen2.5-0.5B's shapes: Q5_0 -24%, Q4_K -12%, Q6_K -9%, the Q8_0 head -12%).
  pairs = M >= kTileRows;
  // work items' weight rows: (part, first row) of up to 8 rows (raw rows), or kMaxTiles tiles
  tile_part.clear();
  tile_row.clear();
  for (size_t i = 0; i < parts.size(); ++i)
    for (int64_t r = 0; r < parts[i].rows; r += parts[i].tiled && pairs ? 8 * kMaxTiles : 8) {
      tile_part.push_back(static_cast<int64_t>(i));
      tile_row.push_back(r);
    }
  const int64_t F = static_cast<int64_t>(spans.size()), G = K / 32;
  xq.resize(F * M * K);
  xd.resize(F * M * G);
  xs.resize(F * M * G);
  xi.resize(F * M * G);
  xh.resize(F * M * G);
}

template <typename T>
void KqLinear::run(const T* x, float* y, const float* bias, const float* resid) {
  constexpr int64_t kTile = 8, kChunk = 64;
  const int64_t NT = static_cast<int64_t>(tile_part.size());
  const int64_t chunks = (M + kChunk - 1) / kChunk, G = K / 32;
  const int64_t F = static_cast<int64_t>(spans.size());
  auto xrow = [&](int64_t slot, int64_t r) -> XRow {
    r += slot * M;
    return {xq.data() + r * K, xd.data() + r * G, xs.data() + r * G, xi.data() + r * G,
            xh.data() + r * G};
  };
  // y's values as the op-by-op layer adds them: the linear's output, + its bias, then the
  // residual + that (one fp32 add each, the same operands: the same bits)
  auto put = [&](int64_t m, int64_t col, const float* v, int64_t n) {
    float* yr = y + m * N + col;
    if (bias == nullptr && resid == nullptr) {
      std::memcpy(yr, v, n * sizeof(float));
      return;
    }
    for (int64_t j = 0; j < n; ++j) {
      float a = v[j];
      if (bias) a = a + bias[col + j];
      if (resid) a = resid[m * N + col + j] + a;
      yr[j] = a;
    }
  };
#pragma omp for schedule(static)
  for (int64_t fr = 0; fr < F * M; ++fr) {  // fr = slot * M + r
    const int64_t r = fr % M, span = spans[fr / M];
    quantize_row(x + r * K, K, span, xq.data() + fr * K, xd.data() + fr * G, nullptr,
                 xs.data() + fr * G, xi.data() + fr * G, xh.data() + fr * G);
  }
#pragma omp for schedule(static)
  for (int64_t item = 0; item < NT * chunks; ++item) {
    const int64_t t = item % NT, c = item / NT;
    const KqPart& p = parts[tile_part[t]];
    const int64_t r0 = tile_row[t], m0 = c * kChunk, mn = std::min(kChunk, M - m0);
    if (p.tiled) {
      const int64_t nr = std::min(pairs ? kTile * kMaxTiles : kTile, p.rows - r0);
      const uint8_t* wt = p.w + (r0 / kTile) * p.tile_bytes;
      const int64_t step = (nr + kTile - 1) / kTile * p.tile_bytes;  // to the next item's tiles
      int pass = 0;
      for (int64_t m = m0, mb = 0; m < m0 + mn; m += mb, ++pass) {
#if KILN_VNNI
        const bool wide = nr > kTile && p.wide && m0 + mn - m >= kWideRows;
#else
        constexpr bool wide = false;
#endif
        mb = wide ? kWideRows : std::min<int64_t>(kTileRows, m0 + mn - m);
        const XRow x0 = xrow(p.slot, m);
        const int64_t pf = pass_prefetch(pass, step);
        const XTiles xt{x0.q, x0.d, x0.s, x0.is, x0.h, K, G, pf};
        alignas(64) float tmp[kTile * kMaxTiles];
#if KILN_VNNI
        if (nr > kTile) {  // a pair of tiles: 16 rows a pass (wide) or up to kTileRows
          __m512 out[kWideRows];
          (wide ? p.wide : p.tfn2[mb])(wt, p.tile_bytes, p.nb, xt, out);
          for (int i = 0; i < mb; ++i) {
            _mm512_store_ps(tmp, out[i]);
            put(m + i, p.row0 + r0, tmp, nr);
          }
          continue;
        }
#endif
        __m256 out[kTileRows];
        p.tfn[mb](wt, p.tile_bytes, p.nb, xt, out);
        for (int i = 0; i < mb; ++i) {
          _mm256_store_ps(tmp, out[i]);
          put(m + i, p.row0 + r0, tmp, nr);
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
        for (int i = 0; i < mb; ++i) put(m + i, p.row0 + r, out + i, 1);
      }
    }
  }
}
template void KqLinear::run<float>(const float*, float*, const float*, const float*);
template void KqLinear::run<at::BFloat16>(const at::BFloat16*, float*, const float*,
                                          const float*);

// The parts of a linear as kq_linear takes them, checked, into `lin` (M rows of x [M, K]).
void kq_plan(KqLinear& lin, int64_t M, int64_t K, at::TensorList weights,
             at::IntArrayRef types, at::IntArrayRef rows) {
  TORCH_CHECK(weights.size() == types.size() && weights.size() == rows.size() && !weights.empty(),
              "kq_linear: one type and one row count per weight part");
  TORCH_CHECK(K % 32 == 0, "kq_linear: K must be a multiple of 32");
  lin.reset(K);
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
    lin.add(w.data_ptr<uint8_t>(), types[i], rows[i], w.dim() == 3,
            w.dim() == 3 ? w.size(1) * w.size(2) : w.size(1));
  }
  lin.prepare(M);
}

namespace {

// y [M, N] = x [M, K] @ W^T, W = the parts' rows stacked (N = the sum of `rows`), in x's
// dtype. A part is raw rows (uint8 [rows, row_bytes]) or kq_pack's tiles (uint8
// [ceil(rows / 8), K / block, tile block bytes]).
at::Tensor kq_linear_impl(const at::Tensor& x, at::TensorList weights, at::IntArrayRef types,
                          at::IntArrayRef rows) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "kq_linear: x must be [M, K] float32 or bfloat16");
  const int64_t M = x.size(0), K = x.size(1);
  KqLinear lin;
  kq_plan(lin, M, K, weights, types, rows);
  auto y = at::empty({M, lin.N}, x.options().dtype(at::kFloat));
  if (M == 0 || lin.N == 0) return y.to(x.scalar_type());
  const auto xc = x.contiguous();
  float* yp = y.data_ptr<float>();
  const int nthreads = std::max(1, at::get_num_threads());
#pragma omp parallel num_threads(nthreads)
  {
    if (x.scalar_type() == at::kFloat)
      lin.run(xc.data_ptr<float>(), yp, nullptr, nullptr);
    else
      lin.run(xc.data_ptr<at::BFloat16>(), yp, nullptr, nullptr);
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
        for (int64_t b = 0; b < nb; ++b) {
          uint8_t* block = src + (r * nb + b) * bb;
          uint8_t* tile = dst + (t * nb + b) * tb;
          const int row = static_cast<int>(r - 8 * t);
          map_block(type, block, tile, row, true, /*codes=*/false);
          pack_codes(type, block, tile, row);
        }
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
