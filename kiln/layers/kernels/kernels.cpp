// kiln's CPU kernels: 4-bit weights x int8 activations, batch-invariant attention, the row
// kernels and the one-call layers, compiled once per ISA level (kiln/layers/kernels/build.py;
// simd.h says what a level changes).
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
// moe_q4: all the active experts of one MoE layer in one call (see the function).
//
// Threads: OpenMP, torch's thread count (a region's team; the thread governor lowers it while
// other processes hold a CPU: kiln/layers/kernels/threads.py).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/custom_class.h>
#include <torch/library.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <exception>
#include <memory>
#include <type_traits>
#include <vector>

#include "simd.h"

namespace KILN_NS {
namespace {

constexpr int64_t kGroup = 32;
constexpr int64_t kTile = 8;           // output rows per tile
constexpr int64_t kBlockBytes = 160;  // one (tile, group) block
// Activation rows per register block of the int4 tiles: AVX-512's 32 vector registers hold 8
// rows' sums and accumulators, AVX2's 16 hold 4 (more would spill).
constexpr int kMaxBlockRows = KILN_VNNI ? 8 : 4;



// Quantized activation rows: codes [rows, K], scale and sum [rows, K/32].
struct QRows {
  std::vector<int8_t> q;
  std::vector<float> d, sum;
  int64_t K = 0, G = 0;
  void resize(int64_t rows, int64_t k) {
    K = k;
    G = k / kGroup;
    q.resize(rows * K);
    d.resize(rows * G);
    sum.resize(rows * G);
  }
  // row r from K values at x (simd.h's quantize_row, per group of 32: codes, scales and the
  // floats' sums)
  template <typename T>
  void quantize(int64_t r, const T* x) {
    quantize_row(x, K, kGroup, q.data() + r * K, d.data() + r * G, sum.data() + r * G, nullptr,
                 nullptr, nullptr);
  }
  const int8_t* qrow(int64_t r) const { return q.data() + r * K; }
  const float* drow(int64_t r) const { return d.data() + r * G; }
  const float* srow(int64_t r) const { return sum.data() + r * G; }
};

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
template <int MB, int NT = 1>
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
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* b = w + g * kBlockBytes;
    prefetch_tiles<NT>(b, st, pf, kBlockBytes);
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
    const F mn = f16s<NT>(b + 144, st);
    for (int m = 0; m < MB; ++m) {
      acc[m] = v_fmadd(v_cvt(sum32(S[m])), v_mul(sc, V::f32(xd[m][g])), acc[m]);
      accm[m] = v_fmadd(mn, V::f32(xsum[m][g]), accm[m]);
    }
  }
  for (int m = 0; m < MB; ++m) out[m] = v_addf(acc[m], accm[m]);
}

// NT tiles (the second `st` bytes on) against any number of activation rows, in register
// blocks of up to kMaxBlockRows; next: the distance to the tiles the caller runs next (0:
// unknown), prefetched by the second block (simd.h's pass_prefetch).
template <int NT = 1>
inline void tile_rows(const uint8_t* w, int64_t st, const QRows& xs, const int64_t* rows,
                      int64_t n, typename Vec<NT>::F* out, int64_t next = 0) {
  int64_t i = 0;
  int pass = 0;
  for (; i + kMaxBlockRows <= n; i += kMaxBlockRows, ++pass)
    tile_dot<kMaxBlockRows, NT>(w, st, xs, rows + i, out + i, pass_prefetch(pass, next));
  const int64_t pf = pass_prefetch(pass, next);
  switch (n - i) {
#if KILN_VNNI
    case 7: tile_dot<7, NT>(w, st, xs, rows + i, out + i, pf); break;
    case 6: tile_dot<6, NT>(w, st, xs, rows + i, out + i, pf); break;
    case 5: tile_dot<5, NT>(w, st, xs, rows + i, out + i, pf); break;
    case 4: tile_dot<4, NT>(w, st, xs, rows + i, out + i, pf); break;
#endif
    case 3: tile_dot<3, NT>(w, st, xs, rows + i, out + i, pf); break;
    case 2: tile_dot<2, NT>(w, st, xs, rows + i, out + i, pf); break;
    case 1: tile_dot<1, NT>(w, st, xs, rows + i, out + i, pf); break;
    default: break;
  }
}

// The tiles' epilogue: y = (dots + bias) + resid, in the order the eager layer adds them (the
// linear's output, then its bias, then the residual: `x + (lin(h) + b)`), each add one fp32 add
// of the same operands, so the bits match; bias / resid null: not added. `valid` < 8: the last,
// partial tile of the output row.
inline void store_tile(float* y, __m256 v, int64_t valid, const float* bias = nullptr,
                       const float* resid = nullptr) {
  if (valid >= kTile) {
    if (bias) v = _mm256_add_ps(v, _mm256_loadu_ps(bias));
    if (resid) v = _mm256_add_ps(_mm256_loadu_ps(resid), v);
    _mm256_storeu_ps(y, v);
  } else {
    alignas(32) float t[kTile];
    _mm256_store_ps(t, v);
    for (int64_t i = 0; i < valid; ++i) {
      float a = t[i];
      if (bias) a = a + bias[i];
      if (resid) a = resid[i] + a;
      y[i] = a;
    }
  }
}

// The tile loop of a q4 linear, run by every thread of an enclosing parallel region (an
// orphaned `omp for`, implicit barrier at its end): y [M, n] (+ bias [n]) (+ resid [M, n]) for
// the quantized rows xs. Work items: (row tiles, block of up to 64 activation rows): a tile's
// blocks stay in L1/L2 while the rows pass over them. With AVX-512 and a full register block of
// rows or more, an item is a pair of tiles in 512-bit vectors (tile_dot's NT = 2): past that
// many rows the dot products bound the call and a pair does the work around them (the
// activation broadcasts, the code expansion, the float step) once for 16 rows, as kquant.cpp's
// tiles do; below it a step streams its weights and single tiles stream them as well.
inline void q4_tiles_omp(const uint8_t* w, int64_t tile_bytes, int64_t NT, const QRows& xs,
                         const int64_t* rows, int64_t M, int64_t n, float* y, const float* bias,
                         const float* resid) {
  constexpr int64_t kRowChunk = 64;
  const int64_t chunks = (M + kRowChunk - 1) / kRowChunk;
  const int64_t per = KILN_VNNI && M >= kMaxBlockRows ? 2 : 1;  // tiles an item
  const int64_t units = (NT + per - 1) / per;
  __m256 out[kRowChunk];
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
      tile_rows<2>(w + t * tile_bytes, tile_bytes, xs, rows + r0, nr, out2, 2 * tile_bytes);
      for (int64_t m = 0; m < nr; ++m) {
        store(m, _mm512_castps512_ps256(out2[m]), col);
        store(m, _mm512_extractf32x8_ps(out2[m], 1), col + kTile);
      }
      continue;
    }
#endif
    tile_rows(w + t * tile_bytes, tile_bytes, xs, rows + r0, nr, out, tile_bytes);
    for (int64_t m = 0; m < nr; ++m) store(m, out[m], col);
  }
}

// e^x, 2^t with t = x log2(e) = n + f by a degree-6 polynomial in f (relative error ~2e-7);
// t clamped to [-126, 126] so 2^n is a normal float built in its exponent bits.
inline __m256 exp_vec(__m256 x) {
  __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.4426950408889634f));
  t = _mm256_min_ps(_mm256_max_ps(t, _mm256_set1_ps(-126.0f)), _mm256_set1_ps(126.0f));
  const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(t, n);
  __m256 p = _mm256_set1_ps(1.5403530393381606e-4f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.3333558146428443e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.6181291076284772e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.5504108664821580e-2f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.4022650695910071e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.9314718055994531e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n),
                                                       _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

inline __m256 silu_mul(__m256 g, __m256 u) {
  const __m256 one = _mm256_set1_ps(1.0f);
  const __m256 e = exp_vec(_mm256_sub_ps(_mm256_setzero_ps(), g));
  return _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, e)), u);
}

template <typename T>
void quantize_rows_omp(const T* x, int64_t rows, int64_t K, QRows& xs) {
#pragma omp for schedule(static)
  for (int64_t r = 0; r < rows; ++r) xs.quantize(r, x + r * K);
}


int threads() { return std::max(1, at::get_num_threads()); }

void check_packed(const char* name, const at::Tensor& p, int64_t dims) {
  TORCH_CHECK(p.dim() == dims && p.scalar_type() == at::kByte && p.is_contiguous() &&
                  p.size(dims - 1) == kBlockBytes,
              name, ": packed weight must be contiguous uint8 [..., N/8, K/32, 160]");
}

void check_x(const char* name, const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              name, ": x must be [M, K] float32 or bfloat16");
}

// y [M, n] = x [M, K] @ W^T, W in the layout above; y in x's dtype (fp32 accumulation).
at::Tensor q4_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n) {
  check_x("q4_linear", x);
  check_packed("q4_linear", packed, 3);
  const int64_t M = x.size(0), K = x.size(1), NT = packed.size(0);
  TORCH_CHECK(packed.size(1) * kGroup == K && NT * kTile >= n && (NT - 1) * kTile < n,
              "q4_linear: packed weight holds [", NT * kTile, ", ", packed.size(1) * kGroup,
              "], x has K = ", K, " and n = ", n);
  auto y = at::empty({M, n}, x.options().dtype(at::kFloat));
  if (M == 0) return y.to(x.scalar_type());
  const auto xc = x.contiguous();
  const uint8_t* w = packed.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  QRows xs;
  xs.resize(M, K);
  std::vector<int64_t> rows(M);
  for (int64_t i = 0; i < M; ++i) rows[i] = i;
  const int64_t tile_bytes = packed.size(1) * kBlockBytes;
#pragma omp parallel num_threads(threads())
  {
    if (x.scalar_type() == at::kFloat)
      quantize_rows_omp(xc.data_ptr<float>(), M, K, xs);
    else
      quantize_rows_omp(xc.data_ptr<at::BFloat16>(), M, K, xs);
    // (the implicit barrier of the `omp for` above: all rows are quantized past here)
    q4_tiles_omp(w, tile_bytes, NT, xs, rows.data(), M, n, yp, nullptr, nullptr);
  }
  return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}

// One linear per head in one call: y [T, Hn, n] with y[t, h] = W_h x[t, h], for x [T, Hn, K]
// and w [Hn, N/8, K/32, 160] (each head's weight in the tiles above, stacked). MLA's absorbed
// up-projections (kiln/models/deepseek.py: q_nope -> latent through W_uk^T, latent -> v through
// W_uv) are this: a batched matmul read them in fp32 (8x the bytes of these tiles) and paid
// ATen's batched-GEMM setup for one row (the DeepSeek-shaped benchmark model, 1 row: 81 us a
// call, 2 calls a layer). Items (head, tile) split statically, so each thread streams its
// heads' tiles in order; every (t, h) row is quantized and computed alone (batch-invariant).
at::Tensor heads_q4(const at::Tensor& x, const at::Tensor& w, int64_t n) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == at::kFloat, "heads_q4: x must be fp32 [T, H, K]");
  check_packed("heads_q4", w, 4);
  const int64_t T = x.size(0), Hn = x.size(1), K = x.size(2), NT = w.size(1);
  TORCH_CHECK(w.size(0) == Hn && w.size(2) * kGroup == K && NT * kTile >= n &&
                  (NT - 1) * kTile < n,
              "heads_q4: w holds ", w.size(0), " heads of [", NT * kTile, ", ",
              w.size(2) * kGroup, "], x is [", T, ", ", Hn, ", ", K, "] and n = ", n);
  auto y = at::empty({T, Hn, n}, x.options());
  if (T == 0) return y;
  const auto xc = x.contiguous();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const int64_t tile_bytes = w.size(2) * kBlockBytes, head_bytes = NT * tile_bytes;
  float* yp = y.data_ptr<float>();
  QRows xs;
  xs.resize(T * Hn, K);
#pragma omp parallel num_threads(threads())
  {
    quantize_rows_omp(xc.data_ptr<float>(), T * Hn, K, xs);
    constexpr int64_t kRowChunk = 64;
    int64_t rows[kRowChunk];
    __m256 out[kRowChunk];
#pragma omp for schedule(static)
    for (int64_t item = 0; item < Hn * NT; ++item) {
      const int64_t h = item / NT, j = item % NT, valid = std::min(kTile, n - j * kTile);
      for (int64_t r0 = 0; r0 < T; r0 += kRowChunk) {
        const int64_t nr = std::min(kRowChunk, T - r0);
        for (int64_t m = 0; m < nr; ++m) rows[m] = (r0 + m) * Hn + h;
        tile_rows(wp + h * head_bytes + j * tile_bytes, tile_bytes, xs, rows, nr, out, tile_bytes);
        for (int64_t m = 0; m < nr; ++m) store_tile(yp + rows[m] * n + j * kTile, out[m], valid);
      }
    }
  }
  return y;
}

