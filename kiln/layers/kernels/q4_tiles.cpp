// kiln's int4 tiles: 4-bit weights x int8 activations, the tile kernel (tile_dot / tile_rows;
// tile_pair: two one-row dot products in lockstep) and the tile loop of a linear
// (q4_tiles_omp), which q4_linear, heads_q4 and the one-call layers run (ops.cpp, layers.cpp)
// and moe_q4's experts reuse (moe.cpp). Compute only: no ATen
// here (kernels.h says why).
//
// Weights: asymmetric 4-bit groups of 32 along K (kiln's GroupQuant: w = q * scale + min,
// q in 0..15; GGUF Q4_0 is min = -8 * scale), in tiles of 8 output rows:
//
//   packed uint8 [ceil(N/8), K/32, 160]     one 160-byte block per (row tile, group):
//     bytes   0..127  codes, 4 vectors of 32 bytes; vector k byte 4r + i = row r's byte
//                     4k + i, where a row's 16 bytes are byte j = q[j] | q[j + 16] << 4
//                     (llama.cpp's Q4_0 order): lane r of vector k holds row r's codes
//                     4k..4k+3 (low nibbles) and 16+4k..16+4k+3 (high)
//     bytes 128..143  fp16 scale of rows 0..7
//     bytes 144..159  fp16 min of rows 0..7
//   (rows past N are zero padding; reference.pack_q4 writes it, reference.unpack_q4 reads it back)
//   or [ceil(N/8), K/32, 144]: the same blocks without their mins, for symmetric groups (GGUF
//   Q4_0: min = -8 scale, taken from the scale): a decode step streams 10% fewer bytes
//   (Qwen3-MoE-shaped benchmark model, Zen 3, c=1: 1.04-1.14x in 7 of 8 alternated rounds).
//
// Activations are quantized the llama.cpp way (Q8_0): per row and group of 32, one fp32 scale
// d = amax / 127 and int8 codes round(x / d). A group's dot product is then
//   scale_w * d * sum(q * xq) + min_w * sum(x)
// with sum(q * xq) from _mm256_maddubs_epi16 (u8 codes x s8 activations) and sum(x) taken from
// the unquantized floats (so the min term has no activation rounding).
//
// Why this tile: each 32-bit lane is one row, so one vpdpbusd (VNNI; vpmaddubsw without) of a
// vector's low nibbles against four activation codes broadcast adds four products to each of the
// 8 rows in place, and a group's sums come out in row order, scaled by one F16C-converted
// vector of 8 scales and one of 8 mins: no horizontal sums. (The tile it replaced held a row
// pair per vector and reduced with three hadds per row and group: 1.29x slower with 256 rows,
// Zen 4, and no faster at one.) From GGUF's Q4_0 / Q4_1 blocks it is a move of 4-byte pieces.
// A tile's codes are expanded once per group and reused for a register block of activation
// rows (kMaxBlockRows: 8 on AVX-512, 4 on AVX2), and from 8 rows up AVX-512 runs two tiles in
// one 512-bit vector; a tile's blocks are contiguous, so a step streams each weight once
// whatever its row count.
//

#include <omp.h>

#include <algorithm>
#include <cstdint>

#include "kernels.h"

