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
// (decode_layer runs it after a linear with adapters; ops.cpp registers it.)

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "ops.h"

namespace KILN_NS {
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

}  // namespace

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

}  // namespace KILN_NS