// GGUF Q4_0 / Q4_1 rows -> the tiles above (reference.pack_q4_blocks, byte for byte). A block's
// 16 code bytes are already a tile row's (byte j = q[j] | q[j + 16] << 4) and its fp16 scale
// (Q4_1: and min) move as they are; Q4_0's min is -8 d, exact in fp16 short of overflow, which
// rounds to inf as PyTorch's fp16 multiply does. raw [M, N, G * block_bytes] (rows of M
// matrices: a layer's experts, a view of the file's memory map), out [M, ceil(N/8), G, 160]
// (any matrix and tile strides: a slice of a stack). One pass over both, threads over (matrix,
// tile) so each writes its tiles in order: a 14 B model's 8.6 GB of experts in seconds, where
// PyTorch's strided copy of 16-byte pieces took 38 s of a 54 s start.
void pack_q4_blocks(const at::Tensor& raw, int64_t block_bytes, const at::Tensor& out) {
  TORCH_CHECK(block_bytes == 18 || block_bytes == 20,
              "pack_q4_blocks: block_bytes must be 18 (Q4_0) or 20 (Q4_1), got ", block_bytes);
  TORCH_CHECK(raw.dim() == 3 && raw.scalar_type() == at::kByte && raw.stride(2) == 1,
              "pack_q4_blocks: raw must be uint8 [M, N, row bytes] with contiguous rows");
  TORCH_CHECK(out.dim() == 4 && out.scalar_type() == at::kByte && out.size(3) == kBlockBytes &&
                  out.stride(3) == 1 && out.stride(2) == kBlockBytes,
              "pack_q4_blocks: out must be uint8 [M, tiles, groups, 160] with contiguous blocks");
  const int64_t M = raw.size(0), N = raw.size(1), NT = out.size(1), G = out.size(2);
  TORCH_CHECK(out.size(0) == M && raw.size(2) == G * block_bytes && NT == (N + kTile - 1) / kTile,
              "pack_q4_blocks: raw [", M, ", ", N, ", ", raw.size(2), "] does not fit out [",
              out.size(0), ", ", NT, ", ", G, ", 160]");
  const uint8_t* rp = raw.data_ptr<uint8_t>();
  uint8_t* op = out.data_ptr<uint8_t>();
  const int64_t rs0 = raw.stride(0), rs1 = raw.stride(1), os0 = out.stride(0), os1 = out.stride(1);
  const bool has_min = block_bytes == 20;
  const int64_t codes_at = has_min ? 4 : 2;
#pragma omp parallel for schedule(static) num_threads(threads())
  for (int64_t item = 0; item < M * NT; ++item) {
    const int64_t mi = item / NT, t = item % NT;
    const uint8_t* rows[kTile];
    for (int64_t r = 0; r < kTile; ++r)
      rows[r] = t * kTile + r < N ? rp + mi * rs0 + (t * kTile + r) * rs1 : nullptr;
    uint8_t* dst = op + mi * os0 + t * os1;
    for (int64_t g = 0; g < G; ++g, dst += kBlockBytes) {
      uint16_t scale[kTile], mn[kTile];
      for (int64_t r = 0; r < kTile; ++r) {
        // the row's code bytes 4k..4k+3 go to lane r of vector k (bytes 32k + 4r)
        if (rows[r] == nullptr) {  // padding past N: zero codes, scale and min
          for (int k = 0; k < 4; ++k) std::memset(dst + 32 * k + 4 * r, 0, 4);
          scale[r] = mn[r] = 0;
          continue;
        }
        const uint8_t* b = rows[r] + g * block_bytes;
        for (int k = 0; k < 4; ++k) std::memcpy(dst + 32 * k + 4 * r, b + codes_at + 4 * k, 4);
        std::memcpy(&scale[r], b, 2);
        if (has_min)
          std::memcpy(&mn[r], b + 2, 2);
        else
          mn[r] = _cvtss_sh(_cvtsh_ss(scale[r]) * -8.0f, _MM_FROUND_TO_NEAREST_INT);
      }
      std::memcpy(dst + 128, scale, sizeof(scale));
      std::memcpy(dst + 144, mn, sizeof(mn));
    }
  }
}

// moe_q4's work split: items (active expert a, tile j) expert-major, `per` tiles an expert, cut
// into nt contiguous ranges of about equal cost, an item costing its expert's rows plus
// kTileCost (reading the tile's weights: about what 2 rows of compute take at T = 1). Why not
// `omp for schedule(dynamic)`: its chunks interleave the threads over each expert, so neither
// thread streams its weights in order (one token's 8 experts on the first MoE benchmark model's
// 24 layers, Zen 4: 288 us a layer, 20 GB/s, against 138 us, 42 GB/s split in ranges);
// static over items ignores the experts' different row counts. -> bounds [nt + 1].
std::vector<int64_t> split_items(const std::vector<int64_t>& active,
                                 const std::vector<int64_t>& offsets, int64_t per, int nt) {
  constexpr int64_t kTileCost = 2;
  const int64_t A = static_cast<int64_t>(active.size());
  std::vector<int64_t> cost(A + 1, 0);  // cumulative cost before active expert a
  for (int64_t a = 0; a < A; ++a)
    cost[a + 1] = cost[a] + per * (offsets[active[a] + 1] - offsets[active[a]] + kTileCost);
  std::vector<int64_t> bounds(nt + 1, A * per);
  bounds[0] = 0;
  int64_t a = 0;
  for (int t = 1; t < nt; ++t) {
    const int64_t target = cost[A] * t / nt;  // the first item whose cost starts at or past it
    while (a < A && cost[a + 1] <= target) ++a;
    if (a == A) break;
    const int64_t c = cost[a + 1] - cost[a];
    bounds[t] = a * per + std::min(per, ((target - cost[a]) * per + c - 1) / c);
  }
  return bounds;
}

// moe_q4's plan of one call: the (token, expert) pairs sorted by expert (a counting sort,
// stable), the active experts and each thread's range of work items (split_items).
struct MoePlan {
  std::vector<int64_t> offsets;    // [E + 1]: expert e's sorted rows are offsets[e]..[e + 1]
  std::vector<int64_t> token_of;   // sorted row -> its token
  std::vector<int64_t> slot_of;    // pair p = (token p / k, its (p % k)-th expert) -> sorted row
  std::vector<float> weight_of;    // sorted row -> its routing weight
  std::vector<int64_t> active, pair_rows, split1, split2;
  int64_t T = 0, k = 0, Pv = 0;    // Pv: the pairs run here
  int64_t per = 1;                 // tiles a work item (moe_units)
};

// moe_q4's work items hold `per` tiles of an expert's matrix (the last maybe fewer): on AVX-512,
// when the experts average a full register block of rows (prefill), a pair, which an expert
// with that many rows runs as one 512-bit pair (tile_dot's NT = 2) and one with fewer as two
// single tiles in turn; otherwise (decode) one tile. (Pairs at 16 rows, ~2 an expert: 2%
// slower, the ranges coarser; at 256 rows 1.14x faster, Qwen3-MoE shape, Zen 4.)
inline int64_t moe_units(int64_t tiles, int64_t per) { return (tiles + per - 1) / per; }

MoePlan moe_plan(const int64_t* idp, const float* wp, int64_t T, int64_t k, int64_t E,
                 int64_t it1, int64_t it2, int nt) {
  MoePlan pl;
  const int64_t P = T * k;
  pl.T = T;
  pl.k = k;
  // id -1: the pair's expert lives in another pool (kiln/layers/moe.py SplitExperts), skipped
  pl.offsets.assign(E + 1, 0);
  for (int64_t p = 0; p < P; ++p) {
    TORCH_CHECK(idp[p] >= -1 && idp[p] < E, "moe_q4: expert id ", idp[p], " out of range");
    if (idp[p] >= 0) ++pl.offsets[idp[p] + 1];
  }
  for (int64_t e = 0; e < E; ++e) pl.offsets[e + 1] += pl.offsets[e];
  pl.Pv = pl.offsets[E];
  pl.token_of.resize(pl.Pv);
  pl.weight_of.resize(pl.Pv);
  pl.slot_of.resize(P);
  std::vector<int64_t> fill(pl.offsets.begin(), pl.offsets.end() - 1);
  for (int64_t p = 0; p < P; ++p) {
    if (idp[p] < 0) {
      pl.slot_of[p] = -1;
      continue;
    }
    const int64_t s = fill[idp[p]]++;
    pl.token_of[s] = p / k;
    pl.weight_of[s] = wp[p];
    pl.slot_of[p] = s;
  }
  for (int64_t e = 0; e < E; ++e)
    if (pl.offsets[e + 1] > pl.offsets[e]) pl.active.push_back(e);
  pl.pair_rows.resize(pl.Pv);
  for (int64_t s = 0; s < pl.Pv; ++s) pl.pair_rows[s] = s;
  pl.per = KILN_VNNI && pl.Pv >= kMaxBlockRows * static_cast<int64_t>(pl.active.size()) ? 2 : 1;
  pl.split1 = split_items(pl.active, pl.offsets, moe_units(it1, pl.per), nt);
  pl.split2 = split_items(pl.active, pl.offsets, moe_units(it2, pl.per), nt);
  return pl;
}

// The experts' weights and the call's buffers, as moe_q4_omp reads them.
struct MoeWeights {
  const uint8_t *w13, *w2;
  int64_t H, I, w13_expert, w13_tile, w2_expert, w2_tile;
  MoeWeights(const at::Tensor& a, const at::Tensor& b)
      : w13(a.data_ptr<uint8_t>()), w2(b.data_ptr<uint8_t>()), H(a.size(2) * kGroup),
        I(a.size(1) * kTile / 2), w13_expert(a.size(1) * a.size(2) * kBlockBytes),
        w13_tile(a.size(2) * kBlockBytes), w2_expert(b.size(1) * b.size(2) * kBlockBytes),
        w2_tile(b.size(2) * kBlockBytes) {}
};

// moe_q4's work, run by every thread `tid` of an enclosing parallel region (its barriers are
// the region's): xs holds the tokens' quantized rows; h [Pv, I], o [Pv, H] and hs are scratch;
// y [T, H] = resid (null: 0) + each token's sum of its pairs' rows. Phase 1: items (active
// expert, 8 intermediate columns) compute the gate and up tiles for all of the expert's rows
// and write silu(gate) * up to h; h is quantized per pair row. Phase 2: items (active expert,
// 8 output columns) write weight * down to o. Finally each token sums its k rows of o. Every
// buffer row and column range has one writer: no atomics, no races; each active expert's
// weights are read once per phase for all its rows.
void moe_q4_omp(const MoePlan& pl, const MoeWeights& mw, const QRows& xs, float* h, QRows& hs,
                float* o, float* y, const float* resid, int tid) {
  constexpr int64_t kRowChunk = 32;
  const int64_t H = mw.H, I = mw.I, it1 = I / kTile, it2 = H / kTile, k = pl.k;
  const int64_t per = pl.per, u1 = moe_units(it1, per), u2 = moe_units(it2, per);
  __m256 g[kRowChunk], u[kRowChunk];
#if KILN_VNNI
  __m512 g2[kRowChunk], up2[kRowChunk];
#endif
  int64_t rows[kRowChunk];
  // The split's ranges are the plan's thread count's; a team given fewer threads takes
  // several each (every range runs once, whatever the team).
  const int team = omp_get_num_threads();
  const int nr_ranges = static_cast<int>(pl.split1.size()) - 1;
  // Phase 1: gate/up. Items are expert-major; each thread takes one contiguous range of
  // them (split1), so it streams its experts' weights front to back.
  for (int r = tid; r < nr_ranges; r += team)
  for (int64_t item = pl.split1[r]; item < pl.split1[r + 1]; ++item) {
    const int64_t e = pl.active[item / u1], j0 = item % u1 * per;
    const int64_t nj = std::min(per, it1 - j0);
    const uint8_t* we = mw.w13 + e * mw.w13_expert;
    for (int64_t r0 = pl.offsets[e]; r0 < pl.offsets[e + 1]; r0 += kRowChunk) {
      const int64_t nr = std::min(kRowChunk, pl.offsets[e + 1] - r0);
      for (int64_t m = 0; m < nr; ++m) rows[m] = pl.token_of[r0 + m];
#if KILN_VNNI
      if (nj == 2 && nr >= kMaxBlockRows) {
        const int64_t st = mw.w13_tile;
        tile_rows<2>(we + j0 * st, st, xs, rows, nr, g2, 2 * st);
        tile_rows<2>(we + (it1 + j0) * st, st, xs, rows, nr, up2, 2 * st);
        for (int64_t m = 0; m < nr; ++m) {
          float* hr = h + (r0 + m) * I + j0 * kTile;
          _mm256_storeu_ps(hr, silu_mul(_mm512_castps512_ps256(g2[m]),
                                        _mm512_castps512_ps256(up2[m])));
          _mm256_storeu_ps(hr + kTile, silu_mul(_mm512_extractf32x8_ps(g2[m], 1),
                                                _mm512_extractf32x8_ps(up2[m], 1)));
        }
        continue;
      }
#endif
      for (int64_t j = j0; j < j0 + nj; ++j) {
        tile_rows(we + j * mw.w13_tile, mw.w13_tile, xs, rows, nr, g, mw.w13_tile);
        tile_rows(we + (it1 + j) * mw.w13_tile, mw.w13_tile, xs, rows, nr, u, mw.w13_tile);
        for (int64_t m = 0; m < nr; ++m)
          _mm256_storeu_ps(h + (r0 + m) * I + j * kTile, silu_mul(g[m], u[m]));
      }
    }
  }
#pragma omp barrier
  quantize_rows_omp(h, pl.Pv, I, hs);
  // Phase 2: down, scaled by each pair's routing weight.
  for (int r = tid; r < nr_ranges; r += team)
  for (int64_t item = pl.split2[r]; item < pl.split2[r + 1]; ++item) {
    const int64_t e = pl.active[item / u2], j0 = item % u2 * per;
    const int64_t nj = std::min(per, it2 - j0);
    const uint8_t* we = mw.w2 + e * mw.w2_expert;
    for (int64_t r0 = pl.offsets[e]; r0 < pl.offsets[e + 1]; r0 += kRowChunk) {
      const int64_t nr = std::min(kRowChunk, pl.offsets[e + 1] - r0);
      const int64_t* pr = pl.pair_rows.data() + r0;
#if KILN_VNNI
      if (nj == 2 && nr >= kMaxBlockRows) {
        const int64_t st = mw.w2_tile;
        tile_rows<2>(we + j0 * st, st, hs, pr, nr, g2, 2 * st);
        for (int64_t m = 0; m < nr; ++m) {
          const __m512 v = _mm512_mul_ps(g2[m], _mm512_set1_ps(pl.weight_of[r0 + m]));
          _mm512_storeu_ps(o + (r0 + m) * H + j0 * kTile, v);
        }
        continue;
      }
#endif
      for (int64_t j = j0; j < j0 + nj; ++j) {
        tile_rows(we + j * mw.w2_tile, mw.w2_tile, hs, pr, nr, g, mw.w2_tile);
        for (int64_t m = 0; m < nr; ++m)
          _mm256_storeu_ps(o + (r0 + m) * H + j * kTile,
                           _mm256_mul_ps(g[m], _mm256_set1_ps(pl.weight_of[r0 + m])));
      }
    }
  }
#pragma omp barrier
  // Each token sums its k pair rows (in its experts' order: deterministic), then the
  // residual is added as the eager layer adds it (x1 + moe(h)).
#pragma omp for schedule(static)
  for (int64_t t = 0; t < pl.T; ++t) {
    float* yt = y + t * H;
    for (int64_t c = 0; c < H; c += kTile) {
      __m256 s = _mm256_setzero_ps();
      for (int64_t j = 0; j < k; ++j)
        if (pl.slot_of[t * k + j] >= 0)
          s = _mm256_add_ps(s, _mm256_loadu_ps(o + pl.slot_of[t * k + j] * H + c));
      if (resid) s = _mm256_add_ps(_mm256_loadu_ps(resid + t * H + c), s);
      _mm256_storeu_ps(yt + c, s);
    }
  }
}