namespace KILN_NS {
namespace {

// One tile (8 output rows, all G groups of its blocks at w) against MB activation rows
// (indices rows[0..MB) of xs) -> out[m] = the 8 fp32 dot products of row m. Vector k of a
// group holds codes 4k..4k+3 (low nibbles) and 16+4k..16+4k+3 (high) of every row, one row per
// 32-bit lane: one vpdpbusd against four activation codes broadcast adds each row's four
// products in its own lane, so a group's sums come out in row order with no horizontal adds.
// Vector-outer, row-inner: each vector is expanded once for the MB rows, whose integer sums
// stay in registers until the group's float step.
// NT = 2 (AVX-512): two tiles side by side in one 512-bit vector (the second `st` bytes on),
// 16 output rows per lane set; every lane computes what NT = 1 computes for its row, the same
// integer sums and float operations in the same order: the same bits either way.
// SYM: the blocks have no mins (kSymBlockBytes; min = -8 scale, exact in fp32, as the fp16 min
// the packer wrote for the same Q4_0 block short of fp16's overflow: the same bits).
template <int MB, int NT = 1, bool SYM = false>
inline void tile_dot(const uint8_t* w, int64_t st, const QRows& xs, const int64_t* rows,
                     typename Vec<NT>::F* out, int64_t pf = KILN_PF) {
  using V = Vec<NT>;
  using I = typename V::I;
  using F = typename V::F;
  const int64_t G = xs.G;
  const int8_t* xq[MB];
  const float* xd[MB];
  const float* xsum[MB];
  // two accumulators per row: the scaled dots and the min terms are independent FMA chains
  F acc[MB], accm[MB];
  for (int m = 0; m < MB; ++m) {
    accm[m] = V::fzero();
    xq[m] = xs.qrow(rows[m]);
    xd[m] = xs.drow(rows[m]);
    xsum[m] = xs.srow(rows[m]);
    acc[m] = V::fzero();
  }
  constexpr int64_t bb = SYM ? kSymBlockBytes : kBlockBytes;
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* b = w + g * bb;
    prefetch_tiles<NT>(b, st, pf, bb);
    // with VNNI int32 sums; without, int16 pairs (a group's 32 products of a 4-bit code and
    // an int8 code stay within 16 x 15 x 127 = 30480 per int16 lane): the same integers
    I S[MB];
#pragma GCC unroll 4
    for (int k = 0; k < 4; ++k) {
      I lo, hi;
      nib_k<NT>(b, st, k, lo, hi);
      for (int m = 0; m < MB; ++m) {
        const int8_t* xp = xq[m] + g * kGroup + 4 * k;
        acc4(S[m], lo, hi, xp, xp + 16, k == 0);
      }
    }
    const F sc = f16s<NT>(b + 128, st);
    const F mn = SYM ? v_mul(sc, V::f32(-8.0f)) : f16s<NT>(b + 144, st);
    for (int m = 0; m < MB; ++m) {
      acc[m] = v_fmadd(v_cvt(sum32(S[m])), v_mul(sc, V::f32(xd[m][g])), acc[m]);
      accm[m] = v_fmadd(mn, V::f32(xsum[m][g]), accm[m]);
    }
  }
  for (int m = 0; m < MB; ++m) out[m] = v_addf(acc[m], accm[m]);
}

// Two one-row tile dot products in lockstep, group by group: tile wa against activation row ra
// and tile wb against row rb -> oa, ob, each what tile_dot<1> computes for it (the same integer
// sums and float operations in the same order: the same bits). Why: at one row a linear is a
// stream of weights, and this VM's memory answers one stream a core slower than two: a plain
// read of 256 MiB, 2 threads, 15 interleaved runs, Zen 3: 22.5 GB/s one stream a thread,
// 26.7 two, 29.6 four (tiles far apart; neighbouring tiles are one stream to the prefetchers).
// Two, not four: four tiles' sums spill AVX2's 16 registers (q4_linear at one row over 126 MB,
// 2 threads: one stream 16.6 GB/s, two 19.3, three 17.8, four 16.8).
template <bool SYM>
inline void tile_dot_pair(const uint8_t* wa, const uint8_t* wb, const QRows& xs, int64_t ra,
                          int64_t rb, __m256& oa, __m256& ob) {
  using V = Vec<1>;
  using I = V::I;
  using F = V::F;
  const int64_t G = xs.G;
  const int8_t *qa = xs.qrow(ra), *qb = xs.qrow(rb);
  const float *da = xs.drow(ra), *db = xs.drow(rb), *sa = xs.srow(ra), *sb = xs.srow(rb);
  F acca = V::fzero(), accma = V::fzero(), accb = V::fzero(), accmb = V::fzero();
  constexpr int64_t bb = SYM ? kSymBlockBytes : kBlockBytes;
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* a = wa + g * bb;
    const uint8_t* b = wb + g * bb;
    prefetch_tiles<1>(a, 0, KILN_PF, bb);
    prefetch_tiles<1>(b, 0, KILN_PF, bb);
    I Sa, Sb;
#pragma GCC unroll 4
    for (int k = 0; k < 4; ++k) {
      I lo, hi;
      const int8_t* xa = qa + g * kGroup + 4 * k;
      const int8_t* xb = qb + g * kGroup + 4 * k;
      nib_k<1>(a, 0, k, lo, hi);
      acc4(Sa, lo, hi, xa, xa + 16, k == 0);
      nib_k<1>(b, 0, k, lo, hi);
      acc4(Sb, lo, hi, xb, xb + 16, k == 0);
    }
    const F sca = f16s<1>(a + 128, 0), scb = f16s<1>(b + 128, 0);
    const F mna = SYM ? v_mul(sca, V::f32(-8.0f)) : f16s<1>(a + 144, 0);
    const F mnb = SYM ? v_mul(scb, V::f32(-8.0f)) : f16s<1>(b + 144, 0);
    acca = v_fmadd(v_cvt(sum32(Sa)), v_mul(sca, V::f32(da[g])), acca);
    accma = v_fmadd(mna, V::f32(sa[g]), accma);
    accb = v_fmadd(v_cvt(sum32(Sb)), v_mul(scb, V::f32(db[g])), accb);
    accmb = v_fmadd(mnb, V::f32(sb[g]), accmb);
  }
  oa = v_addf(acca, accma);
  ob = v_addf(accb, accmb);
}

}  // namespace

