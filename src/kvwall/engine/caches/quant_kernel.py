"""Decode attention read straight from the quantized cache's packed bytes (C++, built on first use).

Why: the torch path dequantizes every held token to fp32 each step (unpack, scale, add zero, copy
next to the residual) and then runs attention over the copy: several fp32 passes over the whole
cache per token, so an int8 cache decoded many times slower than an fp32 one although it holds a
quarter of the bytes. This kernel reads each packed byte once and folds the scales into the small
side of each product instead:

    keys, per channel (chunk c of G tokens):  k[t, d] = z[c, d] + s[c, d] q_k[t, d]
        score[t] = Σ_d (q[d] s[c, d]) q_k[t, d] + Σ_d q[d] z[c, d]           (scaled query, one bias per chunk)
    values, per token (groups of gv channels):  v[t, j] = z[t, g] + s[t, g] q_v[t, j]
        out[j]   = Σ_t (p[t] s[t, g]) q_v[t, j] + Σ_t p[t] z[t, g]           (scaled probability, one sum per group)

Symmetric formats are the same with z = -2^(bits-1) s. The kernel covers the quantized tokens of a
row; it returns that part's softmax statistics (max m, sum l, unnormalised output o) so that the
caller merges the full-precision residual in torch (the split-softmax merge of flash decoding).
"""

from __future__ import annotations

import functools

from kvwall.engine.native import build

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <cmath>
#include <limits>
#include <vector>

using Vec = at::vec::Vectorized<float>;

template <int BITS>
inline void unpack(const uint8_t *__restrict p, float *__restrict out, int64_t n) {  // n values, little end first
  if constexpr (BITS == 8) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) out[i] = p[i];
  } else {
    constexpr int PER = 8 / BITS, MASK = (1 << BITS) - 1;
#pragma omp simd
    for (int64_t i = 0; i < n / PER; ++i) {
      const int byte = p[i];
      for (int k = 0; k < PER; ++k) out[i * PER + k] = (byte >> (k * BITS)) & MASK;
    }
  }
}

struct Layer {  // one layer's buffers, as QuantizedLayer allocates them (contiguous)
  const uint8_t *kq; const at::Half *ks, *kz;  // (B, H, C, D, G*bits/8), (B, H, C, D) x2
  const uint8_t *vq; const at::Half *vs, *vz;  // (B, H, Tq, Dv*bits/8), (B, H, Tq, NG) x2
  int64_t H, C, D, G, Tq, Dv, NG;
};

constexpr int64_t W = Vec::size(), TILE = 128;  // tokens of values unpacked at once (TILE x Dv floats)

// io[j] += Σ_k coef[k] rows[k * stride + j] for U vectors of j: U independent FMA chains hide the latency.
template <int U>
inline void dot_rows(const float *coef, const float *rows, int64_t stride, int64_t K, float *io) {
  Vec a[U];
  for (int u = 0; u < U; ++u) a[u] = Vec::loadu(io + u * W);
  for (int64_t k = 0; k < K; ++k) {
    const Vec c(coef[k]);
    for (int u = 0; u < U; ++u) a[u] = at::vec::fmadd(c, Vec::loadu(rows + k * stride + u * W), a[u]);
  }
  for (int u = 0; u < U; ++u) a[u].store(io + u * W);
}

// io[j] += Σ_k coef[k] rows[k * stride + j] for j in [j0, j1)
inline void dot_span(const float *coef, const float *rows, int64_t stride, int64_t K, float *io, int64_t j0,
                     int64_t j1) {
  int64_t j = j0;
  for (; j + 4 * W <= j1; j += 4 * W) dot_rows<4>(coef, rows + j, stride, K, io + j);
  for (; j + W <= j1; j += W) dot_rows<1>(coef, rows + j, stride, K, io + j);
  for (; j < j1; ++j)
    for (int64_t k = 0; k < K; ++k) io[j] += coef[k] * rows[k * stride + j];
}