// One MoE layer's routed experts in one call.
//   x        [T, H] fp32 or bf16       the layer's input rows
//   ids      [T, k] int64              each token's experts (from the router); -1: a pair
//                                      whose expert runs in another pool (skipped)
//   weights  [T, k] fp32               their routing weights
//   w13      uint8 [E, 2I/8, H/32, 160]  gate rows 0..I-1 then up rows I..2I-1, per expert
//   w2       uint8 [E, H/8, I/32, 160]   down
//   num_threads  the OpenMP team's size; 0: torch's thread count (a pool of SplitExperts gets
//                its share of the cores, beside the other pool's team)
//   -> y [T, H] in x's dtype: sum_j weights[t, j] * down_e(silu(gate_e x_t) * up_e x_t)
// Each token's row is quantized to int8 once; then moe_plan and moe_q4_omp.
at::Tensor moe_q4(const at::Tensor& x, const at::Tensor& ids, const at::Tensor& weights,
                  const at::Tensor& w13, const at::Tensor& w2, int64_t num_threads) {
  check_x("moe_q4", x);
  check_packed("moe_q4 (w13)", w13, 4);
  check_packed("moe_q4 (w2)", w2, 4);
  const int64_t T = x.size(0), H = x.size(1), E = w13.size(0);
  const int64_t I = w13.size(1) * kTile / 2;
  TORCH_CHECK(ids.dim() == 2 && ids.size(0) == T && ids.scalar_type() == at::kLong,
              "moe_q4: ids [T, k] int64");
  TORCH_CHECK(weights.sizes() == ids.sizes() && weights.scalar_type() == at::kFloat,
              "moe_q4: weights [T, k] float32");
  TORCH_CHECK(w13.size(2) * kGroup == H && w2.size(0) == E && w2.size(1) * kTile == H &&
                  w2.size(2) * kGroup == I && I % kTile == 0 && H % kTile == 0,
              "moe_q4: w13 [E, 2I/8, H/32, 160] and w2 [E, H/8, I/32, 160] do not match x [T, ",
              H, "] (I = ", I, ")");
  auto y = at::empty({T, H}, x.options().dtype(at::kFloat));
  if (T == 0) return y.to(x.scalar_type());
  const auto xc = x.contiguous();
  const auto idc = ids.contiguous();
  const auto wc = weights.contiguous();
  const int nt = num_threads > 0 ? static_cast<int>(num_threads) : threads();
  const MoePlan pl = moe_plan(idc.data_ptr<int64_t>(), wc.data_ptr<float>(), T, ids.size(1), E,
                              I / kTile, H / kTile, nt);
  if (pl.Pv == 0) return at::zeros({T, H}, x.options());
  const MoeWeights mw(w13, w2);
  QRows xs, hs;
  xs.resize(T, H);
  hs.resize(pl.Pv, I);
  // (not zero-filled: every element is written before it is read; at prefill they are ~20 MB)
  std::unique_ptr<float[]> h(new float[pl.Pv * I]), o(new float[pl.Pv * H]);
  float* yp = y.data_ptr<float>();
#pragma omp parallel num_threads(nt)
  {
    if (x.scalar_type() == at::kFloat)
      quantize_rows_omp(xc.data_ptr<float>(), T, H, xs);
    else
      quantize_rows_omp(xc.data_ptr<at::BFloat16>(), T, H, xs);
    moe_q4_omp(pl, mw, xs, h.get(), hs, o.get(), yp, nullptr, omp_get_thread_num());
  }
  return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}

// Batch-invariant attention (kiln/layers/attention.py, `KVStore.invariant`): each query row t
// attends to the first lens[t] slots of its table row, table[row_of[t]], read from the pool in
// place.
//   q      [T, Hq, D]   fp32
//   k      [S, Hk, D]   pool keys, fp32 or bf16 (contiguous)
//   v      [S, Hk, Dv]  pool values, same dtype (contiguous)
//   table  [R, L]       int64 slots; row_of [T] int64 in 0..R-1; lens [T] int64 in 1..L
//   -> out [T, Hq, Dv]  fp32
//
// The invariance argument: every number of a (row, head) pair is computed by one sequence of
// operations fixed by its own query, keys, values and length n, never by the other rows of the
// call, their number, the thread count or which thread runs it:
//   score s_j   = q . k_j: 8-lane fp32 FMAs over D in column order from 0, then one fixed
//                 add tree over the lanes, ((0+1)+(2+3))+((4+5)+(6+7)), times scale;
//   max         = 8-lane max by j mod 8 from j = 0, then hmax;
//   e_j, sum    = exp(s_j - max) (exp_vec), summed in 8 lanes by j mod 8 from 0, then hsum8;
//   out         = (sum_j e_j v_j, one FMA chain per output column in j order 0..n-1) / sum.
// What varies is only which of these independent chains share a loop: the score kernel takes
// up to 3 query heads of one row against 4 keys at a time (each (head, key) accumulator is its
// own chain; a row's last group of keys is padded with copies of its last key, whose scores
// are dropped), several rows of one table row share a work item so their keys and values are
// read once into L1 (each row still stops at its own n), and the PV chains are cut into blocks
// of kVBlock keys whose partial sums go through memory exactly. No padding enters a sum, there
// is no split of a row's keys and no merge: no other row can move a row's bits.
// One fixed tree: (lanes 0-3 + 4-7), then pairs, then the last two.
inline float hsum8(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  x = _mm_add_ss(x, _mm_shuffle_ps(x, x, 1));
  return _mm_cvtss_f32(x);
}

constexpr int64_t kMaxGroup = 16;      // query heads of one KV head per work item, at most
constexpr int64_t kMaxHeadDim = 576;   // DeepSeek-V3's MLA latent row: 512 + 64
constexpr int kScoreKeys = 4;     // keys per score kernel call
constexpr int64_t kAttnAhead = 8;  // keys between a key row's prefetch and its use
constexpr int kHeadChunk = 3;     // query heads per score / PV kernel call (12 accumulators)
constexpr int64_t kVBlock = 64;   // keys per PV block: 64 value rows of one head stay in L1
constexpr int64_t kTileVecs = 12; // query vectors (rows x heads) per work item, at most

// Scores of NQ query heads against 4 keys: s[i][j0 + kk] = scale * q_i . k_kk. Each of the
// NQ x 4 accumulators is its own FMA chain over D; the reduction tree is the same for every
// lane of the result (hadd pairs lanes (0,1),(2,3) per 128-bit half, the second hadd adds
// those pairs, the last add joins the halves).
template <typename T, int NQ>
inline void score4(const float* const* qv, const T* const* kr, int64_t D, __m128 scale,
                   float* const* s, int64_t j0) {
  __m256 a[NQ][kScoreKeys];
  for (int i = 0; i < NQ; ++i)
    for (int kk = 0; kk < kScoreKeys; ++kk) a[i][kk] = _mm256_setzero_ps();
  for (int64_t c = 0; c < D; c += 8) {
    __m256 qc[NQ];
    for (int i = 0; i < NQ; ++i) qc[i] = _mm256_loadu_ps(qv[i] + c);
    for (int kk = 0; kk < kScoreKeys; ++kk) {
      const __m256 kc = load8(kr[kk] + c);
      for (int i = 0; i < NQ; ++i) a[i][kk] = _mm256_fmadd_ps(qc[i], kc, a[i][kk]);
    }
  }
  for (int i = 0; i < NQ; ++i) {
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a[i][0], a[i][1]),
                                    _mm256_hadd_ps(a[i][2], a[i][3]));
    const __m128 r = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    _mm_storeu_ps(s[i] + j0, _mm_mul_ps(r, scale));
  }
}

template <typename T>
inline void score4_n(int nq, const float* const* qv, const T* const* kr, int64_t D,
                     __m128 scale, float* const* s, int64_t j0) {
  switch (nq) {
    case 1: score4<T, 1>(qv, kr, D, scale, s, j0); break;
    case 2: score4<T, 2>(qv, kr, D, scale, s, j0); break;
    default: score4<T, 3>(qv, kr, D, scale, s, j0); break;
  }
}

// One (row, head)'s scores s[0..n) -> e_j = exp(s_j - max) in place (s[n..n8) become 0), and
// returns sum_j e_j (fixed lanes and tree: see the invariance argument above).
inline float softmax_weights(float* s, int64_t n) {
  const int64_t n8 = (n + 7) / 8 * 8;
  for (int64_t j = n; j < n8; ++j) s[j] = -INFINITY;
  __m256 mx8 = _mm256_set1_ps(-INFINITY);
  for (int64_t j = 0; j < n8; j += 8) mx8 = _mm256_max_ps(mx8, _mm256_loadu_ps(s + j));
  const __m256 mx = _mm256_set1_ps(hmax(mx8));
  __m256 sum8 = _mm256_setzero_ps();
  for (int64_t j = 0; j < n8; j += 8) {
    __m256 e = exp_vec(_mm256_sub_ps(_mm256_loadu_ps(s + j), mx));
    // exp_vec clamps at 2^-126: masked tail lanes must be exactly 0
    if (j + 8 > n) {
      alignas(32) float m[8];
      for (int i = 0; i < 8; ++i) m[i] = (j + i < n) ? 1.0f : 0.0f;
      e = _mm256_mul_ps(e, _mm256_load_ps(m));
    }
    _mm256_storeu_ps(s + j, e);
    sum8 = _mm256_add_ps(sum8, e);
  }
  return hsum8(sum8);
}

// acc[i][c0 .. c0 + 8 NV) += sum_{j in [j0, j1)} e[i][j] v_j, one FMA per column and key in j
// order (`first`: the chains start at 0 instead of acc). vp[j - jb]: value row j's head.
template <typename T, int NQ, int NV>
inline void pv_block(const float* const* e, const T* const* vp, int64_t jb, int64_t j0,
                     int64_t j1, int64_t c0, float* const* acc, bool first) {
  __m256 a[NQ][NV];
  for (int i = 0; i < NQ; ++i)
    for (int c = 0; c < NV; ++c)
      a[i][c] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(acc[i] + c0 + 8 * c);
  for (int64_t j = j0; j < j1; ++j) {
    const T* vr = vp[j - jb] + c0;
    __m256 w[NQ];
    for (int i = 0; i < NQ; ++i) w[i] = _mm256_broadcast_ss(e[i] + j);
    for (int c = 0; c < NV; ++c) {
      const __m256 vv = load8(vr + 8 * c);
      for (int i = 0; i < NQ; ++i) a[i][c] = _mm256_fmadd_ps(w[i], vv, a[i][c]);
    }
  }
  for (int i = 0; i < NQ; ++i)
    for (int c = 0; c < NV; ++c) _mm256_storeu_ps(acc[i] + c0 + 8 * c, a[i][c]);
}

template <typename T, int NQ>
inline void pv_cols(const float* const* e, const T* const* vp, int64_t jb, int64_t j0,
                    int64_t j1, int64_t Dv, float* const* acc, bool first) {
  int64_t c0 = 0;
  for (; c0 + 32 <= Dv; c0 += 32) pv_block<T, NQ, 4>(e, vp, jb, j0, j1, c0, acc, first);
  switch ((Dv - c0) / 8) {
    case 1: pv_block<T, NQ, 1>(e, vp, jb, j0, j1, c0, acc, first); break;
    case 2: pv_block<T, NQ, 2>(e, vp, jb, j0, j1, c0, acc, first); break;
    case 3: pv_block<T, NQ, 3>(e, vp, jb, j0, j1, c0, acc, first); break;
    default: break;
  }
}

template <typename T>
inline void pv_n(int nq, const float* const* e, const T* const* vp, int64_t jb, int64_t j0,
                 int64_t j1, int64_t Dv, float* const* acc, bool first) {
  switch (nq) {
    case 1: pv_cols<T, 1>(e, vp, jb, j0, j1, Dv, acc, first); break;
    case 2: pv_cols<T, 2>(e, vp, jb, j0, j1, Dv, acc, first); break;
    default: pv_cols<T, 3>(e, vp, jb, j0, j1, Dv, acc, first); break;
  }
}

