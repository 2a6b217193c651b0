// The routing every MoE layer runs (route_row), and moe_q4's compute: all the active experts
// of one MoE layer in one call, on the int4 tiles
// (q4_tiles.cpp). moe_plan sorts the step's (token, expert) pairs by expert and splits the work
// items between the threads; moe_q4_omp runs them (gate and up, silu, down, each token's sum).
// The op (moe_q4) is ops.cpp's, the one-region MoE layer (moe_layer_q4) layers.cpp's. Compute
// only: no ATen here (kernels.h says why).

#include <c10/util/Exception.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "kernels.h"

namespace KILN_NS {
namespace {

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

// The `n` largest of s[0..E) among the allowed (`keep`, null: all), the larger first, ties to
// the lower index: their indices into `out`.
void top_n(const float* s, const uint8_t* keep, int64_t E, int64_t n, int64_t* out) {
  std::vector<int64_t> idx;
  idx.reserve(E);
  for (int64_t e = 0; e < E; ++e)
    if (keep == nullptr || keep[e]) idx.push_back(e);
  std::partial_sort(idx.begin(), idx.begin() + n, idx.end(), [&](int64_t a, int64_t b) {
    return s[a] > s[b] || (s[a] == s[b] && a < b);
  });
  std::copy(idx.begin(), idx.begin() + n, out);
}

}  // namespace

// Why here and not ATen's softmax / topk: at one row those were ~20 us of serial ops a MoE
// layer while the other threads waited at the region's barrier (Qwen3-MoE benchmark model,
// 24 layers, Zen 3: ~3% of a batch-1 step); a row's 64 logits take well under a microsecond.
void route_row(const RouteRule& r, const float* logit, int64_t* ids, float* w) {
  const int64_t E = r.E, k = r.top_k;
  thread_local std::vector<float> s, choice;
  s.resize(E);
  if (r.sigmoid) {
    for (int64_t e = 0; e < E; ++e) s[e] = 1.0f / (1.0f + std::exp(-logit[e]));
  } else {
    const float m = *std::max_element(logit, logit + E);
    float sum = 0;
    for (int64_t e = 0; e < E; ++e) sum += (s[e] = std::exp(logit[e] - m));
    for (int64_t e = 0; e < E; ++e) s[e] /= sum;
  }
  const float* sel = s.data();  // what the choice ranks: the scores, or shifted by the bias
  if (r.bias != nullptr) {
    choice.resize(E);
    for (int64_t e = 0; e < E; ++e) choice[e] = s[e] + r.bias[e];
    sel = choice.data();
  }
  std::vector<uint8_t> keep;
  if (r.method != kGreedy && r.n_group > 1) {
    const int64_t G = r.n_group, per = E / G;
    std::vector<float> gs(G);
    for (int64_t g = 0; g < G; ++g) {
      const float* c = sel + g * per;
      if (r.method == kNoauxTc) {
        int64_t two[2];
        top_n(c, nullptr, per, std::min<int64_t>(2, per), two);
        gs[g] = c[two[0]] + (per > 1 ? c[two[1]] : 0.0f);
      } else {
        gs[g] = *std::max_element(c, c + per);
      }
    }
    std::vector<int64_t> best(r.topk_group);
    top_n(gs.data(), nullptr, G, r.topk_group, best.data());
    keep.assign(E, 0);
    for (int64_t g : best) std::fill(keep.begin() + g * per, keep.begin() + (g + 1) * per, 1);
  }
  top_n(sel, keep.empty() ? nullptr : keep.data(), E, k, ids);
  float sum = 0;
  for (int64_t j = 0; j < k; ++j) sum += (w[j] = s[ids[j]]);
  for (int64_t j = 0; j < k; ++j) w[j] = (r.renormalize ? w[j] / (sum + 1e-20f) : w[j]) * r.scale;
  for (int64_t c = 0; c < r.shared; ++c) {
    ids[k + c] = E + c;
    w[k + c] = 1.0f;
  }
}

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
  const int64_t u1 = moe_units(it1, pl.per), u2 = moe_units(it2, pl.per);
  pl.split1 = split_items(pl.active, pl.offsets, u1, nt);
  pl.split2 = split_items(pl.active, pl.offsets, u2, nt);
  pl.same_experts = true;
  for (int t = 0; t <= nt; ++t)
    pl.same_experts &= pl.split1[t] % u1 == 0 && pl.split2[t] % u2 == 0 &&
                       pl.split1[t] / u1 == pl.split2[t] / u2;
  return pl;
}

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
  // A phase's work items: this thread's ranges of `split` (items are expert-major; each thread
  // takes one contiguous range of them, so it streams its experts' weights front to back),
  // `units` items an expert over its `tiles` tiles, each expert's sorted rows in chunks:
  // body(the expert's weights w + e * expert_bytes, first tile j0, tiles nj, rows r0, nr).
  auto for_items = [&](const std::vector<int64_t>& split, int64_t units, int64_t tiles,
                       const uint8_t* w, int64_t expert_bytes, auto&& body) {
    for (int r = tid; r < nr_ranges; r += team)
      for (int64_t item = split[r]; item < split[r + 1]; ++item) {
        const int64_t e = pl.active[item / units], j0 = item % units * per;
        const int64_t nj = std::min(per, tiles - j0);
        const uint8_t* we = w + e * expert_bytes;
        for (int64_t r0 = pl.offsets[e]; r0 < pl.offsets[e + 1]; r0 += kRowChunk)
          body(we, j0, nj, r0, std::min(kRowChunk, pl.offsets[e + 1] - r0));
      }
  };
  // Phase 1: gate/up (split1).
  for_items(pl.split1, u1, it1, mw.w13, mw.w13_expert, [&](const uint8_t* we, int64_t j0,
                                                           int64_t nj, int64_t r0, int64_t nr) {
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
        return;
      }
#endif
      for (int64_t j = j0; j < j0 + nj; ++j) {
        const uint8_t *wg = we + j * mw.w13_tile, *wu = we + (it1 + j) * mw.w13_tile;
        if (nr == 1) {  // the gate and up tiles in lockstep: two weight streams (tile_pair)
          tile_pair(wg, wu, mw.w13_tile, xs, rows[0], rows[0], g[0], u[0]);
        } else {
          tile_rows(wg, mw.w13_tile, xs, rows, nr, g, mw.w13_tile);
          tile_rows(wu, mw.w13_tile, xs, rows, nr, u, mw.w13_tile);
        }
        for (int64_t m = 0; m < nr; ++m)
          _mm256_storeu_ps(h + (r0 + m) * I + j * kTile, silu_mul(g[m], u[m]));
      }
  });
  if (pl.same_experts) {
    // Each thread's phase 2 reads only the rows its own phase 1 wrote (the plan's ranges
    // start at the same experts in both phases): it quantizes them and goes on, with no
    // barrier (at one token the split is by whole experts, 4 of 8 a thread). A barrier only
    // where a thread reads another's rows: one wait fewer a layer for a thread a neighbour
    // holds up. Speed: not measurably changed (Qwen3-MoE-shaped model, Zen 3, c=1: ~3% of both
    // threads' time had been spent at this barrier; those waits moved to the one after the
    // down tiles: a thread slow in one phase is slow in the next).
    for (int r = tid; r < nr_ranges; r += team) {
      const int64_t a0 = pl.split1[r] / u1, a1 = pl.split1[r + 1] / u1;
      if (a0 == a1) continue;
      for (int64_t row = pl.offsets[pl.active[a0]]; row < pl.offsets[pl.active[a1 - 1] + 1];
           ++row)
        hs.quantize(row, h + row * I);
    }
  } else {
#pragma omp barrier
    quantize_rows_omp(h, pl.Pv, I, hs);
  }
  // Phase 2: down, scaled by each pair's routing weight (split2).
  if (pl.T == 1 && per == 1) {
    // One token (one row an expert): each range's items as two halves in lockstep (tile_pair:
    // two weight streams a thread, as q4_tiles_omp runs a one-row linear)
    auto down_put = [&](int64_t item, __m256 v) {
      const int64_t r0 = pl.offsets[pl.active[item / u2]];
      _mm256_storeu_ps(o + r0 * H + item % u2 * kTile,
                       _mm256_mul_ps(v, _mm256_set1_ps(pl.weight_of[r0])));
    };
    auto wt = [&](int64_t item) {
      return mw.w2 + pl.active[item / u2] * mw.w2_expert + item % u2 * mw.w2_tile;
    };
    auto row = [&](int64_t item) { return pl.pair_rows[pl.offsets[pl.active[item / u2]]]; };
    for (int r = tid; r < nr_ranges; r += team)
      in_two_halves(pl.split2[r], pl.split2[r + 1] - pl.split2[r], [&](int64_t ia, int64_t ib) {
        __m256 oa, ob;
        tile_pair(wt(ia), wt(ib), mw.w2_tile, hs, row(ia), row(ib), oa, ob);
        down_put(ia, oa);
        down_put(ib, ob);
      }, [&](int64_t item) {
        const int64_t pr = row(item);
        tile_rows(wt(item), mw.w2_tile, hs, &pr, 1, g, 0);
        down_put(item, g[0]);
      });
  } else {
    for_items(pl.split2, u2, it2, mw.w2, mw.w2_expert, [&](const uint8_t* we, int64_t j0,
                                                           int64_t nj, int64_t r0, int64_t nr) {
        const int64_t* pr = pl.pair_rows.data() + r0;
#if KILN_VNNI
        if (nj == 2 && nr >= kMaxBlockRows) {
          const int64_t st = mw.w2_tile;
          tile_rows<2>(we + j0 * st, st, hs, pr, nr, g2, 2 * st);
          for (int64_t m = 0; m < nr; ++m) {
            const __m512 v = _mm512_mul_ps(g2[m], _mm512_set1_ps(pl.weight_of[r0 + m]));
            _mm512_storeu_ps(o + (r0 + m) * H + j0 * kTile, v);
          }
          return;
        }
#endif
        for (int64_t j = j0; j < j0 + nj; ++j) {
          tile_rows(we + j * mw.w2_tile, mw.w2_tile, hs, pr, nr, g, mw.w2_tile);
          for (int64_t m = 0; m < nr; ++m)
            _mm256_storeu_ps(o + (r0 + m) * H + j * kTile,
                             _mm256_mul_ps(g[m], _mm256_set1_ps(pl.weight_of[r0 + m])));
        }
    });
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

}  // namespace KILN_NS
