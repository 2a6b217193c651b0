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
//
// Also the int8 head (q8_linear_impl), which runs score4 on weight rows. The ops (attend_rows,
// q8_linear) are ops.cpp's. Compute only: no ATen here (kernels.h says why).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kernels.h"

namespace KILN_NS {
namespace {

constexpr int64_t kMaxGroup = 16;      // query heads of one KV head per work item, at most
constexpr int kScoreKeys = 4;     // keys per score kernel call
constexpr int64_t kAttnAhead = 8;  // keys between a key row's prefetch and its use
constexpr int kHeadChunk = 3;     // query heads per score / PV kernel call (12 accumulators)

// The size of chunk c of `ng` query heads cut into as few chunks of at most kHeadChunk as can
// be, as equal as can be (4 heads: 2 + 2, 7: 3 + 2 + 2): a chunk of one head converts each
// fp16 key and value for 4 FMAs where one of two does for 8 (MoE benchmark model, 4 heads a
// KV head: 3 + 1 was ~20% slower in the score and PV loops). Chunks only group independent
// chains: no number moves.
inline int head_chunk(int64_t ng, int64_t c) {
  const int64_t n = (ng + kHeadChunk - 1) / kHeadChunk;
  return static_cast<int>(ng / n + (c < ng % n ? 1 : 0));
}
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

}  // namespace


// The body, run by every thread of an enclosing parallel region of `nt` threads (an orphaned
// `omp for`, implicit barrier at its end); attend_rows_impl opens the region.
template <typename T>
void attend_rows_omp(const float* q, const T* k, const T* v, const int64_t* table,
                     const int64_t* row_of, const int64_t* lens, float* out, int64_t Tn,
                     int64_t Hq, int64_t Hk, int64_t D, int64_t Dv, int64_t L, float scale,
                     int nt, int64_t vrow) {
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
        int nq = 0;
        for (int64_t h = 0, c = 0; h < ng; h += nq, ++c) {
          nq = head_chunk(ng, c);
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
        int nq = 0;
        for (int64_t h = 0, c = 0; h < ng; h += nq, ++c) {
          nq = head_chunk(ng, c);
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

template void attend_rows_omp<float>(const float*, const float*, const float*, const int64_t*,
                                     const int64_t*, const int64_t*, float*, int64_t, int64_t,
                                     int64_t, int64_t, int64_t, int64_t, float, int, int64_t);
template void attend_rows_omp<c10::Half>(const float*, const c10::Half*, const c10::Half*,
                                         const int64_t*, const int64_t*, const int64_t*, float*,
                                         int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                                         float, int, int64_t);
template void attend_rows_impl<float>(const float*, const float*, const float*, const int64_t*,
                                      const int64_t*, const int64_t*, float*, int64_t, int64_t,
                                      int64_t, int64_t, int64_t, int64_t, float, int64_t);
template void attend_rows_impl<c10::Half>(const float*, const c10::Half*, const c10::Half*,
                                          const int64_t*, const int64_t*, const int64_t*, float*,
                                          int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                                          float, int64_t);
template void attend_rows_impl<c10::BFloat16>(const float*, const c10::BFloat16*,
                                              const c10::BFloat16*, const int64_t*,
                                              const int64_t*, const int64_t*, float*, int64_t,
                                              int64_t, int64_t, int64_t, int64_t, int64_t, float,
                                              int64_t);
template void q8_linear_impl<float>(const float*, const int8_t*, const float*, float*, int64_t,
                                    int64_t, int64_t);
template void q8_linear_impl<c10::BFloat16>(const float*, const int8_t*, const c10::BFloat16*,
                                            float*, int64_t, int64_t, int64_t);

}  // namespace KILN_NS
