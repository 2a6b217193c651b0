// What kiln's GGUF-block sources share (kquant.cpp's op and packing, kquant_dots.cpp's
// row-at-a-time kernels, kquant_tiles.cpp's tile kernels): the type ids, the activation rows
// as the kernels read them and the kernel tables. No ATen (kernels.h says why); kquant.cpp
// describes the formats.

#pragma once

#include <cstdint>
#include <vector>

#include "simd.h"

namespace KILN_NS {

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

// One quantized activation row: codes q [K], per group of 32 its span's scale d [K/32] (the
// same for the 8 groups of a 256-value span) and s [K/32] (d * sum(q)).
struct XRow {
  const int8_t* q;
  const float* d;
  const float* s;
  const int32_t* is;  // sum of the group's codes (the tiles' Q5_0 offset, K-quants' mins)
  const int32_t* h;   // int16 pair: sums of codes 0..15 and 16..31 (the tiles' Q6_K offset)
};

using DotFn = void (*)(const uint8_t*, int64_t, const XRow*, float*);

// the row kernel of `type` for MB activation rows (MB = 1..kMaxRows; kquant_dots.cpp), or null
template <int MB>
DotFn dot_for(int64_t type);

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

// A tile kernel on NT tiles (st: the second tile's offset) and MB activation rows
template <int NT>
using TileFn = void (*)(const uint8_t*, int64_t, int64_t, const XTiles&, typename Vec<NT>::F*);

// f[mb] = the tile kernel of `type` for mb activation rows, mb = 1..kTileRows (f[0] unused;
// kquant_tiles.cpp: NT = 1 and, on AVX-512, 2)
template <int NT, int MB = 1>
void fill_tiles(TileFn<NT>* f, int64_t type);

// Q8_0 pairs of tiles against kWideRows activation rows in one pass (null for other types).
// Why: Q8_0 has no codes to expand, so 16 rows' sums fit in registers beside one weight
// vector, and one pass over a tile pair does the work of two 8-row passes with half the
// weight loads and prefetches; a head (Qwen2.5-0.5B's 152k x 896) streams from DRAM while it
// computes. Zen 4, 2 threads, interleaved, the same bits: the head at 16 rows 13.8 -> 12.7 ms
// and 17.4 -> 16.4 in a slower minute, 32 rows 21.1 -> 19.3; Q5_0 the same way gained 4%
// (within the spread: it stays on 8-row passes).
constexpr int kWideRows = 16;
#if KILN_VNNI
TileFn<2> wide_tile(int64_t type);
#endif

// One part of a GGUF-block linear: raw rows (row_bytes each) or kq_pack's tiles (tile_bytes
// per 8 rows), its kernels.
struct KqPart {
  const uint8_t* w;
  int64_t row_bytes, rows, row0, nb;
  bool tiled;
  int64_t slot;  // which rounding of the activation it reads (KqLinear's `spans`)
  int64_t tile_bytes;
  DotFn fn[kMaxRows + 1];  // fn[mb]: mb activation rows at once
  TileFn<1> tfn[kTileRows + 1];
#if KILN_VNNI
  TileFn<2> tfn2[kTileRows + 1];  // two tiles in one 512-bit vector
  TileFn<2> wide;  // two tiles, kWideRows activation rows (Q8_0) or null
#endif
};

// One kq_linear (kquant.cpp) for M activation rows of K: its parts (`add`, then `prepare`),
// the activation rounded per span of the parts' block size (32, or 256 for the K-quants; a
// Q4_K_M layer mixes both), the work items. `run` is called by every thread of an enclosing
// parallel region (kq_linear's own, or a one-region layer's): y [M, N] = x W^T (+ bias [N])
// (+ resid [M, N], added last, as the op-by-op layer adds it).
struct KqLinear {
  std::vector<KqPart> parts;
  std::vector<int64_t> spans, tile_part, tile_row;
  int64_t M = 0, K = 0, N = 0;
  bool pairs = false;
  std::vector<int8_t> xq;
  std::vector<float> xd, xs;
  std::vector<int32_t> xi, xh;
  void reset(int64_t k) {
    parts.clear();
    spans.clear();
    K = k;
    N = 0;
  }
  void add(const uint8_t* w, int64_t type, int64_t rows, bool tiled, int64_t bytes);
  void prepare(int64_t m);
  template <typename T>
  void run(const T* x, float* y, const float* bias, const float* resid);
};

}  // namespace KILN_NS