void tile_pair(const uint8_t* wa, const uint8_t* wb, int64_t tile_bytes, const QRows& xs,
               int64_t ra, int64_t rb, __m256& oa, __m256& ob) {
  if (tile_bytes == xs.G * kSymBlockBytes)
    tile_dot_pair<true>(wa, wb, xs, ra, rb, oa, ob);
  else
    tile_dot_pair<false>(wa, wb, xs, ra, rb, oa, ob);
}


// NT tiles (the second `st` bytes on) against any number of activation rows, in register
// blocks of up to kMaxBlockRows; next: the distance to the tiles the caller runs next (0:
// unknown), prefetched by the second block (simd.h's pass_prefetch). Inlined into this file's
// tile loop (q4_tiles_omp): called through the exported tile_rows there, q4_linear lost 3-5%
// at 64-256 rows when the kernels were split into files (Zen 4, 2 threads, interleaved:
// 1024/3072/49152 x 1024 at 64 rows 12.99 ms in one file, 13.97 split, 13.30 inlined).
template <int NT, bool SYM>
inline __attribute__((always_inline)) void tile_rows_of(const uint8_t* w, int64_t st,
                                                        const QRows& xs, const int64_t* rows,
                                                        int64_t n, typename Vec<NT>::F* out,
                                                        int64_t next) {
  int64_t i = 0;
  int pass = 0;
  for (; i + kMaxBlockRows <= n; i += kMaxBlockRows, ++pass)
    tile_dot<kMaxBlockRows, NT, SYM>(w, st, xs, rows + i, out + i,
                                     pass_prefetch(pass, next));
  const int64_t pf = pass_prefetch(pass, next);
  switch (n - i) {
#if KILN_VNNI
    case 7: tile_dot<7, NT, SYM>(w, st, xs, rows + i, out + i, pf); break;
    case 6: tile_dot<6, NT, SYM>(w, st, xs, rows + i, out + i, pf); break;
    case 5: tile_dot<5, NT, SYM>(w, st, xs, rows + i, out + i, pf); break;
    case 4: tile_dot<4, NT, SYM>(w, st, xs, rows + i, out + i, pf); break;
#endif
    case 3: tile_dot<3, NT, SYM>(w, st, xs, rows + i, out + i, pf); break;
    case 2: tile_dot<2, NT, SYM>(w, st, xs, rows + i, out + i, pf); break;
    case 1: tile_dot<1, NT, SYM>(w, st, xs, rows + i, out + i, pf); break;
    default: break;
  }
}

// Which block the tiles hold: a tile is its G blocks back to back, st / G bytes each.
template <int NT>
inline __attribute__((always_inline)) void tile_rows_in(const uint8_t* w, int64_t st,
                                                        const QRows& xs, const int64_t* rows,
                                                        int64_t n, typename Vec<NT>::F* out,
                                                        int64_t next) {
  if (st == xs.G * kSymBlockBytes)
    tile_rows_of<NT, true>(w, st, xs, rows, n, out, next);
  else
    tile_rows_of<NT, false>(w, st, xs, rows, n, out, next);
}

template <int NT>
void tile_rows(const uint8_t* w, int64_t st, const QRows& xs, const int64_t* rows, int64_t n,
               typename Vec<NT>::F* out, int64_t next) {
  tile_rows_in<NT>(w, st, xs, rows, n, out, next);
}

template void tile_rows<1>(const uint8_t*, int64_t, const QRows&, const int64_t*, int64_t,
                           Vec<1>::F*, int64_t);
#if KILN_VNNI
template void tile_rows<2>(const uint8_t*, int64_t, const QRows&, const int64_t*, int64_t,
                           Vec<2>::F*, int64_t);
#endif