// The body, run by every thread of an enclosing parallel region of `nt` threads (an orphaned
// `omp for`, implicit barrier at its end); attend_rows_impl opens the region.
template <typename T>
void attend_rows_omp(const float* q, const T* k, const T* v, const int64_t* table,
                     const int64_t* row_of, const int64_t* lens, float* out, int64_t Tn,
                     int64_t Hq, int64_t Hk, int64_t D, int64_t Dv, int64_t L, float scale,
                     int nt, int64_t vrow = 0) {
  // vrow: elements from one slot's values to the next (0: Hk * Dv, a pool of its own; MLA's
  // values are the first Dv columns of the latent keys: vrow = D)
  if (vrow == 0) vrow = Hk * Dv;
  const int64_t group = Hq / Hk;
  // Work items: a tile of up to `rows_per_tile` consecutive rows of one table row (a prefill
  // chunk's rows share their keys), one KV head, and a part of its query heads. Fewer items
  // than threads (a decode step of one row on a model with one KV head) split the heads so
  // that every thread has work; no further: each part reads all of its KV head's keys and
  // values, which at batch 1 cost more than the imbalance (SmolLM2, 3 KV heads on 2 threads,
  // ~1,000-token context: 71-75 tok/s with 3 whole heads vs 64-67 with 9 single query heads
  // and 64 with 6 pairs). None of this touches a row's arithmetic (see above).
  const int64_t rows_per_tile = std::max<int64_t>(1, kTileVecs / group);
  std::vector<int64_t> tiles;  // first row of each tile, then Tn
  for (int64_t t = 0; t < Tn; ++t)
    if (tiles.empty() || t - tiles.back() >= rows_per_tile || row_of[t] != row_of[tiles.back()])
      tiles.push_back(t);
  const int64_t ntiles = static_cast<int64_t>(tiles.size());
  tiles.push_back(Tn);
  // at most kMaxGroup query heads an item (MLA: all of a layer's heads share one KV head)
  int64_t parts = (group + kMaxGroup - 1) / kMaxGroup;
  while (parts < group && ntiles * Hk * parts < nt) ++parts;
  const __m128 scale4 = _mm_set1_ps(scale);
  // scores, then weights, of the tile's (row, head) pairs: [rows_per_tile * group][L + 8]
  std::vector<float> sbuf(rows_per_tile * group * (L + 8));
  std::vector<float> abuf(rows_per_tile * group * Dv);  // their PV sums
  std::vector<const T*> vp(kVBlock);
#pragma omp for schedule(dynamic, 1)
  for (int64_t item = 0; item < ntiles * Hk * parts; ++item) {
    const int64_t tile = item / (Hk * parts), kh = (item / parts) % Hk, part = item % parts;
    const int64_t t0 = tiles[tile], nr = tiles[tile + 1] - t0;
    const int64_t g0 = kh * group + part * group / parts;
    const int64_t ng = kh * group + (part + 1) * group / parts - g0;  // query heads
    const int64_t* slots = table + row_of[t0] * L;
    int64_t nmax = 0;
    for (int64_t r = 0; r < nr; ++r) nmax = std::max(nmax, lens[t0 + r]);
    auto srow = [&](int64_t r, int64_t h) { return sbuf.data() + (r * ng + h) * (L + 8); };
    // Scores: 4 keys at a time, every row of the tile that reaches them (its own keys only,
    // its last group padded with its last key).
    for (int64_t j = 0; j < nmax; j += kScoreKeys) {
      for (int64_t r = 0; r < nr; ++r) {
        const int64_t n = lens[t0 + r];
        if (j >= n) continue;
        const T* kr[kScoreKeys];
        for (int kk = 0; kk < kScoreKeys; ++kk)
          kr[kk] = k + (slots[std::min(j + kk, n - 1)] * Hk + kh) * D;
        // The pool's rows are paged (a slot table), so the hardware's prefetcher cannot run
        // ahead of them: ask for the keys kAttnAhead on (L1) and for these keys' values (L2,
        // read after the softmax). Measured (SmolLM2, 16 rows, ~300-token contexts, Zen 4):
        // attention was a third of the step, its time on the loads of keys and values.
        if (r == 0)  // a tile's rows share their keys: once
          for (int kk = 0; kk < kScoreKeys; ++kk) {
            if (j + kAttnAhead + kk < n)
              prefetch_lines<_MM_HINT_T0>(k + (slots[j + kAttnAhead + kk] * Hk + kh) * D, D * sizeof(T));
            if (j + kk < n)
              prefetch_lines<_MM_HINT_T1>(v + slots[j + kk] * vrow + kh * Dv, Dv * sizeof(T));
          }
        for (int64_t h = 0; h < ng; h += kHeadChunk) {
          const int nq = static_cast<int>(std::min<int64_t>(kHeadChunk, ng - h));
          const float* qv[kHeadChunk];
          float* s[kHeadChunk];
          for (int i = 0; i < nq; ++i) {
            qv[i] = q + ((t0 + r) * Hq + g0 + h + i) * D;
            s[i] = srow(r, h + i);
          }
          score4_n<T>(nq, qv, kr, D, scale4, s, j);
        }
      }
    }
    float sums[kTileVecs > kMaxGroup ? kTileVecs : kMaxGroup];
    for (int64_t r = 0; r < nr; ++r)
      for (int64_t h = 0; h < ng; ++h)
        sums[r * ng + h] = softmax_weights(srow(r, h), lens[t0 + r]);
    // PV: blocks of kVBlock keys; each row's chains run to its own n.
    for (int64_t jb = 0; jb < nmax; jb += kVBlock) {
      const int64_t je = std::min(jb + kVBlock, nmax);
      for (int64_t j = jb; j < je; ++j) vp[j - jb] = v + slots[j] * vrow + kh * Dv;
      for (int64_t r = 0; r < nr; ++r) {
        const int64_t n = lens[t0 + r];
        if (jb >= n) continue;
        for (int64_t h = 0; h < ng; h += kHeadChunk) {
          const int nq = static_cast<int>(std::min<int64_t>(kHeadChunk, ng - h));
          const float* e[kHeadChunk];
          float* acc[kHeadChunk];
          for (int i = 0; i < nq; ++i) {
            e[i] = srow(r, h + i);
            acc[i] = abuf.data() + (r * ng + h + i) * Dv;
          }
          pv_n<T>(nq, e, vp.data(), jb, jb, std::min(je, n), Dv, acc, jb == 0);
        }
      }
    }
    for (int64_t r = 0; r < nr; ++r)
      for (int64_t h = 0; h < ng; ++h) {
        const __m256 inv = _mm256_set1_ps(1.0f / sums[r * ng + h]);
        const float* a = abuf.data() + (r * ng + h) * Dv;
        float* o = out + ((t0 + r) * Hq + g0 + h) * Dv;
        for (int64_t c = 0; c < Dv; c += 8)
          _mm256_storeu_ps(o + c, _mm256_mul_ps(_mm256_loadu_ps(a + c), inv));
      }
  }
}

template <typename T>
void attend_rows_impl(const float* q, const T* k, const T* v, const int64_t* table,
                      const int64_t* row_of, const int64_t* lens, float* out, int64_t Tn,
                      int64_t Hq, int64_t Hk, int64_t D, int64_t Dv, int64_t L, float scale,
                      int64_t vrow) {
  const int nt = threads();
#pragma omp parallel num_threads(nt)
  attend_rows_omp(q, k, v, table, row_of, lens, out, Tn, Hq, Hk, D, Dv, L, scale, nt, vrow);
}
// q8_linear: y = x @ (q * scale)^T for an int8 weight q [N, K] (row-major, as Int8Linear keeps
// it) with one scale per output row, x fp32: the int8 head (--batch-invariant). Each output
// y[m, n] is one FMA chain over K in column order from 0 (the weight row converted to fp32
// exactly), the same add tree as score4's, then times scale[n]: it depends on nothing but x's
// row m and weight row n, so a row's logits are the same bits whatever else is in the step
// and whatever the thread count. Work: tiles of 4 weight rows, converted once into an L1
// buffer and reused by every activation row, 3 at a time (score4's 12 accumulators).
template <typename S>
void q8_linear_impl(const float* x, const int8_t* w, const S* scale, float* y, int64_t M,
                    int64_t N, int64_t K) {
  const int64_t tiles = (N + kScoreKeys - 1) / kScoreKeys;
  // A decode step (up to kHeadChunk rows) uses each weight row once: converting it into the
  // buffer first would only add a store and a load per value, so the rows are read in place
  // (load8's int8 overload: the same exact conversion, the same FMA chains and bits).
  const bool direct = M <= kHeadChunk;
#pragma omp parallel num_threads(threads())
  {
    std::vector<float> wbuf(direct ? 0 : kScoreKeys * K);
    std::vector<float> tail(kHeadChunk * kScoreKeys);
#pragma omp for schedule(static)
    for (int64_t tile = 0; tile < tiles; ++tile) {
      const int64_t n0 = tile * kScoreKeys, valid = std::min<int64_t>(kScoreKeys, N - n0);
      const float* wr[kScoreKeys];
      const int8_t* wq[kScoreKeys];
      alignas(16) float sc[kScoreKeys];
      for (int kk = 0; kk < kScoreKeys; ++kk) {
        const int64_t n = n0 + std::min<int64_t>(kk, valid - 1);  // pad with the last row
        prefetch_ahead(w + n * K, K);
        wq[kk] = w + n * K;
        sc[kk] = static_cast<float>(scale[n]);
        if (direct) continue;
        float* b = wbuf.data() + kk * K;
        for (int64_t c = 0; c < K; c += 8) _mm256_storeu_ps(b + c, load8(w + n * K + c));
        wr[kk] = b;
      }
      const __m128 s4 = _mm_load_ps(sc);
      for (int64_t m = 0; m < M; m += kHeadChunk) {
        const int nq = static_cast<int>(std::min<int64_t>(kHeadChunk, M - m));
        const float* xv[kHeadChunk];
        float* out[kHeadChunk];
        for (int i = 0; i < nq; ++i) {
          xv[i] = x + (m + i) * K;
          out[i] = valid == kScoreKeys ? y + (m + i) * N : tail.data() + i * kScoreKeys;
        }
        if (direct)
          score4_n<int8_t>(nq, xv, wq, K, s4, out, valid == kScoreKeys ? n0 : 0);
        else
          score4_n<float>(nq, xv, wr, K, s4, out, valid == kScoreKeys ? n0 : 0);
        if (valid < kScoreKeys)
          for (int i = 0; i < nq; ++i)
            std::memcpy(y + (m + i) * N + n0, out[i], valid * sizeof(float));
      }
    }
  }
}

// attend_rows' table, row_of and lens, contiguous int64 and checked: every row's length within
// the table's width, every row_of a row of the table.
struct RowTable {
  at::Tensor table, row_of, lens;
  int64_t L;
  RowTable(const at::Tensor& t, const at::Tensor& r, const at::Tensor& l)
      : table(t.contiguous()), row_of(r.to(at::kLong).contiguous()),
        lens(l.to(at::kLong).contiguous()), L(table.size(1)) {
    const int64_t* lp = lens.data_ptr<int64_t>();
    const int64_t* rp = row_of.data_ptr<int64_t>();
    for (int64_t t = 0; t < lens.numel(); ++t)
      TORCH_CHECK(lp[t] >= 1 && lp[t] <= L && rp[t] >= 0 && rp[t] < table.size(0),
                  "attend_rows: row ", t, " has length ", lp[t], " (table width ", L, ")");
  }
};

at::Tensor attend_rows(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       const at::Tensor& table, const at::Tensor& row_of, const at::Tensor& lens,
                       double scale) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat, "attend_rows: q must be fp32 [T, Hq, D]");
  // v: a pool of its own, or (MLA) a view of k's first Dv columns: each slot's heads
  // contiguous, slots at v.stride(0)
  TORCH_CHECK(k.dim() == 3 && v.dim() == 3 && k.is_contiguous() && v.stride(2) == 1 &&
                  (v.size(1) == 1 || v.stride(1) == v.size(2)) && v.size(0) == k.size(0) &&
                  v.size(1) == k.size(1) && k.scalar_type() == v.scalar_type() &&
                  (k.scalar_type() == at::kFloat || k.scalar_type() == at::kBFloat16 ||
                   k.scalar_type() == at::kHalf),
              "attend_rows: k must be contiguous fp32/bf16/fp16 [S, Hk, D], v [S, Hk, Dv] with "
              "each slot's heads contiguous");
  const int64_t Tn = q.size(0), Hq = q.size(1), D = q.size(2), Hk = k.size(1), Dv = v.size(2);
  TORCH_CHECK(k.size(2) == D && D % 8 == 0 && Dv % 8 == 0 && Hq % Hk == 0 &&
                  D <= kMaxHeadDim && Dv <= kMaxHeadDim,
              "attend_rows: head dims must match, be multiples of 8 and at most ", kMaxHeadDim);
  TORCH_CHECK(table.dim() == 2 && table.scalar_type() == at::kLong && row_of.numel() == Tn &&
                  lens.numel() == Tn,
              "attend_rows: table [R, L] int64, row_of and lens [T] int64");
  auto out = at::empty({Tn, Hq, Dv}, q.options());
  if (Tn == 0) return out;
  const auto qc = q.contiguous();
  const RowTable rt(table, row_of, lens);
  const auto& tc = rt.table;
  const int64_t L = rt.L;
  const int64_t* lp = rt.lens.data_ptr<int64_t>();
  const int64_t* rp = rt.row_of.data_ptr<int64_t>();
  auto run = [&](const auto* kp, const auto* vp) {
    attend_rows_impl(qc.data_ptr<float>(), kp, vp, tc.data_ptr<int64_t>(), rp, lp,
                     out.data_ptr<float>(), Tn, Hq, Hk, D, Dv, L, static_cast<float>(scale),
                     v.stride(0));
  };
  if (k.scalar_type() == at::kFloat)
    run(k.data_ptr<float>(), v.data_ptr<float>());
  else if (k.scalar_type() == at::kHalf)
    run(k.data_ptr<at::Half>(), v.data_ptr<at::Half>());
  else
    run(k.data_ptr<at::BFloat16>(), v.data_ptr<at::BFloat16>());
  return out;
}

at::Tensor q8_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "q8_linear: x must be fp32 [M, K]");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kChar && w.is_contiguous() &&
                  w.size(1) == x.size(1) && x.size(1) % 8 == 0,
              "q8_linear: w must be contiguous int8 [N, K] with K = x's, a multiple of 8");
  TORCH_CHECK(scale.dim() == 1 && scale.numel() == w.size(0) && scale.is_contiguous() &&
                  (scale.scalar_type() == at::kFloat || scale.scalar_type() == at::kBFloat16),
              "q8_linear: scale must be contiguous fp32/bf16 [N]");
  const int64_t M = x.size(0), N = w.size(0), K = x.size(1);
  auto y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const auto xc = x.contiguous();
  if (scale.scalar_type() == at::kFloat)
    q8_linear_impl(xc.data_ptr<float>(), w.data_ptr<int8_t>(), scale.data_ptr<float>(),
                   y.data_ptr<float>(), M, N, K);
  else
    q8_linear_impl(xc.data_ptr<float>(), w.data_ptr<int8_t>(), scale.data_ptr<at::BFloat16>(),
                   y.data_ptr<float>(), M, N, K);
  return y;
}

}  // namespace

