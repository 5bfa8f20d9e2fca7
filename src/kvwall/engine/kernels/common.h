// The kernels' shared prelude: includes, the SIMD vector type, and the multiply-accumulate loops.
#pragma once
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <algorithm>
#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif
#include <cmath>
#include <limits>
#include <numeric>
#include <tuple>
#include <vector>

using Vec = at::vec::Vectorized<float>;
constexpr int64_t W = Vec::size();

inline float hsum(const Vec &v) {  // the sum of a vector's lanes
#if defined(__AVX512F__)
  if constexpr (W == 16) return _mm512_reduce_add_ps(v);
#endif
  float lanes[W];
  v.store(lanes);
  for (int64_t step = W / 2; step > 0; step /= 2)  // a tree: log2(W) dependent adds, not W
    for (int64_t i = 0; i < step; ++i) lanes[i] += lanes[i + step];
  return lanes[0];
}

// io[j] += Σ_k coef[k] rows[k * stride + j] for U vectors of j, the k sum split S ways: U x S independent
// FMA chains hide the FMA latency however narrow the span.
template <int U, int S>
inline void dot_rows(const float *coef, const float *rows, int64_t stride, int64_t K, float *io) {
  Vec a[S][U];
  for (int s = 0; s < S; ++s)
    for (int u = 0; u < U; ++u) a[s][u] = s == 0 ? Vec::loadu(io + u * W) : Vec(0.f);
  int64_t k = 0;
  for (; k + S <= K; k += S)
    for (int s = 0; s < S; ++s) {
      const Vec c(coef[k + s]);
      for (int u = 0; u < U; ++u) a[s][u] = at::vec::fmadd(c, Vec::loadu(rows + (k + s) * stride + u * W), a[s][u]);
    }
  for (; k < K; ++k) {
    const Vec c(coef[k]);
    for (int u = 0; u < U; ++u) a[0][u] = at::vec::fmadd(c, Vec::loadu(rows + k * stride + u * W), a[0][u]);
  }
  for (int u = 0; u < U; ++u) {
    Vec t = a[0][u];
    for (int s = 1; s < S; ++s) t = t + a[s][u];
    t.store(io + u * W);
  }
}

// s[lo, n) <- exp(s - max) over that range -> {max, sum of the new values}; max is -inf for an empty range
inline std::pair<float, float> exp_shifted(float *s, int64_t lo, int64_t n) {
  Vec vmax(-std::numeric_limits<float>::infinity());
  int64_t t = lo;
  for (; t + W <= n; t += W) vmax = at::vec::maximum(vmax, Vec::loadu(s + t));
  float lanes[W], mx = -std::numeric_limits<float>::infinity(), sum = 0.f;
  vmax.store(lanes);
  for (int64_t i = 0; i < W; ++i) mx = std::max(mx, lanes[i]);
  for (; t < n; ++t) mx = std::max(mx, s[t]);
  if (mx == -std::numeric_limits<float>::infinity()) {  // nothing visible: every weight is 0
    std::fill(s + lo, s + n, 0.f);
    return {mx, 0.f};
  }
  Vec vsum(0.f);
  for (t = lo; t + W <= n; t += W) {
    const Vec e = (Vec::loadu(s + t) - Vec(mx)).exp();
    e.store(s + t);
    vsum = vsum + e;
  }
  sum = hsum(vsum);
  for (; t < n; ++t) sum += (s[t] = std::exp(s[t] - mx));
  return {mx, sum};
}

// io[j] += Σ_k coef[k] rows[k * stride + j] for j in [j0, j1)
inline void dot_span(const float *coef, const float *rows, int64_t stride, int64_t K, float *io, int64_t j0,
                     int64_t j1) {
  int64_t j = j0;
  for (; j + 4 * W <= j1; j += 4 * W) dot_rows<4, 2>(coef, rows + j, stride, K, io + j);
  for (; j + 2 * W <= j1; j += 2 * W) dot_rows<2, 4>(coef, rows + j, stride, K, io + j);
  for (; j + W <= j1; j += W) dot_rows<1, 8>(coef, rows + j, stride, K, io + j);
  for (; j < j1; ++j)
    for (int64_t k = 0; k < K; ++k) io[j] += coef[k] * rows[k * stride + j];
}