// The tile loop of a q4 linear, run by every thread of an enclosing parallel region (an
// orphaned `omp for`, implicit barrier at its end): y [M, n] (+ bias [n]) (+ resid [M, n]) for
// the quantized rows xs. Work items: (row tiles, block of up to 64 activation rows): a tile's
// blocks stay in L1/L2 while the rows pass over them. With AVX-512 and a full register block of
// rows or more, an item is a pair of tiles in 512-bit vectors (tile_dot's NT = 2): past that
// many rows the dot products bound the call and a pair does the work around them (the
// activation broadcasts, the code expansion, the float step) once for 16 rows, as kquant.cpp's
// tiles do; below it a step streams its weights and single tiles stream them as well.
void q4_tiles_omp(const uint8_t* w, int64_t tile_bytes, int64_t NT, const QRows& xs,
                  const int64_t* rows, int64_t M, int64_t n, float* y, const float* bias,
                  const float* resid) {
  constexpr int64_t kRowChunk = 64;
  const int64_t chunks = (M + kRowChunk - 1) / kRowChunk;
  const int64_t per = KILN_VNNI && M >= kMaxBlockRows ? 2 : 1;  // tiles an item
  const int64_t units = (NT + per - 1) / per;
  __m256 out[kRowChunk];
  if (M == 1) {
    // One row: each thread's range of tiles as two halves in lockstep (tile_pair: two weight
    // streams a thread); its own split, then the barrier an `omp for` would end with.
    const int64_t nth = omp_get_num_threads(), tid = omp_get_thread_num();
    const int64_t a = NT * tid / nth, len = NT * (tid + 1) / nth - a;
    auto put = [&](int64_t t, __m256 v) {
      store_tile(y + t * kTile, v, std::min(kTile, n - t * kTile),
                 bias ? bias + t * kTile : nullptr, resid ? resid + t * kTile : nullptr);
    };
    in_two_halves(a, len, [&](int64_t ta, int64_t tb) {
      __m256 oa, ob;
      tile_pair(w + ta * tile_bytes, w + tb * tile_bytes, tile_bytes, xs, rows[0], rows[0], oa, ob);
      put(ta, oa);
      put(tb, ob);
    }, [&](int64_t t) {
      tile_rows_in<1>(w + t * tile_bytes, tile_bytes, xs, rows, 1, out, 0);
      put(t, out[0]);
    });
#pragma omp barrier
    return;
  }
#if KILN_VNNI
  __m512 out2[kRowChunk];
#endif
#pragma omp for schedule(static)
  for (int64_t item = 0; item < units * chunks; ++item) {
    const int64_t t = (item % units) * per, c = item / units;
    const int64_t r0 = c * kRowChunk, nr = std::min(kRowChunk, M - r0);
    const int64_t col = t * kTile;
    auto store = [&](int64_t m, __m256 v, int64_t c0) {
      const int64_t valid = std::min(kTile, n - c0);
      store_tile(y + (r0 + m) * n + c0, v, valid, bias ? bias + c0 : nullptr,
                 resid ? resid + (r0 + m) * n + c0 : nullptr);
    };
#if KILN_VNNI
    if (t + 1 < NT && per == 2) {
      tile_rows_in<2>(w + t * tile_bytes, tile_bytes, xs, rows + r0, nr, out2, 2 * tile_bytes);
      for (int64_t m = 0; m < nr; ++m) {
        store(m, _mm512_castps512_ps256(out2[m]), col);
        store(m, _mm512_extractf32x8_ps(out2[m], 1), col + kTile);
      }
      continue;
    }
#endif
    tile_rows_in<1>(w + t * tile_bytes, tile_bytes, xs, rows + r0, nr, out, tile_bytes);
    for (int64_t m = 0; m < nr; ++m) store(m, out[m], col);
  }
}

// heads_q4's tile loop (ops.cpp), run by every thread of an enclosing region: head h of the
// quantized rows t * Hn + h of xs against that head's NT tiles (w: Hn heads of NT tiles each)
// -> y + (t * Hn + h) * ys, n values.
void heads_q4_omp(const uint8_t* w, int64_t NT, int64_t tile_bytes, const QRows& xs, int64_t T,
                  int64_t Hn, int64_t n, float* y, int64_t ys) {
  constexpr int64_t kRowChunk = 64;
  int64_t rows[kRowChunk];
  __m256 out[kRowChunk];
#pragma omp for schedule(static)
  for (int64_t item = 0; item < Hn * NT; ++item) {
    const int64_t h = item / NT, j = item % NT, valid = std::min(kTile, n - j * kTile);
    for (int64_t r0 = 0; r0 < T; r0 += kRowChunk) {
      const int64_t nr = std::min(kRowChunk, T - r0);
      for (int64_t m = 0; m < nr; ++m) rows[m] = (r0 + m) * Hn + h;
      tile_rows(w + (h * NT + j) * tile_bytes, tile_bytes, xs, rows, nr, out, tile_bytes);
      for (int64_t m = 0; m < nr; ++m) store_tile(y + rows[m] * ys + j * kTile, out[m], valid);
    }
  }
}

}  // namespace KILN_NS