// One (row b, KV head h): the rep query heads q (rep, D) against quantized tokens [lo, n).
template <int BITS>
void attend_head(const Layer &L, int64_t b, int64_t h, const float *q, int64_t rep, int64_t lo, int64_t n,
                 float scale, float *m_out, float *l_out, float *o_out) {
  const int64_t D = L.D, G = L.G, Dv = L.Dv, NG = L.NG, gv = Dv / NG;
  const int64_t KB = G * BITS / 8, VB = Dv * BITS / 8, bh = b * L.H + h;
  const float sym = -float(1 << (BITS - 1));  // symmetric: z = -2^(bits-1) s
  std::vector<float> scores(rep * n), buf(std::max(D * G, TILE * Dv)), qs(D), zsum(rep * NG, 0.f), w(TILE);
  // keys: chunk c's bytes are (D, G) values; score[t] = Σ_d (q[d] s[d]) k[d, t] + Σ_d q[d] z[d]
  for (int64_t c = lo / G; c < n / G; ++c) {
    const int64_t cd = (bh * L.C + c) * D;
    unpack<BITS>(L.kq + cd * KB, buf.data(), D * G);
    for (int64_t r = 0; r < rep; ++r) {
      float bias = 0.f;
      for (int64_t d = 0; d < D; ++d) {
        const float s = float(L.ks[cd + d]), z = L.kz ? float(L.kz[cd + d]) : sym * s;
        qs[d] = q[r * D + d] * s;
        bias += q[r * D + d] * z;
      }
      float *out = scores.data() + r * n + c * G;
      std::fill(out, out + G, 0.f);
      dot_span(qs.data(), buf.data(), G, D, out, 0, G);
      for (int64_t j = 0; j < G; ++j) out[j] = (out[j] + bias) * scale;
    }
  }
  // softmax over [lo, n), per query head: scores become exp(score - max)
  for (int64_t r = 0; r < rep; ++r) {
    float *sr = scores.data() + r * n;
    Vec vmax(-std::numeric_limits<float>::infinity());
    int64_t t = lo;
    for (; t + W <= n; t += W) vmax = at::vec::maximum(vmax, Vec::loadu(sr + t));
    float lanes[W], mx = -std::numeric_limits<float>::infinity(), sum = 0.f;
    vmax.store(lanes);
    for (int64_t i = 0; i < W; ++i) mx = std::max(mx, lanes[i]);
    for (; t < n; ++t) mx = std::max(mx, sr[t]);
    Vec vsum(0.f);
    for (t = lo; t + W <= n; t += W) {
      const Vec e = (Vec::loadu(sr + t) - Vec(mx)).exp();
      e.store(sr + t);
      vsum = vsum + e;
    }
    vsum.store(lanes);
    for (int64_t i = 0; i < W; ++i) sum += lanes[i];
    for (; t < n; ++t) sum += (sr[t] = std::exp(sr[t] - mx));
    m_out[r] = mx;
    l_out[r] = sum;
  }
  // values, TILE tokens at a time: out[j] = Σ_t (p[t] s[t, g]) v[t, j] + Σ_t p[t] z[t, g]
  std::fill(o_out, o_out + rep * Dv, 0.f);
  for (int64_t t0 = lo; t0 < n; t0 += TILE) {
    const int64_t tt = std::min(TILE, n - t0), bt = bh * L.Tq + t0;
    unpack<BITS>(L.vq + bt * VB, buf.data(), tt * Dv);  // (tt, Dv)
    for (int64_t r = 0; r < rep; ++r)
      for (int64_t g = 0; g < NG; ++g) {
        float zs = 0.f;
        for (int64_t t = 0; t < tt; ++t) {
          const float p = scores[r * n + t0 + t], s = float(L.vs[(bt + t) * NG + g]);
          zs += p * (L.vz ? float(L.vz[(bt + t) * NG + g]) : sym * s);
          w[t] = p * s;
        }
        zsum[r * NG + g] += zs;
        dot_span(w.data(), buf.data(), Dv, tt, o_out + r * Dv, g * gv, (g + 1) * gv);
      }
  }
  for (int64_t r = 0; r < rep; ++r)
    for (int64_t j = 0; j < Dv; ++j) o_out[r * Dv + j] += zsum[r * NG + j / gv];
}

// q (B, H, rep, D) fp32; n, lo (B,) int64: row b's quantized tokens and its first visible one.
// -> m, l (B, H, rep), o (B, H, rep, Dv): max score, Σ exp(score - m), Σ exp(score - m) v; m = -inf, l = 0
// where a row has no visible quantized token.
std::vector<torch::Tensor> quantized_decode(torch::Tensor q, torch::Tensor kq, torch::Tensor ks,
                                            c10::optional<torch::Tensor> kz, torch::Tensor vq, torch::Tensor vs,
                                            c10::optional<torch::Tensor> vz, torch::Tensor n, torch::Tensor lo,
                                            int64_t bits, double scale) {
  for (const auto &t : {q, kq, ks, vq, vs}) TORCH_CHECK(t.is_contiguous(), "buffers must be contiguous");
  const int64_t B = q.size(0), H = q.size(1), rep = q.size(2), D = q.size(3);
  Layer L{kq.data_ptr<uint8_t>(), ks.data_ptr<at::Half>(), kz ? kz->data_ptr<at::Half>() : nullptr,
          vq.data_ptr<uint8_t>(), vs.data_ptr<at::Half>(), vz ? vz->data_ptr<at::Half>() : nullptr,
          H, kq.size(2), D, kq.size(4) * 8 / bits, vq.size(2), vq.size(3) * 8 / bits, vs.size(3)};
  TORCH_CHECK(kq.size(3) == D && ks.numel() == B * H * L.C * D, "key buffers do not match the query");
  auto m = torch::empty({B, H, rep}, q.options()), l = torch::empty({B, H, rep}, q.options());
  auto o = torch::empty({B, H, rep, L.Dv}, q.options());
  const int64_t *pn = n.data_ptr<int64_t>(), *plo = lo.data_ptr<int64_t>();
  const float *pq = q.data_ptr<float>();
  float *pm = m.data_ptr<float>(), *pl = l.data_ptr<float>(), *po = o.data_ptr<float>();
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    for (int64_t job = begin; job < end; ++job) {
      const int64_t b = job / H, h = job % H, nb = pn[b], lb = std::min(plo[b], nb);
      float *mo = pm + job * rep, *lo_ = pl + job * rep, *oo = po + job * rep * L.Dv;
      if (lb >= nb) {  // nothing quantized is visible
        for (int64_t r = 0; r < rep; ++r) mo[r] = -std::numeric_limits<float>::infinity(), lo_[r] = 0.f;
        std::fill(oo, oo + rep * L.Dv, 0.f);
        continue;
      }
      const float *qq = pq + job * rep * D;
      if (bits == 8) attend_head<8>(L, b, h, qq, rep, lb, nb, float(scale), mo, lo_, oo);
      else if (bits == 4) attend_head<4>(L, b, h, qq, rep, lb, nb, float(scale), mo, lo_, oo);
      else attend_head<2>(L, b, h, qq, rep, lb, nb, float(scale), mo, lo_, oo);
    }
  });
  return {m, l, o};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("quantized_decode", &quantized_decode); }
"""


@functools.lru_cache(maxsize=1)
def quantized_decode():
    """The compiled kernel's ``quantized_decode`` (see SOURCE for its arguments), or None if it cannot be built."""
    built = build("kvwall_quantized_decode", SOURCE)
    return None if built is None else built[0].quantized_decode