// ----------------------------------------------------------------------------- LoRA
// lora_add: out[rows of segment s] += (x[rows] @ A_l^T) @ B_l^T for each segment of the step's
// rows (rows of one adapter are contiguous: the runner sorts them), in one call per linear.
// Why a kernel: a decode step's adapter products are tiny (16 rows x rank 16), so PyTorch's
// ops cost their dispatch and parallel regions more than their arithmetic (a linear took 4-8
// ops, x 120 linears a step), and a masked or padded batched form multiplies zeros.
//
//   a      [L, R, K] fp32   adapter l's A (packed linears: the shards' A stacked), rows past
//                           its rank unused
//   bt     [L, R, N] fp32   adapter l's B transposed (row j: the output column weights of
//                           rank j), the scaling folded in
//   pieces [L, P, 4] int32  (j0, j1, lo, hi): ranks j0..j1 write output columns lo..hi only
//                           (a packed linear's shards: B is block-diagonal, zeros skipped)
//   seg    [S, 3] int64     (adapter slot, first row, end row) of the step's groups
//   local  [slots] int32    adapter slot -> l in this linear (-1: the adapter skips it)
// Rows are taken kRowsLoRA at a time so that each weight row read serves all of them.
namespace {

constexpr int kRowsLoRA = 4;

template <int NR>
void lora_rows(const float* x, int64_t ldx, float* out, int64_t ldo, const float* a,
               const float* bt, const int32_t* pieces, int64_t npieces, int64_t K, int64_t N,
               float* t, int64_t r) {
  // shrink: t[i][j] = x_i . a_j
  for (int64_t j = 0; j < r; ++j) {
    const float* aj = a + j * K;
    __m256 acc[NR];
    for (int i = 0; i < NR; ++i) acc[i] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
      const __m256 va = _mm256_loadu_ps(aj + k);
      for (int i = 0; i < NR; ++i)
        acc[i] = _mm256_fmadd_ps(_mm256_loadu_ps(x + i * ldx + k), va, acc[i]);
    }
    for (int i = 0; i < NR; ++i) {
      float s = hsum(acc[i]);
      for (int64_t kk = k; kk < K; ++kk) s += x[i * ldx + kk] * aj[kk];
      t[i * r + j] = s;
    }
  }
  // expand: out_i[lo:hi] += sum_j t[i][j] * bt_j[lo:hi], 8 columns x NR rows in registers
  for (int64_t p = 0; p < npieces; ++p) {
    const int32_t j0 = pieces[4 * p], j1 = pieces[4 * p + 1];
    const int32_t lo = pieces[4 * p + 2], hi = pieces[4 * p + 3];
    if (j1 <= j0) continue;
    int64_t n = lo;
    for (; n + 8 <= hi; n += 8) {
      __m256 acc[NR];
      for (int i = 0; i < NR; ++i) acc[i] = _mm256_loadu_ps(out + i * ldo + n);
      for (int32_t j = j0; j < j1; ++j) {
        const __m256 vb = _mm256_loadu_ps(bt + j * N + n);
        for (int i = 0; i < NR; ++i)
          acc[i] = _mm256_fmadd_ps(_mm256_broadcast_ss(t + i * r + j), vb, acc[i]);
      }
      for (int i = 0; i < NR; ++i) _mm256_storeu_ps(out + i * ldo + n, acc[i]);
    }
    for (; n < hi; ++n)
      for (int i = 0; i < NR; ++i) {
        float s = out[i * ldo + n];
        for (int32_t j = j0; j < j1; ++j) s += t[i * r + j] * bt[j * N + n];
        out[i * ldo + n] = s;
      }
  }
}

// Below this many multiply-adds (~20 us on one core) a call runs on the calling thread: a
// parallel region's start and barrier cost more than it saves. A c=16 decode step's linears
// (~0.2-1M each on SmolLM2 with 4 rank-16 adapters) split, each thread reading its own
// adapters' A and B: measured on a quiet 2-core machine, c=16 with 4 adapters 0.77x of the base
// serial at 1 << 22, 0.82x at 1 << 18, 0.86x at 1 << 16 (the base's linears are parallel too).
constexpr int64_t kLoRAParallelWork = 1 << 16;

void lora_add(at::Tensor out, const at::Tensor& x, const at::Tensor& a, const at::Tensor& bt,
              const at::Tensor& pieces, const at::Tensor& ranks, const at::Tensor& seg,
              const at::Tensor& local) {
  TORCH_CHECK(out.scalar_type() == at::kFloat && x.scalar_type() == at::kFloat &&
                  a.scalar_type() == at::kFloat && bt.scalar_type() == at::kFloat,
              "lora_add: fp32 out, x, a, bt");
  TORCH_CHECK(out.dim() == 2 && x.dim() == 2 && out.size(0) == x.size(0) &&
                  out.stride(1) == 1 && x.stride(1) == 1,
              "lora_add: out [M, N] and x [M, K] with unit column stride");
  TORCH_CHECK(a.dim() == 3 && bt.dim() == 3 && a.is_contiguous() && bt.is_contiguous() &&
                  a.size(0) == bt.size(0) && a.size(1) == bt.size(1) &&
                  a.size(2) == x.size(1) && bt.size(2) == out.size(1),
              "lora_add: a [L, R, K] and bt [L, R, N], contiguous");
  TORCH_CHECK(pieces.scalar_type() == at::kInt && pieces.is_contiguous() && pieces.dim() == 3 &&
                  pieces.size(0) == a.size(0) && pieces.size(2) == 4 &&
                  ranks.scalar_type() == at::kInt && ranks.numel() == a.size(0) &&
                  seg.scalar_type() == at::kLong && seg.is_contiguous() &&
                  local.scalar_type() == at::kInt && local.is_contiguous(),
              "lora_add: pieces int32 [L, P, 4], ranks int32 [L], seg int64 [S, 3], "
              "local int32 [slots]");
  const int64_t M = x.size(0), K = x.size(1), N = out.size(1);
  const int64_t L = a.size(0), R = a.size(1), P = pieces.size(1);
  const int64_t S = seg.numel() / 3, slots = local.numel();
  const int64_t* sp = seg.data_ptr<int64_t>();
  const int32_t* lp = local.data_ptr<int32_t>();
  const int32_t* rp = ranks.data_ptr<int32_t>();
  const int32_t* pp = pieces.data_ptr<int32_t>();
  std::vector<int64_t> row_work(L);  // multiply-adds per row of adapter l
  for (int64_t l = 0; l < L; ++l) {
    TORCH_CHECK(rp[l] >= 0 && rp[l] <= R, "lora_add: rank ", rp[l], " of adapter ", l);
    row_work[l] = rp[l] * K;
    for (int64_t q = 0; q < P; ++q) {
      const int32_t* pc = pp + (l * P + q) * 4;
      TORCH_CHECK(pc[0] >= 0 && pc[1] <= rp[l] && pc[2] >= 0 && pc[3] <= N,
                  "lora_add: piece out of range");
      if (pc[1] > pc[0] && pc[3] > pc[2]) row_work[l] += (pc[1] - pc[0]) * (pc[3] - pc[2]);
    }
  }
  struct Unit { int64_t row, n, l; };
  std::vector<Unit> units;
  int64_t work = 0;
  for (int64_t s = 0; s < S; ++s) {
    const int64_t slot = sp[3 * s], first = sp[3 * s + 1], end = sp[3 * s + 2];
    TORCH_CHECK(first >= 0 && end <= M && first <= end, "lora_add: segment rows out of range");
    if (slot < 0 || slot >= slots || lp[slot] < 0) continue;
    const int64_t l = lp[slot];
    TORCH_CHECK(l < L, "lora_add: local index out of range");
    for (int64_t row = first; row < end; row += kRowsLoRA)
      units.push_back({row, std::min<int64_t>(kRowsLoRA, end - row), l});
    work += (end - first) * row_work[l];
  }
  if (units.empty()) return;
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float* ap = a.data_ptr<float>();
  const float* bp = bt.data_ptr<float>();
  const int64_t ldx = x.stride(0), ldo = out.stride(0);
  auto run = [&](int64_t begin, int64_t end) {
    std::vector<float> t(kRowsLoRA * std::max<int64_t>(R, 1));
    for (int64_t u = begin; u < end; ++u) {
      const Unit& w = units[u];
      const int64_t r = rp[w.l];
      const float* xr = xp + w.row * ldx;
      float* orow = op + w.row * ldo;
      const float* al = ap + w.l * R * K;
      const float* bl = bp + w.l * R * N;
      const int32_t* pl = pp + w.l * P * 4;
      switch (w.n) {
        case 4: lora_rows<4>(xr, ldx, orow, ldo, al, bl, pl, P, K, N, t.data(), r); break;
        case 3: lora_rows<3>(xr, ldx, orow, ldo, al, bl, pl, P, K, N, t.data(), r); break;
        case 2: lora_rows<2>(xr, ldx, orow, ldo, al, bl, pl, P, K, N, t.data(), r); break;
        default: lora_rows<1>(xr, ldx, orow, ldo, al, bl, pl, P, K, N, t.data(), r); break;
      }
    }
  };
  const int64_t nu = static_cast<int64_t>(units.size());
  if (work < kLoRAParallelWork || nu == 1)
    run(0, nu);
  else
    at::parallel_for(0, nu, 1, run);
}


// ---------------------------------------------------------------- the rest of a decoder layer
// fp32 row kernels for RMSNorm, RoPE with the K/V write, and SiLU x up, and decode_layer, a
// Llama decoder layer of a whole step (decode rows, prefill chunks, speculative verify rows) in
// one call. The eager layers (kiln/models/llama.py, run where the layer kernel does not: LoRA
// adapter steps, --no-batch-invariant) call the kernels one by one; decode_layer calls the
// very same functions (and q4_linear, attend_rows, kiln_kquant::kq_linear) in the same order,
// so a row gets the same bits either way (--batch-invariant), while a step pays one dispatch
// per layer instead of ~30 PyTorch ops (batch-1 decode is dispatch-bound: each op costs more
// than the arithmetic of one row). Each row's numbers come from its own row alone, in an order
// fixed by the row: none of these kernels mixes rows.

// Below this many elements in all a kernel runs on the calling thread (a parallel region's
// start and barrier cost more than a decode step's few rows).
constexpr int64_t kRowsParallel = 1 << 15;

// y = w * (x * 1/sqrt(mean(x^2) + eps)), kiln/layers/norm.py's fp32 math: the sum of squares
// in 8 lanes by column mod 8 from 0, then hsum8's fixed tree.
void rms_row(const float* x, const float* w, float eps, int64_t H, float* y) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t c = 0; c < H; c += 8) {
    const __m256 v = _mm256_loadu_ps(x + c);
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  const float mean = hsum8(acc) / static_cast<float>(H);
  const __m256 inv = _mm256_set1_ps(1.0f / std::sqrt(mean + eps));
  for (int64_t c = 0; c < H; c += 8)
    _mm256_storeu_ps(y + c, _mm256_mul_ps(_mm256_loadu_ps(w + c),
                                          _mm256_mul_ps(_mm256_loadu_ps(x + c), inv)));
}

// One head of D values rotated: y = x * cos + cat(x2, x1) * sin_signed (RotaryEmbedding's
// signed sin: HF's rotate_half folded in).
// y: the query's fp32 rows, or a KV pool's (fp32 or fp16: the same floats, stored rounded).
template <typename T>
inline void rope_head(const float* x, const float* cs, const float* sn, int64_t D, T* y) {
  const int64_t half = D / 2;
  for (int64_t i = 0; i < half; i += 8) {
    const __m256 a = _mm256_loadu_ps(x + i), b = _mm256_loadu_ps(x + half + i);
    store8(y + i, _mm256_add_ps(_mm256_mul_ps(a, _mm256_loadu_ps(cs + i)),
                                _mm256_mul_ps(b, _mm256_loadu_ps(sn + i))));
    store8(y + half + i, _mm256_add_ps(_mm256_mul_ps(b, _mm256_loadu_ps(cs + half + i)),
                                       _mm256_mul_ps(a, _mm256_loadu_ps(sn + half + i))));
  }
}

// One row of qkv [(Hq + 2 Hk) D]: its q heads rotated into qd [Hq, D], its k heads rotated into
// the pool at kd [Hk, D], its v heads copied to vd (T: the pool's fp32 or fp16).
template <typename T>
inline void rope_row(const float* row, const float* cs, const float* sn, int64_t Hq, int64_t Hk,
                     int64_t D, float* qd, T* kd, T* vd) {
  for (int64_t h = 0; h < Hq; ++h) rope_head(row + h * D, cs, sn, D, qd + h * D);
  for (int64_t h = 0; h < Hk; ++h) rope_head(row + (Hq + h) * D, cs, sn, D, kd + h * D);
  const float* vs = row + (Hq + Hk) * D;
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(vd, vs, Hk * D * sizeof(float));
  } else {
    for (int64_t i = 0; i < Hk * D; i += 8) store8(vd + i, _mm256_loadu_ps(vs + i));
  }
}

// A KV pool's element type as the kernels take it: fp32 or fp16 (K and V alike).
bool kernel_pool(const at::Tensor& k, const at::Tensor& v) {
  return k.dim() == 3 && v.dim() == 3 && k.is_contiguous() && v.is_contiguous() &&
         k.sizes() == v.sizes() && k.scalar_type() == v.scalar_type() &&
         (k.scalar_type() == at::kFloat || k.scalar_type() == at::kHalf);
}

// silu(g) * u of one row: g, u [I] -> y [I].
inline void silu_row(const float* g, const float* u, int64_t I, float* y) {
  for (int64_t c = 0; c < I; c += 8)
    _mm256_storeu_ps(y + c, silu_mul(_mm256_loadu_ps(g + c), _mm256_loadu_ps(u + c)));
}

// y = rms_norm(x) row by row, each row quantized into q as it is written: the one-call layers'
// norm before their MLP, run by every thread of an enclosing region (an orphaned `omp for`).
inline void norm_rows_omp(const float* x, const float* w, float eps, int64_t T, int64_t H,
                          float* y, QRows& q) {
#pragma omp for schedule(static)
  for (int64_t t = 0; t < T; ++t) {
    rms_row(x + t * H, w, eps, H, y + t * H);
    q.quantize(t, y + t * H);
  }
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat &&
                  w.numel() == x.size(1) && x.size(1) % 8 == 0,
              "rms_norm: x fp32 [M, H] with H a multiple of 8, weight fp32 [H]");
  const auto xc = x.contiguous(), wc = w.contiguous();
  auto y = at::empty_like(xc);
  const int64_t M = xc.size(0), H = xc.size(1);
  const float* xp = xc.data_ptr<float>();
  const float* wp = wc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const float e = static_cast<float>(eps);
#pragma omp parallel for num_threads(threads()) if (M * H >= kRowsParallel) schedule(static)
  for (int64_t r = 0; r < M; ++r) rms_row(xp + r * H, wp, e, H, yp + r * H);
  return y;
}

// silu(g) * u for gu = [g u] fp32 [M, 2I] -> [M, I] (the MoE kernel's silu_mul, exp_vec).
at::Tensor silu_mul_rows(const at::Tensor& gu) {
  TORCH_CHECK(gu.dim() == 2 && gu.scalar_type() == at::kFloat && gu.size(1) % 16 == 0,
              "silu_mul: gu must be fp32 [M, 2I] with I a multiple of 8");
  const auto gc = gu.contiguous();
  const int64_t M = gc.size(0), I = gc.size(1) / 2;
  auto y = at::empty({M, I}, gc.options());
  const float* gp = gc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
#pragma omp parallel for num_threads(threads()) if (M * I >= kRowsParallel) schedule(static)
  for (int64_t r = 0; r < M; ++r) silu_row(gp + r * 2 * I, gp + r * 2 * I + I, I, yp + r * I);
  return y;
}

// The step's K/V slots (contiguous int64), each checked to lie in a pool of S slots.
const int64_t* checked_slots(const at::Tensor& slots, int64_t S) {
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < slots.numel(); ++t)
    TORCH_CHECK(sp[t] >= 0 && sp[t] < S, "rope_write: slot ", sp[t], " outside the pool");
  return sp;
}