// One row: out = x * rsqrt(mean(x^2) + eps) * (offset + w), fp32 throughout (F.rms_norm's formula).
inline void norm_row(const float *x, const float *w, float *out, int64_t D, float eps, float offset) {
  Vec acc(0.f);
  int64_t i = 0;
  for (; i + W <= D; i += W) {
    const Vec v = Vec::loadu(x + i);
    acc = at::vec::fmadd(v, v, acc);
  }
  float ss = hsum(acc);
  for (; i < D; ++i) ss += x[i] * x[i];
  const float r = 1.f / std::sqrt(ss / float(D) + eps);
  const Vec vr(r), vo(offset);
  for (i = 0; i + W <= D; i += W) (Vec::loadu(x + i) * vr * (vo + Vec::loadu(w + i))).store(out + i);
  for (; i < D; ++i) out[i] = x[i] * r * (offset + w[i]);
}

inline float dot(const float *a, const float *b, int64_t n) {  // Σ a[i] b[i]
  Vec acc(0.f);
  int64_t i = 0;
  for (; i + W <= n; i += W) acc = at::vec::fmadd(Vec::loadu(a + i), Vec::loadu(b + i), acc);
  float s = hsum(acc);
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// attend_part's outputs over an empty span, where every part starts: o = 0, m = -inf, l = 0
inline void clear_part(float *o, float *m, float *l, int64_t rep, int64_t Dv) {
  std::fill(o, o + rep * Dv, 0.f);
  std::fill(m, m + rep, -std::numeric_limits<float>::infinity());
  std::fill(l, l + rep, 0.f);
}

// One (row, KV head) job of decode attention over the span [a, e) of a row's tokens, unnormalised: token t's key
// is kp[((blk[t / bs] * H + h) * bs + t % bs) * D] (blk: the row's block table; a contiguous cache is one block of
// bs = max_len slots) and its value likewise in vp (Dv wide); qq (rep, D) are the query heads that read KV head h.
// -> o (rep, Dv) = Σ_t e^(s_t - m) v_t, m (rep) the largest score s_t = q k_t * scale, l (rep) = Σ_t e^(s_t - m)
// (m = -inf, l = 0, o = 0 over an empty span). Spans merge exactly (run_pieces). s: scratch.
inline void attend_part(const float *qq, int64_t rep, int64_t D, int64_t Dv, const float *kp, const float *vp,
                        const int64_t *blk, int64_t H, int64_t h, int64_t bs, int64_t a, int64_t e, float scale,
                        float *o, float *m, float *l, std::vector<float> &s) {
  const int64_t N = e - a;
  clear_part(o, m, l, rep, Dv);
  if (N <= 0) return;
  s.assign(rep * N, 0.f);  // (rep, N) scores, then weights
  for (int64_t t = a; t < e; ++t) {  // key t, read where it lies in its block
    const float *k = kp + ((blk[t / bs] * H + h) * bs + t % bs) * D;
    for (int64_t r = 0; r < rep; ++r) s[r * N + t - a] = dot(qq + r * D, k, D) * scale;
  }
  for (int64_t r = 0; r < rep; ++r) {
    float *w = s.data() + r * N;
    std::tie(m[r], l[r]) = exp_shifted(w, 0, N);
    for (int64_t t0 = a; t0 < e;) {  // values a block's run of tokens at a time: (run, Dv) contiguous rows
      const int64_t t1 = std::min(e, (t0 / bs + 1) * bs);
      const float *v = vp + ((blk[t0 / bs] * H + h) * bs + t0 % bs) * Dv;
      dot_span(w + t0 - a, v, Dv, t1 - t0, o + r * Dv, 0, Dv);
      t0 = t1;
    }
  }
}

// A piece of a decode attention job: job `job`'s tokens [a, e)
struct Piece {
  int64_t job, a, e;
};

// Decode attention's jobs cut along their tokens: job j's span [lo, hi) = range(j) into up to `ways` pieces of at
// least MIN_PIECE tokens, cut at multiples of `align`, `ways` making ~8 pieces a thread where the jobs are few. Why:
// a job is a (row, KV head), and at batch 1 a model has few KV heads: SmolLM2's 3 on 2 threads left one thread idle
// for a third of each layer's attention, which is most of a step at 4k tokens. Every job gets at least one piece.
constexpr int64_t MIN_PIECE = 256;

template <class Range>
std::vector<Piece> cut_jobs(int64_t jobs, Range range, int64_t align) {
  const int64_t threads = at::get_num_threads(), ways = std::max<int64_t>(1, (8 * threads + jobs - 1) / jobs);
  std::vector<Piece> ps;
  ps.reserve(jobs);
  for (int64_t j = 0; j < jobs; ++j) {
    const auto [lo, hi] = range(j);
    const int64_t k = std::max<int64_t>(1, std::min(ways, (hi - lo) / MIN_PIECE)), step = (hi - lo + k - 1) / k;
    int64_t a = lo;
    for (int64_t i = 1; i <= k; ++i) {
      const int64_t e = i == k ? hi : std::min(hi, (lo + i * step + align - 1) / align * align);
      if (e > a || a == lo) ps.push_back({j, a, std::max(a, e)});
      a = std::max(a, e);
    }
  }
  return ps;
}

// Every piece's part(piece, o, m, l) (attend_part's outputs), in parallel, then each job's pieces merged into
// out(job) (rep, Dv): Σ_p o_p e^(m_p - M) / Σ_p l_p e^(m_p - M), M the largest m_p (zeros for a job that saw
// nothing). One piece a job (many jobs: the usual case past batch 2): each normalises its own output in place.
template <class Part, class Out>
void run_pieces(const std::vector<Piece> &ps, int64_t jobs, int64_t rep, int64_t Dv, Part part, Out out) {
  const int64_t P = ps.size();
  if (P == jobs) {
    at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> ml(2 * rep);
      for (int64_t i = begin; i < end; ++i) {
        float *y = out(ps[i].job);
        part(ps[i], y, ml.data(), ml.data() + rep);
        for (int64_t r = 0; r < rep; ++r)
          if (ml[rep + r] > 0.f)
            for (int64_t j = 0; j < Dv; ++j) y[r * Dv + j] /= ml[rep + r];
      }
    });
    return;
  }
  std::vector<float> O(P * rep * Dv), M(P * rep), L(P * rep);
  at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) part(ps[i], O.data() + i * rep * Dv, M.data() + i * rep, L.data() + i * rep);
  });
  for (int64_t i = 0; i < P;) {  // pieces [i, k) are one job's
    int64_t k = i;
    while (k < P && ps[k].job == ps[i].job) ++k;
    float *y = out(ps[i].job);
    for (int64_t r = 0; r < rep; ++r) {
      float mx = -std::numeric_limits<float>::infinity(), sum = 0.f;
      for (int64_t p = i; p < k; ++p) mx = std::max(mx, M[p * rep + r]);
      float *yr = y + r * Dv;
      std::fill(yr, yr + Dv, 0.f);
      if (mx == -std::numeric_limits<float>::infinity()) continue;
      for (int64_t p = i; p < k; ++p) {
        const float c = std::exp(M[p * rep + r] - mx);  // 0 for a piece that saw nothing
        sum += c * L[p * rep + r];
        const float *op = O.data() + (p * rep + r) * Dv;
        for (int64_t j = 0; j < Dv; ++j) yr[j] += c * op[j];
      }
      for (int64_t j = 0; j < Dv; ++j) yr[j] /= sum;
    }
    i = k;
  }
}

// One row of a gated MLP's activation: o[i] = act(g[i]) * u[i] for i < F, act silu (g / (1 + e^-g)) or, gelu,
// the tanh approximation 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))). Shared by fused_ops.cpp's silu_mul
// and decode_stack.cpp.
inline void gate_row(const float *g, const float *u, float *o, int64_t F, bool gelu) {
  const float k0 = 0.7978845608028654f, k1 = 0.044715f;  // sqrt(2 / pi)
  int64_t i = 0;
  for (; i + W <= F; i += W) {
    const Vec gv = Vec::loadu(g + i);
    const Vec a = gelu ? Vec(0.5f) * gv * (Vec(1.f) + (Vec(k0) * (gv + Vec(k1) * gv * gv * gv)).tanh())
                       : gv / (Vec(1.f) + gv.neg().exp());
    (a * Vec::loadu(u + i)).store(o + i);
  }
  for (; i < F; ++i) {
    const float x = g[i];
    o[i] = (gelu ? 0.5f * x * (1.f + std::tanh(k0 * (x + k1 * x * x * x))) : x / (1.f + std::exp(-x))) * u[i];
  }
}
