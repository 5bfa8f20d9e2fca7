// The kernels' shared prelude: includes, the SIMD vector type, and the multiply-accumulate loops.
#pragma once
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <algorithm>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <cmath>
#include <limits>
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

// One (row, KV head) job of decode attention: the rep query heads qq (rep, D) that read KV head h, over the n
// tokens a row holds (its new one written: the queries are at position n - 1), or the last `window` of them
// (window 0: all); token t's key is kp[((blk[t / bs] * H + h) * bs + t % bs) * D] (blk: the row's block table; a
// contiguous cache is one block of bs = max_len slots) and its value likewise in vp (Dv wide).
// -> yy (rep, Dv): softmax(q k * scale) v, left as it was for a row holding nothing. s: scratch.
inline void attend_job(const float *qq, int64_t rep, int64_t D, int64_t Dv, const float *kp, const float *vp,
                       const int64_t *blk, int64_t H, int64_t h, int64_t bs, int64_t n, int64_t window, float scale,
                       float *yy, std::vector<float> &s) {
  const int64_t lo = window > 0 ? std::max<int64_t>(0, n - window) : 0, N = n - lo;
  if (N <= 0) return;  // a row holding nothing
  s.assign(rep * N, 0.f);  // (rep, N) scores, then weights
  for (int64_t t = lo; t < n; ++t) {  // key t, read where it lies in its block
    const float *k = kp + ((blk[t / bs] * H + h) * bs + t % bs) * D;
    for (int64_t r = 0; r < rep; ++r) s[r * N + t - lo] = dot(qq + r * D, k, D) * scale;
  }
  for (int64_t r = 0; r < rep; ++r) {
    float *w = s.data() + r * N;
    const float l = exp_shifted(w, 0, N).second;
    std::fill(yy + r * Dv, yy + (r + 1) * Dv, 0.f);
    for (int64_t t0 = lo; t0 < n;) {  // values a block's run of tokens at a time: (run, Dv) contiguous rows
      const int64_t t1 = std::min(n, (t0 / bs + 1) * bs);
      const float *v = vp + ((blk[t0 / bs] * H + h) * bs + t0 % bs) * Dv;
      dot_span(w + t0 - lo, v, Dv, t1 - t0, yy + r * Dv, 0, Dv);
      t0 = t1;
    }
    for (int64_t j = 0; j < Dv; ++j) yy[r * Dv + j] /= l;
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