// A step's RoPE and K/V write in one pass: qkv fp32 [T, (Hq + 2 Hk) D], cos and signed sin
// [T, 1, D] (RotaryEmbedding.lookup); k rotated and v stored at slots [T] of the fp32 pools
// k, v [S, Hk, D]. Returns the rotated q [T, Hq, D].
at::Tensor rope_write(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                      at::Tensor k, at::Tensor v, const at::Tensor& slots, int64_t num_heads) {
  TORCH_CHECK(kernel_pool(k, v),
              "rope_write: pools must be contiguous fp32 or fp16 [S, Hk, D], K and V alike");
  const int64_t S = k.size(0), Hk = k.size(1), D = k.size(2), Hq = num_heads;
  TORCH_CHECK(qkv.dim() == 2 && qkv.scalar_type() == at::kFloat &&
                  qkv.size(1) == (Hq + 2 * Hk) * D && D % 16 == 0,
              "rope_write: qkv must be fp32 [T, (Hq + 2 Hk) * D], D a multiple of 16");
  const int64_t T = qkv.size(0);
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
                  cos.numel() == T * D && sin.numel() == T * D && slots.numel() == T &&
                  slots.scalar_type() == at::kLong,
              "rope_write: cos/sin fp32 [T, 1, D], slots int64 [T]");
  const auto xc = qkv.contiguous(), cc = cos.contiguous(), sc = sin.contiguous();
  const auto sl = slots.contiguous();
  auto q = at::empty({T, Hq, D}, qkv.options());
  const int64_t* sp = checked_slots(sl, S);
  const float* xp = xc.data_ptr<float>();
  const float* cp = cc.data_ptr<float>();
  const float* snp = sc.data_ptr<float>();
  float* qp = q.data_ptr<float>();
  const int64_t W = (Hq + 2 * Hk) * D;
  auto run = [&](auto* kp, auto* vp) {
#pragma omp parallel for num_threads(threads()) if (T * W >= kRowsParallel) schedule(static)
    for (int64_t t = 0; t < T; ++t)
      rope_row(xp + t * W, cp + t * D, snp + t * D, Hq, Hk, D, qp + t * Hq * D,
               kp + sp[t] * Hk * D, vp + sp[t] * Hk * D);
  };
  if (k.scalar_type() == at::kFloat)
    run(k.data_ptr<float>(), v.data_ptr<float>());
  else
    run(k.data_ptr<at::Half>(), v.data_ptr<at::Half>());
  return q;
}

// A linear of the layer as its module runs it: kiln's q4 tiles (kind -1, one part) or GGUF
// blocks through kq_linear (kquant.cpp) (kinds = GGML type ids), then the bias added.
constexpr int64_t kKindQ4 = -1;

at::Tensor layer_linear(const at::Tensor& x, at::TensorList parts, at::IntArrayRef kinds,
                        at::IntArrayRef rows, const std::optional<at::Tensor>& bias) {
  at::Tensor y;
  if (kinds.size() == 1 && kinds[0] == kKindQ4) {
    y = q4_linear(x, parts[0], rows[0]);
  } else {
    // the GGUF-block kernels (kquant.cpp, the same library): the function kiln/layers/kquant.py's
    // module calls
    y = kq_linear(x, parts, kinds, rows);
  }
  return bias.has_value() ? y + *bias : y;
}

// The attention half of the one-region layers (decode_layer_q4, moe_layer_q4), whose qkv and o
// linears are q4 tiles: x1 = x + o(attend(rope(qk_norms(qkv(rms_norm(x)))))), the step's K/V
// written to the pools; `run` is called by every thread of the caller's parallel region (the
// stages separated by the implicit barriers of their `omp for` loops). The functions and their
// order are the eager layer's (rms_row, q4 tiles with the bias, rms_row per q/k head, rope_row,
// attend_rows, the o tiles with the bias and the residual): the same bits.
template <typename KT>
struct AttnQ4 {
  const float *x, *ln1, *cos, *sin;
  const float *qn = nullptr, *kn = nullptr;  // Qwen3's q/k norm weights [D], or none
  float eps, qk_eps, scale;
  const uint8_t *wqkv, *wo;
  int64_t qkv_tiles, qkv_tile_bytes, o_tiles, o_tile_bytes;
  const float *bqkv, *bo;
  KT *k, *v;
  const int64_t *slots, *table, *row_of, *lens, *rows;
  int64_t T, H, Hq, Hk, D, L;
  float *h, *qkv, *qb, *ctx, *x1;  // workspace rows: [T, H], [T, W], [T, Hq D] x 2, [T, H]
  QRows *xh, *xc;

  void run(int nt) const {
    const int64_t W = (Hq + 2 * Hk) * D;
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; ++t) {
      rms_row(x + t * H, ln1, eps, H, h + t * H);
      xh->quantize(t, h + t * H);
    }
    q4_tiles_omp(wqkv, qkv_tile_bytes, qkv_tiles, *xh, rows, T, W, qkv, bqkv, nullptr);
    if (qn != nullptr) {
      // each q and k head of each row one rms_row, in place (qk_norm_rows' calls)
#pragma omp for schedule(static)
      for (int64_t r = 0; r < T * (Hq + Hk); ++r) {
        const int64_t t = r / (Hq + Hk), hh = r % (Hq + Hk);
        float* head = qkv + t * W + hh * D;
        rms_row(head, hh < Hq ? qn : kn, qk_eps, D, head);
      }
    }
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; ++t)
      rope_row(qkv + t * W, cos + t * D, sin + t * D, Hq, Hk, D, qb + t * Hq * D,
               k + slots[t] * Hk * D, v + slots[t] * Hk * D);
    attend_rows_omp(qb, static_cast<const KT*>(k), static_cast<const KT*>(v), table, row_of,
                    lens, ctx, T, Hq, Hk, D, D, L, scale, nt);
    quantize_rows_omp(static_cast<const float*>(ctx), T, Hq * D, *xc);
    q4_tiles_omp(wo, o_tile_bytes, o_tiles, *xc, rows, T, H, x1, bo, x);
  }
};

// The attention half's arguments, checked once for both one-region layers (`name`: the op's,
// for the messages), the contiguous copies held here while the region runs; `bind` points an
// AttnQ4 at the caller's workspace, whose first `floats()` are the half's rows.
template <typename KT>
struct AttnQ4Args {
  at::Tensor xc, cc, sc, l1, sl, qn, kn;
  RowTable rt;
  const int64_t* sp;
  const float* bias[2];
  int64_t T, H, Hq, Hk, D, W;
  std::vector<int64_t> rows;

  AttnQ4Args(const char* name, const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
             const at::Tensor& ln1, at::TensorList w, at::IntArrayRef n,
             const c10::List<std::optional<at::Tensor>>& biases,
             const std::optional<at::Tensor>& q_norm, const std::optional<at::Tensor>& k_norm,
             const at::Tensor& k, const at::Tensor& v, const at::Tensor& slots,
             const at::Tensor& table, const at::Tensor& row_of, const at::Tensor& lens,
             int64_t num_heads)
      : rt(table, row_of, lens), T(x.size(0)), H(x.size(1)), Hq(num_heads) {
    TORCH_CHECK(kernel_pool(k, v) && k.scalar_type() == c10::CppTypeToScalarType<KT>::value,
                name, ": pools must be contiguous fp32 or fp16 [S, Hk, D], K and V alike");
    Hk = k.size(1);
    D = k.size(2);
    W = (Hq + 2 * Hk) * D;
    for (int i = 0; i < 2; ++i) check_packed(name, w[i], 3);
    TORCH_CHECK(D % 16 == 0 && D <= 256 && Hq % Hk == 0 && Hq / Hk <= 16 && H % 32 == 0 &&
                    n[0] == W && w[0].size(1) * kGroup == H && n[1] == H &&
                    w[1].size(1) * kGroup == Hq * D,
                name, ": the attention's shapes do not make a layer of this x and pool");
    for (int i = 0; i < 2; ++i)
      TORCH_CHECK((w[i].size(0) - 1) * kTile < n[i] && w[i].size(0) * kTile >= n[i], name,
                  ": packed weight ", i, " does not hold ", n[i], " rows");
    TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
                    cos.numel() == T * D && sin.numel() == T * D && slots.numel() == T &&
                    slots.scalar_type() == at::kLong && ln1.numel() == H,
                name, ": cos/sin fp32 [T, 1, D], slots int64 [T], norms [H]");
    TORCH_CHECK(!q_norm.has_value() ||
                    (q_norm->numel() == D && k_norm->numel() == D &&
                     q_norm->scalar_type() == at::kFloat && k_norm->scalar_type() == at::kFloat),
                name, ": q/k norms fp32 [D]");
    for (int i = 0; i < 2; ++i) {
      const auto b = biases.get(i);
      TORCH_CHECK(!b.has_value() || (b->scalar_type() == at::kFloat && b->is_contiguous() &&
                                     b->numel() == n[i]),
                  name, ": bias ", i, " must be contiguous fp32 [", n[i], "]");
      bias[i] = b.has_value() ? b->data_ptr<float>() : nullptr;
    }
    xc = x.contiguous();
    cc = cos.contiguous();
    sc = sin.contiguous();
    l1 = ln1.contiguous();
    sl = slots.contiguous();
    if (q_norm.has_value()) {
      qn = q_norm->contiguous();
      kn = k_norm->contiguous();
    }
    sp = checked_slots(sl, k.size(0));
    TORCH_CHECK(rt.lens.numel() == T,
                "attend_rows: table [R, L] int64, row_of and lens [T] int64");
    rows.resize(T);
    for (int64_t i = 0; i < T; ++i) rows[i] = i;
  }

  // h (the normed input), qkv, q, ctx, x1: [T, H], [T, W], [T, Hq D] x 2, [T, H]
  int64_t floats() const { return T * (2 * H + W + 2 * Hq * D); }

  AttnQ4<KT> bind(float* ws, QRows& xh, QRows& xc2, double eps, double qk_eps, double scale,
                  at::TensorList w, at::Tensor& k, at::Tensor& v) const {
    xh.resize(T, H);
    xc2.resize(T, Hq * D);
    float* qkv = ws + T * H;
    float* qb = qkv + T * W;
    float* ctx = qb + T * Hq * D;
    float* x1 = ctx + T * Hq * D;
    return {xc.data_ptr<float>(), l1.data_ptr<float>(), cc.data_ptr<float>(),
            sc.data_ptr<float>(), qn.defined() ? qn.data_ptr<float>() : nullptr,
            kn.defined() ? kn.data_ptr<float>() : nullptr, static_cast<float>(eps),
            static_cast<float>(qk_eps), static_cast<float>(scale), w[0].data_ptr<uint8_t>(),
            w[1].data_ptr<uint8_t>(), w[0].size(0), w[0].size(1) * kBlockBytes, w[1].size(0),
            w[1].size(1) * kBlockBytes, bias[0], bias[1], k.data_ptr<KT>(), v.data_ptr<KT>(), sp,
            rt.table.data_ptr<int64_t>(), rt.row_of.data_ptr<int64_t>(),
            rt.lens.data_ptr<int64_t>(), rows.data(), T, H, Hq, Hk, D, rt.L, ws, qkv, qb, ctx, x1,
            &xh, &xc2};
  }
};

// Whether a layer runs in one parallel region (decode_layer_q4, moe_layer_q4): fp32 rows, the
// pools as the kernels read them, and each of its linears (one per bias) one part of kiln's q4
// tiles with an fp32 bias or none.
bool one_region_layer(const at::Tensor& x, const at::Tensor& k, const at::Tensor& v,
                      at::IntArrayRef kinds, at::IntArrayRef counts,
                      const c10::List<std::optional<at::Tensor>>& biases) {
  if (x.scalar_type() != at::kFloat || x.dim() != 2 || !kernel_pool(k, v)) return false;
  for (size_t i = 0; i < biases.size(); ++i) {
    const auto b = biases.get(i);
    if (kinds[i] != kKindQ4 || counts[i] != 1 ||
        (b.has_value() && b->scalar_type() != at::kFloat))
      return false;
  }
  return true;
}

// decode_layer when its four linears are kiln's q4 tiles and no LoRA adapter runs: the same
// kernels in the same order (so the same bits), in ONE parallel region, the stages separated by
// the implicit barriers of their `omp for` loops instead of a region, an allocation and a
// dispatch per op: a batch-1 decode step of SmolLM2 is ~270 small ops whose fixed costs (a few
// us each) were a third of the layer's time. The residual adds and biases are folded into the
// linears' tile stores (store_tile: the same adds in the same order). KT: the pool's type.
template <typename KT>
at::Tensor decode_layer_q4(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                           const at::Tensor& ln1, const at::Tensor& ln2, double eps,
                           at::TensorList w, at::IntArrayRef n,
                           const c10::List<std::optional<at::Tensor>>& biases, at::Tensor k,
                           at::Tensor v, const at::Tensor& slots, const at::Tensor& table,
                           const at::Tensor& row_of, const at::Tensor& lens, int64_t num_heads,
                           double scale) {
  const AttnQ4Args<KT> args("decode_layer", x, cos, sin, ln1, w, n, biases, std::nullopt,
                            std::nullopt, k, v, slots, table, row_of, lens, num_heads);
  const int64_t T = args.T, H = args.H, I = n[2] / 2;
  for (int i = 2; i < 4; ++i) check_packed("decode_layer", w[i], 3);
  TORCH_CHECK(n[2] % 64 == 0 && w[2].size(1) * kGroup == H && n[3] == H &&
                  w[3].size(1) * kGroup == I && ln2.numel() == H,
              "decode_layer: the MLP's shapes do not make a Llama layer of this x");
  for (int i = 2; i < 4; ++i)
    TORCH_CHECK((w[i].size(0) - 1) * kTile < n[i] && w[i].size(0) * kTile >= n[i],
                "decode_layer: packed weight ", i, " does not hold ", n[i], " rows");
  const float* bias[2];
  for (int i = 2; i < 4; ++i) {
    const auto b = biases.get(i);
    TORCH_CHECK(!b.has_value() || (b->scalar_type() == at::kFloat && b->is_contiguous() &&
                                   b->numel() == n[i]),
                "decode_layer: bias ", i, " must be contiguous fp32 [", n[i], "]");
    bias[i - 2] = b.has_value() ? b->data_ptr<float>() : nullptr;
  }
  const auto l2 = ln2.contiguous();
  at::Tensor out = at::empty({T, H}, args.xc.options());
  if (T == 0) return out;
  // The stages' rows: the attention half's (h, qkv, q, ctx, x1), then gu, a. One workspace
  // per calling thread, kept between calls: a 512-token prefill chunk's is ~16 MB, whose
  // zeroing or fresh pages per layer cost more than the layer's norms and adds (prefill 512 on
  // SmolLM2 ~8% slower with a new zeroed vector per call).
  // (thread_local: inside the parallel region below the names would be each thread's own,
  // so the region uses these references, bound here to the calling thread's)
  static thread_local std::vector<float> ws;
  static thread_local QRows tl_xh, tl_xc, tl_xa;
  QRows& xh = tl_xh;
  QRows& xa = tl_xa;
  const int64_t need = args.floats() + T * 3 * I;
  if (static_cast<int64_t>(ws.size()) < need) ws.resize(need);
  const AttnQ4<KT> attn = args.bind(ws.data(), xh, tl_xc, eps, 0.0, scale, w, k, v);
  float* h = attn.h;
  float* x1 = attn.x1;
  float* gu = ws.data() + args.floats();
  float* act = gu + T * 2 * I;
  xa.resize(T, I);
  const int64_t* rows = args.rows.data();
  float* op = out.data_ptr<float>();
  const float e = static_cast<float>(eps);
  const uint8_t* wp2 = w[2].data_ptr<uint8_t>();
  const uint8_t* wp3 = w[3].data_ptr<uint8_t>();
  const int nt = threads();
#pragma omp parallel num_threads(nt)
  {
    attn.run(nt);
    norm_rows_omp(x1, l2.data_ptr<float>(), e, T, H, h, xh);
    q4_tiles_omp(wp2, w[2].size(1) * kBlockBytes, w[2].size(0), xh, rows, T, 2 * I, gu, bias[0],
                 nullptr);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; ++t) {
      silu_row(gu + t * 2 * I, gu + t * 2 * I + I, I, act + t * I);
      xa.quantize(t, act + t * I);
    }
    q4_tiles_omp(wp3, w[3].size(1) * kBlockBytes, w[3].size(0), xa, rows, T, H, op, bias[1], x1);
  }
  return out;
}

// A router's fp32 logits x [T, H] @ w [E, H]^T, each one FMA chain over H (8 lanes, then one
// fixed reduction): a row's logits do not depend on the other rows of the step (a GEMM's
// blocking does, and a flipped top-k choice changes a token's whole MoE output).
inline float router_logit(const float* x, const float* w, int64_t H) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t i = 0; i < H; i += 8) acc = _mm256_fmadd_ps(load8(x + i), load8(w + i), acc);
  return hsum(acc);
}

at::Tensor router_logits(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1) &&
                  x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat &&
                  x.size(1) % 8 == 0,
              "router_logits: x fp32 [T, H], w fp32 [E, H], H a multiple of 8");
  const auto xc = x.contiguous(), wc = w.contiguous();
  const int64_t T = xc.size(0), H = xc.size(1), E = wc.size(0);
  auto y = at::empty({T, E}, xc.options());
  const float* xp = xc.data_ptr<float>();
  const float* wp = wc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
#pragma omp parallel for num_threads(threads()) if (T * E * H >= (1 << 16)) schedule(static)
  for (int64_t t = 0; t < T; ++t)
    for (int64_t e = 0; e < E; ++e) yp[t * E + e] = router_logit(xp + t * H, wp + e * H, H);
  return y;
}

// The q and k heads of a fused qkv [T, (Hq + 2 Hk) * D] normalized in place by rms_norm with
// the weights qn / kn [D] (Qwen3's q/k norms): the same call, on the same rows, as the eager
// attention makes (kiln/models/llama.py LlamaAttention), so both give the same bits.
void qk_norm_rows(at::Tensor& qkv, const at::Tensor& qn, const at::Tensor& kn, double eps,
                  int64_t Hq, int64_t Hk, int64_t D) {
  const int64_t T = qkv.size(0);
  auto heads = qkv.view({T, Hq + 2 * Hk, D});
  auto q = heads.narrow(1, 0, Hq), k = heads.narrow(1, Hq, Hk);
  q.copy_(rms_norm(q.reshape({T * Hq, D}), qn, eps).view({T, Hq, D}));
  k.copy_(rms_norm(k.reshape({T * Hk, D}), kn, eps).view({T, Hk, D}));
}

// One Llama decoder layer of a step:
//   x [T, H] fp32 -> x + attn + mlp, the step's K/V written at slots [T]
//   weights, kinds, rows: the four linears' parts (qkv, o, gate_up, down) in order, `counts`
//                         parts each; biases: the four biases (None: no bias)
//   table [R, L], row_of [T], lens [T]: row t attends to the first lens[t] slots of
//                         table[row_of[t]] (attend_rows' arguments)
//   lora, lora_seg: empty, or per linear (a, bt, pieces, ranks, local) (a empty: no adapters
//                         on it) and the step's row groups (lora_add's arguments)
// The ops and their order are LlamaDecoderLayer.forward's with its kernels (see above).
at::Tensor decode_layer(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                        const at::Tensor& ln1, const at::Tensor& ln2, double eps,
                        at::TensorList weights, at::IntArrayRef kinds, at::IntArrayRef rows,
                        at::IntArrayRef counts, const c10::List<std::optional<at::Tensor>>& biases,
                        at::Tensor k, at::Tensor v, const at::Tensor& slots,
                        const at::Tensor& table, const at::Tensor& row_of, const at::Tensor& lens,
                        int64_t num_heads, double scale, at::TensorList lora,
                        const std::optional<at::Tensor>& lora_seg,
                        const std::optional<at::Tensor>& q_norm,
                        const std::optional<at::Tensor>& k_norm, double qk_eps) {
  TORCH_CHECK(counts.size() == 4 && biases.size() == 4,
              "decode_layer: four linears (qkv, o, gate_up, down)");
  TORCH_CHECK(lora.empty() || (lora.size() == 20 && lora_seg.has_value()),
              "decode_layer: lora is 5 tensors per linear (a, bt, pieces, ranks, local) and a seg");
  TORCH_CHECK(weights.size() == kinds.size() && kinds.size() == rows.size(),
              "decode_layer: one kind and row count per weight part");
  int64_t off[5] = {0};
  for (int i = 0; i < 4; ++i) off[i + 1] = off[i] + counts[i];
  TORCH_CHECK(off[4] == static_cast<int64_t>(weights.size()),
              "decode_layer: counts must add up to the weight parts");
  TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "decode_layer: q and k norms together");
  if (lora.empty() && !q_norm.has_value() && weights.size() == 4 &&
      one_region_layer(x, k, v, kinds, counts, biases)) {
    const auto layer_q4 = k.scalar_type() == at::kFloat ? &decode_layer_q4<float>
                                                        : &decode_layer_q4<at::Half>;
    return layer_q4(x, cos, sin, ln1, ln2, eps, weights, rows, biases, k, v, slots, table,
                    row_of, lens, num_heads, scale);
  }
  auto lin = [&](int i, const at::Tensor& h) {
    const int64_t a = off[i], n = counts[i];
    auto y = layer_linear(h, weights.slice(a, n), kinds.slice(a, n), rows.slice(a, n),
                          biases.get(i));
    // the linear's LoRA adapters, added to its output as the module's forward hook does
    // (kiln/engine/lora.py): same call, same place, so adapter rows get the eager bits
    if (!lora.empty() && lora[5 * i].numel() > 0)
      lora_add(y, h, lora[5 * i], lora[5 * i + 1], lora[5 * i + 2], lora[5 * i + 3], *lora_seg,
               lora[5 * i + 4]);
    return y;
  };
  const int64_t B = x.size(0);
  auto qkv = lin(0, rms_norm(x, ln1, eps));
  if (q_norm.has_value())
    qk_norm_rows(qkv, *q_norm, *k_norm, qk_eps, num_heads, k.size(1), k.size(2));
  const auto q = rope_write(qkv, cos, sin, k, v, slots, num_heads);
  const auto ctx = attend_rows(q, k, v, table, row_of, lens, scale);
  const auto x1 = x + lin(1, ctx.view({B, -1}));
  return x1 + lin(3, silu_mul_rows(lin(2, rms_norm(x1, ln2, eps))));
}

// A token's moe_q4 pairs: its top-k (ids [T, k], weights), then, with `shared` virtual experts
// (a shared expert absorbed after the E routed: kiln/layers/moe.py Experts.absorb_shared), the
// pairs (t, E + c) weighted sigmoid(logits[t, E]) (a gated shared expert: Qwen2-MoE) or 1;
// the same ATen ops as moe.py's with_shared_pairs, so the same bits.
std::pair<at::Tensor, at::Tensor> shared_pairs(const at::Tensor& ids, const at::Tensor& w,
                                               const at::Tensor& logits, int64_t E,
                                               int64_t shared, bool gate) {
  if (shared == 0) return {ids.contiguous(), w.contiguous()};
  const int64_t T = ids.size(0);
  const auto sid = at::arange(E, E + shared, ids.options()).expand({T, shared});
  const auto sw = (gate ? at::sigmoid(logits.slice(1, E, E + 1)).to(at::kFloat)
                        : at::ones({T, 1}, w.options().dtype(at::kFloat)))
                      .expand({T, shared});
  return {at::cat({ids, sid}, 1).contiguous(), at::cat({w.to(at::kFloat), sw}, 1).contiguous()};
}

// moe_layer where both attention linears are kiln's q4 tiles (a Q4_0 / int4 model) and the
// pools fp32 or fp16: the whole layer in one parallel region, as decode_layer_q4 does for a
// dense layer. The same row functions in the same order as moe_layer's op by op chain (rms_row,
// q4 tiles, rms_row per q/k head, rope_row, attend_rows, router_logit, at::softmax / topk /
// the renormalizing division, moe_q4_omp), so the same bits; what goes is a parallel region,
// a fork and a join and a tensor per op: ~12 of them a layer, ~5 us each at one row.
template <typename KT>
std::tuple<at::Tensor, at::Tensor> moe_layer_q4(
    const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& ln1,
    const at::Tensor& ln2, double eps, at::TensorList w, at::IntArrayRef n,
    const c10::List<std::optional<at::Tensor>>& biases, const std::optional<at::Tensor>& q_norm,
    const std::optional<at::Tensor>& k_norm, double qk_eps, at::Tensor k, at::Tensor v,
    const at::Tensor& slots, const at::Tensor& table, const at::Tensor& row_of,
    const at::Tensor& lens, int64_t num_heads, double scale, const at::Tensor& router,
    int64_t top_k, bool renormalize, const at::Tensor& w13, const at::Tensor& w2,
    int64_t shared, bool shared_gate) {
  const AttnQ4Args<KT> args("moe_layer", x, cos, sin, ln1, w, n, biases, q_norm, k_norm, k, v,
                            slots, table, row_of, lens, num_heads);
  const int64_t T = args.T, H = args.H;
  // w13 / w2: E routed experts, then `shared` virtual ones (a shared expert absorbed, see
  // shared_pairs); the router's rows: the E routed, then the shared gate's (shared_gate)
  const int64_t EA = w13.size(0), E = EA - shared, R = E + (shared_gate ? 1 : 0);
  const int64_t I = w13.size(1) * kTile / 2, K = top_k + shared;  // K: pairs a token
  check_packed("moe_layer (w13)", w13, 4);
  check_packed("moe_layer (w2)", w2, 4);
  TORCH_CHECK(w13.size(2) * kGroup == H && w2.size(0) == EA && w2.size(1) * kTile == H &&
                  w2.size(2) * kGroup == I && I % kTile == 0 && router.dim() == 2 &&
                  router.size(0) == R && router.size(1) == H && shared >= 0 && E > 0 &&
                  (shared > 0 || !shared_gate) &&
                  router.scalar_type() == at::kFloat && ln2.numel() == H,
              "moe_layer: the experts' and router's shapes do not make a MoE layer of this x");
  const auto l2 = ln2.contiguous();
  const auto rc = router.contiguous();
  at::Tensor out = at::empty({T, H}, args.xc.options());
  at::Tensor logits = at::empty({T, R}, args.xc.options());
  at::Tensor ids = at::empty({T, top_k}, args.xc.options().dtype(at::kLong));
  if (T == 0) return {out, ids};  // (else: topk's, below)
  // (one workspace per calling thread, kept between calls: see decode_layer_q4)
  static thread_local std::vector<float> ws;
  static thread_local QRows tl_xh, tl_xc, tl_xs, tl_hs;
  QRows& xs = tl_xs;
  QRows& hs = tl_hs;
  const int64_t need = args.floats() + T * H + T * K * (I + H);
  if (static_cast<int64_t>(ws.size()) < need) ws.resize(need);
  const AttnQ4<KT> attn = args.bind(ws.data(), tl_xh, tl_xc, eps, qk_eps, scale, w, k, v);
  float* x1 = attn.x1;
  float* h2 = ws.data() + args.floats();
  float* eh = h2 + T * H;          // the experts' [pairs, I]
  float* eo = eh + T * K * I;      // and [pairs, H]
  xs.resize(T, H);
  const float* rp = rc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  float* lp = logits.data_ptr<float>();
  const float e = static_cast<float>(eps);
  const MoeWeights mw(w13, w2);
  const int nt = threads();
  MoePlan pl;
  std::exception_ptr error;
#pragma omp parallel num_threads(nt)
  {
    attn.run(nt);
    norm_rows_omp(x1, l2.data_ptr<float>(), e, T, H, h2, xs);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < T * R; ++r)
      lp[r] = router_logit(h2 + (r / R) * H, rp + (r % R) * H, H);
    // kiln/layers/moe.py's softmax_topk, the same ATen ops (serial here: inside a region), on
    // the calling thread: ATen's thread-local state (inference mode) is that thread's. An
    // exception must not leave the region (std::terminate): it is rethrown after.
#pragma omp master
    {
      try {
        const at::Tensor probs = at::softmax(shared ? logits.slice(1, 0, E) : logits, -1);
        auto [wt, id] = at::topk(probs, top_k, -1);
        if (renormalize) wt = wt / wt.sum(-1, /*keepdim=*/true);
        ids = id.contiguous();
        auto [pi, pw] = shared_pairs(ids, wt, logits, E, shared, shared_gate);
        pl = moe_plan(pi.data_ptr<int64_t>(), pw.data_ptr<float>(), T, K, EA, I / kTile,
                      H / kTile, omp_get_num_threads());
        hs.resize(pl.Pv, I);
      } catch (...) {
        error = std::current_exception();
      }
    }
#pragma omp barrier
    if (!error) moe_q4_omp(pl, mw, xs, eh, hs, eo, op, x1, omp_get_thread_num());
  }
  if (error) std::rethrow_exception(error);
  return {out, ids};
}

// A mixture-of-experts decoder layer of any step in one call (Qwen2/3-MoE without a shared
// expert, Mixtral): what the layer's eager forward runs, op for op (rms_norm, the qkv linear,
// the q/k norms, rope_write, attend_rows, the o linear, the residual, rms_norm, the router's
// fp32 logits, softmax + top-k (+ renormalized), moe_q4, the residual), without ~40 Python
// calls a layer. Returns (x out [T, H], ids [T, k]: the routing, for the experts' counters).
std::tuple<at::Tensor, at::Tensor> moe_layer(
    const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& ln1,
    const at::Tensor& ln2, double eps, at::TensorList weights, at::IntArrayRef kinds,
    at::IntArrayRef rows, at::IntArrayRef counts,
    const c10::List<std::optional<at::Tensor>>& biases, const std::optional<at::Tensor>& q_norm,
    const std::optional<at::Tensor>& k_norm, double qk_eps, at::Tensor k, at::Tensor v,
    const at::Tensor& slots, const at::Tensor& table, const at::Tensor& row_of,
    const at::Tensor& lens, int64_t num_heads, double scale, const at::Tensor& router,
    int64_t top_k, bool renormalize, const at::Tensor& w13, const at::Tensor& w2,
    int64_t shared, bool shared_gate) {
  TORCH_CHECK(counts.size() == 2 && biases.size() == 2,
              "moe_layer: two linears (qkv, o)");
  TORCH_CHECK(weights.size() == kinds.size() && kinds.size() == rows.size() &&
                  counts[0] + counts[1] == static_cast<int64_t>(weights.size()),
              "moe_layer: one kind and row count per weight part, counts adding up to them");
  TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "moe_layer: q and k norms together");
  if (weights.size() == 2 && w13.scalar_type() == at::kByte &&
      one_region_layer(x, k, v, kinds, counts, biases)) {
    const auto layer = k.scalar_type() == at::kFloat ? &moe_layer_q4<float>
                                                     : &moe_layer_q4<at::Half>;
    return layer(x, cos, sin, ln1, ln2, eps, weights, rows, biases, q_norm, k_norm, qk_eps, k,
                 v, slots, table, row_of, lens, num_heads, scale, router, top_k, renormalize,
                 w13, w2, shared, shared_gate);
  }
  auto lin = [&](int i, const at::Tensor& h) {
    const int64_t a = i == 0 ? 0 : counts[0], n = counts[i];
    return layer_linear(h, weights.slice(a, n), kinds.slice(a, n), rows.slice(a, n),
                        biases.get(i));
  };
  const int64_t B = x.size(0), Hk = k.size(1), D = k.size(2);
  auto qkv = lin(0, rms_norm(x, ln1, eps));
  if (q_norm.has_value()) qk_norm_rows(qkv, *q_norm, *k_norm, qk_eps, num_heads, Hk, D);
  const auto q = rope_write(qkv, cos, sin, k, v, slots, num_heads);
  const auto ctx = attend_rows(q, k, v, table, row_of, lens, scale);
  const auto x1 = x + lin(1, ctx.view({B, -1}));
  const auto h = rms_norm(x1, ln2, eps);
  // kiln/layers/moe.py: Router (router_logits) then softmax_topk, the same ops
  const int64_t E = w13.size(0) - shared;
  const auto logits = router_logits(h, router);
  const auto probs = at::softmax(shared ? logits.slice(1, 0, E) : logits, -1);
  auto [w, ids] = at::topk(probs, top_k, -1);
  if (renormalize) w = w / w.sum(-1, /*keepdim=*/true);
  auto [pi, pw] = shared_pairs(ids, w, logits, E, shared, shared_gate);
  return {x1 + moe_q4(h, pi, pw, w13, w2, 0), ids};
}

// A model's decoder layers as the layer kernels take them, gathered once (LlamaModel's
// `_layer_stack`): decode_stack then runs a whole step's layers in one call. Why: passing
// decode_layer's 21 arguments (lists of weights, kinds, biases...) from Python costs ~15 us a
// call, 30 calls a SmolLM2 step, more than its norms, RoPE and attention together; a MoE layer
// (moe_layer's 27 arguments, then the routing counters) cost ~75 us a layer in Python, 1.8 ms of
// a 14 ms step of the MoE benchmark model. A layer is dense (`add`: decode_layer's arguments) or
// a sparse MoE block (`add_moe`: moe_layer's, and the layer's routing counters `routed` [E]
// int64, which each step's ids are added to, as Experts.count does). Empty tensors stand for
// None (a list of Tensors cannot hold None): biases, q/k norms. The pools k, v are the layers'
// own (KVStore's), written in place by every step.
struct LayerStack : torch::CustomClassHolder {
  struct Layer {
    at::Tensor ln1, ln2, k, v;
    double eps, scale;
    std::vector<at::Tensor> weights;
    std::vector<int64_t> kinds, rows, counts;
    c10::List<std::optional<at::Tensor>> biases;
    int64_t num_heads;
    std::optional<at::Tensor> q_norm, k_norm;
    double qk_eps;
    // a sparse MoE block where `router` is defined
    at::Tensor router, w13, w2, routed;
    int64_t top_k = 0, shared = 0;
    bool renormalize = false, shared_gate = false;
  };
  std::vector<Layer> layers;

  static std::optional<at::Tensor> maybe(const at::Tensor& t) {
    return t.numel() > 0 ? std::optional<at::Tensor>(t) : std::nullopt;
  }
  static Layer make(at::Tensor ln1, at::Tensor ln2, double eps, std::vector<at::Tensor> weights,
                    std::vector<int64_t> kinds, std::vector<int64_t> rows,
                    std::vector<int64_t> counts, const std::vector<at::Tensor>& biases,
                    at::Tensor k, at::Tensor v, int64_t num_heads, double scale,
                    const at::Tensor& q_norm, const at::Tensor& k_norm, double qk_eps) {
    TORCH_CHECK((q_norm.numel() > 0) == (k_norm.numel() > 0),
                "LayerStack: q and k norms together");
    c10::List<std::optional<at::Tensor>> b;
    for (const auto& t : biases) b.push_back(maybe(t));
    return {std::move(ln1), std::move(ln2), std::move(k), std::move(v), eps, scale,
            std::move(weights), std::move(kinds), std::move(rows), std::move(counts),
            std::move(b), num_heads, maybe(q_norm), maybe(k_norm), qk_eps};
  }
  void add(at::Tensor ln1, at::Tensor ln2, double eps, std::vector<at::Tensor> weights,
           std::vector<int64_t> kinds, std::vector<int64_t> rows, std::vector<int64_t> counts,
           std::vector<at::Tensor> biases, at::Tensor k, at::Tensor v, int64_t num_heads,
           double scale, at::Tensor q_norm, at::Tensor k_norm, double qk_eps) {
    TORCH_CHECK(biases.size() == 4, "LayerStack.add: four biases (empty: none)");
    layers.push_back(make(std::move(ln1), std::move(ln2), eps, std::move(weights),
                          std::move(kinds), std::move(rows), std::move(counts), biases,
                          std::move(k), std::move(v), num_heads, scale, q_norm, k_norm, qk_eps));
  }
  void add_moe(at::Tensor ln1, at::Tensor ln2, double eps, std::vector<at::Tensor> weights,
               std::vector<int64_t> kinds, std::vector<int64_t> rows,
               std::vector<int64_t> counts, std::vector<at::Tensor> biases, at::Tensor k,
               at::Tensor v, int64_t num_heads, double scale, at::Tensor q_norm,
               at::Tensor k_norm, double qk_eps, at::Tensor router, int64_t top_k,
               bool renormalize, at::Tensor w13, at::Tensor w2, at::Tensor routed,
               int64_t shared, bool shared_gate) {
    TORCH_CHECK(biases.size() == 2, "LayerStack.add_moe: two biases (qkv, o; empty: none)");
    TORCH_CHECK(routed.dim() == 1 && routed.scalar_type() == at::kLong &&
                    routed.is_contiguous() && routed.size(0) == w13.size(0) - shared,
                "LayerStack.add_moe: routed is the layer's int64 counters [E]");
    Layer l = make(std::move(ln1), std::move(ln2), eps, std::move(weights), std::move(kinds),
                   std::move(rows), std::move(counts), biases, std::move(k), std::move(v),
                   num_heads, scale, q_norm, k_norm, qk_eps);
    l.router = std::move(router);
    l.top_k = top_k;
    l.renormalize = renormalize;
    l.w13 = std::move(w13);
    l.w2 = std::move(w2);
    l.routed = std::move(routed);
    l.shared = shared;
    l.shared_gate = shared_gate;
    layers.push_back(std::move(l));
  }
  int64_t size() const { return static_cast<int64_t>(layers.size()); }
};

// Every layer of `stack` on x [T, H] in order: decode_layer's / moe_layer's arguments per
// layer, one step's (cos, sin, slots, table, row_of, lens) shared; no LoRA (a step with adapter
// rows runs layer by layer). Eager only: the schema does not declare the pools' and counters'
// writes.
at::Tensor decode_stack(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                        const c10::intrusive_ptr<LayerStack>& stack, const at::Tensor& slots,
                        const at::Tensor& table, const at::Tensor& row_of,
                        const at::Tensor& lens) {
  at::Tensor h = x;
  for (auto& l : stack->layers) {
    if (!l.router.defined()) {
      h = decode_layer(h, cos, sin, l.ln1, l.ln2, l.eps, l.weights, l.kinds, l.rows, l.counts,
                       l.biases, l.k, l.v, slots, table, row_of, lens, l.num_heads, l.scale, {},
                       std::nullopt, l.q_norm, l.k_norm, l.qk_eps);
      continue;
    }
    auto [y, ids] = moe_layer(h, cos, sin, l.ln1, l.ln2, l.eps, l.weights, l.kinds, l.rows,
                              l.counts, l.biases, l.q_norm, l.k_norm, l.qk_eps, l.k, l.v, slots,
                              table, row_of, lens, l.num_heads, l.scale, l.router, l.top_k,
                              l.renormalize, l.w13, l.w2, l.shared, l.shared_gate);
    const int64_t* ip = ids.data_ptr<int64_t>();
    int64_t* cp = l.routed.data_ptr<int64_t>();
    for (int64_t i = 0; i < ids.numel(); ++i) ++cp[ip[i]];
    h = y;
  }
  return h;
}

}  // namespace

KILN_LIBRARY(m) {
  m.def("isa() -> str");
  m.def("q4_linear(Tensor x, Tensor packed, int n) -> Tensor");
  m.def("moe_q4(Tensor x, Tensor ids, Tensor weights, Tensor w13, Tensor w2, int threads=0) "
        "-> Tensor");
  m.def("attend_rows(Tensor q, Tensor k, Tensor v, Tensor table, Tensor row_of, Tensor lens, "
        "float scale) -> Tensor");
  m.def("q8_linear(Tensor x, Tensor w, Tensor scale) -> Tensor");
  m.def("heads_q4(Tensor x, Tensor w, int n) -> Tensor");
  m.def("pack_q4_blocks(Tensor raw, int block_bytes, Tensor(a!) out) -> ()");
  m.def("lora_add(Tensor(a!) out, Tensor x, Tensor a, Tensor bt, Tensor pieces, Tensor ranks, "
        "Tensor seg, Tensor local) -> ()");
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  m.def("silu_mul(Tensor gu) -> Tensor");
  m.def("rope_write(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) k, Tensor(b!) v, Tensor slots, "
        "int num_heads) -> Tensor");
  m.def("decode_layer(Tensor x, Tensor cos, Tensor sin, Tensor ln1, Tensor ln2, float eps, "
        "Tensor[] weights, int[] kinds, int[] rows, int[] counts, Tensor?[] biases, Tensor(a!) k, "
        "Tensor(b!) v, Tensor slots, Tensor table, Tensor row_of, Tensor lens, int num_heads, "
        "float scale, Tensor[] lora, Tensor? lora_seg, Tensor? q_norm=None, "
        "Tensor? k_norm=None, float qk_eps=0.0) -> Tensor");
  m.def("router_logits(Tensor x, Tensor w) -> Tensor");
  m.def("moe_layer(Tensor x, Tensor cos, Tensor sin, Tensor ln1, Tensor ln2, float eps, "
        "Tensor[] weights, int[] kinds, int[] rows, int[] counts, Tensor?[] biases, "
        "Tensor? q_norm, Tensor? k_norm, float qk_eps, Tensor(a!) k, Tensor(b!) v, Tensor slots, "
        "Tensor table, Tensor row_of, Tensor lens, int num_heads, float scale, Tensor router, "
        "int top_k, bool renormalize, Tensor w13, Tensor w2, int shared=0, "
        "bool shared_gate=False) -> (Tensor, Tensor)");
  m.class_<LayerStack>("LayerStack")
      .def(torch::init<>())
      .def("add", &LayerStack::add)
      .def("add_moe", &LayerStack::add_moe)
      .def("size", &LayerStack::size);
  m.def("decode_stack(Tensor x, Tensor cos, Tensor sin, "
        "__torch__.torch.classes." KILN_STR(KILN_NS) ".LayerStack stack, Tensor slots, Tensor table, "
        "Tensor row_of, Tensor lens) -> Tensor");
  m.impl("isa", [] { return std::string(compiled_isa()); });
  m.impl("decode_stack", c10::DispatchKey::CPU, &decode_stack);
  m.impl("rms_norm", c10::DispatchKey::CPU, &rms_norm);
  m.impl("silu_mul", c10::DispatchKey::CPU, &silu_mul_rows);
  m.impl("rope_write", c10::DispatchKey::CPU, &rope_write);
  m.impl("decode_layer", c10::DispatchKey::CPU, &decode_layer);
  m.impl("moe_layer", c10::DispatchKey::CPU, &moe_layer);
  m.impl("router_logits", c10::DispatchKey::CPU, &router_logits);
  m.impl("lora_add", c10::DispatchKey::CPU, &lora_add);
  m.impl("q4_linear", c10::DispatchKey::CPU, &q4_linear);
  m.impl("moe_q4", c10::DispatchKey::CPU, &moe_q4);
  m.impl("attend_rows", c10::DispatchKey::CPU, &attend_rows);
  m.impl("q8_linear", c10::DispatchKey::CPU, &q8_linear);
  m.impl("heads_q4", c10::DispatchKey::CPU, &heads_q4);
  m.impl("pack_q4_blocks", c10::DispatchKey::CPU, &pack_q4_blocks);
}

}  // namespace KILN_NS
