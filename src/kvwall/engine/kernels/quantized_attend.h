// Attention of one (row, KV head) over the quantized cache's packed chunks and its full-precision residual
// (caches/quantized.py's layout), shared by quantized_decode.cpp (a layer's decode attention) and decode_stack.cpp
// (the fused decode step), so that both compute the same sums in the same order.
#pragma once
#include "quant_unpack.h"

struct QuantKV {  // one layer's buffers, as QuantizedLayer allocates them (contiguous)
  const uint8_t *kq; const at::Half *ks, *kz;  // (B, H, C, D, G*bits/8), (B, H, C, D) x2
  const uint8_t *vq; const at::Half *vs, *vz;  // (B, H, Tq, Dv*bits/8), (B, H, Tq, NG) x2
  const float *rk, *rv;                        // (B, H, slots, D|Dv): the full-precision residual
  int64_t H, C, D, G, Tq, Dv, NG, slots;
};

constexpr int64_t TILE = 128;  // tokens of values unpacked at once (TILE x Dv floats)

// One (row b, KV head h): the rep query heads q (rep, D) against the row's tokens [lo, n + res): the
// quantized ones [0, n) (token t at position t) and the full-precision residual (slot i at position n + i).
template <int BITS>
void attend_head(const QuantKV &L, int64_t b, int64_t h, const float *q, int64_t rep, int64_t lo, int64_t n,
                 int64_t res, float scale, float *o_out) {
  const int64_t D = L.D, G = L.G, Dv = L.Dv, NG = L.NG, gv = Dv / NG, N = n + res;
  const int64_t KB = G * BITS / 8, VB = Dv * BITS / 8, bh = b * L.H + h;
  const float sym = -float(1 << (BITS - 1));  // symmetric: z = -2^(bits-1) s
  const float *rk = L.rk + bh * L.slots * D, *rv = L.rv + bh * L.slots * Dv;
  std::vector<float> scores(rep * N), buf(std::max(D * G, TILE * Dv)), qs(D), zsum(rep * NG, 0.f), w(TILE);
  std::vector<float> vsf(TILE * NG), vzf(TILE * NG);
  // quantized keys: chunk c's bytes are (D, G) values; score[t] = Σ_d (q[d] s[d]) k[d, t] + Σ_d q[d] z[d]
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
      float *out = scores.data() + r * N + c * G;
      std::fill(out, out + G, 0.f);
      dot_span(qs.data(), buf.data(), G, D, out, 0, G);
      for (int64_t j = 0; j < G; ++j) out[j] = (out[j] + bias) * scale;
    }
  }
  // residual keys, full precision
  for (int64_t t = std::max(lo, n); t < N; ++t)
    for (int64_t r = 0; r < rep; ++r) {
      float a = 0.f;
      for (int64_t d = 0; d < D; ++d) a += q[r * D + d] * rk[(t - n) * D + d];
      scores[r * N + t] = a * scale;
    }
  // softmax over [lo, N), per query head: scores become exp(score - max); l = their sum
  std::vector<float> l(rep);
  for (int64_t r = 0; r < rep; ++r) l[r] = exp_shifted(scores.data() + r * N, lo, N).second;
  // quantized values, TILE tokens at a time: out[j] = Σ_t (p[t] s[t, g]) v[t, j] + Σ_t p[t] z[t, g]
  std::fill(o_out, o_out + rep * Dv, 0.f);
  for (int64_t t0 = lo; t0 < n; t0 += TILE) {
    const int64_t tt = std::min(TILE, n - t0), bt = bh * L.Tq + t0;
    unpack<BITS>(L.vq + bt * VB, buf.data(), tt * Dv);  // (tt, Dv)
    for (int64_t i = 0; i < tt * NG; ++i) {  // the tile's scales and zero points, (tt, NG), as floats once
      vsf[i] = float(L.vs[bt * NG + i]);
      vzf[i] = L.vz ? float(L.vz[bt * NG + i]) : sym * vsf[i];
    }
    for (int64_t r = 0; r < rep; ++r)
      for (int64_t g = 0; g < NG; ++g) {
        float zs = 0.f;
        for (int64_t t = 0; t < tt; ++t) {
          const float p = scores[r * N + t0 + t];
          zs += p * vzf[t * NG + g];
          w[t] = p * vsf[t * NG + g];
        }
        zsum[r * NG + g] += zs;
        dot_span(w.data(), buf.data(), Dv, tt, o_out + r * Dv, g * gv, (g + 1) * gv);
      }
  }
  // residual values, then normalise
  const int64_t r0 = std::max(lo, n);
  for (int64_t r = 0; r < rep; ++r) {
    if (r0 < N) dot_span(scores.data() + r * N + r0, rv + (r0 - n) * Dv, Dv, N - r0, o_out + r * Dv, 0, Dv);
    for (int64_t j = 0; j < Dv; ++j) o_out[r * Dv + j] = (o_out[r * Dv + j] + zsum[r * NG + j / gv]) / l[r];
  }
}

// The raw view of a QuantizedLayer's tensors (kz, vz undefined: a symmetric format). The caller checks shapes.
inline QuantKV quant_kv(const torch::Tensor &kq, const torch::Tensor &ks, const torch::Tensor &kz,
                        const torch::Tensor &vq, const torch::Tensor &vs, const torch::Tensor &vz,
                        const torch::Tensor &rk, const torch::Tensor &rv, int64_t bits) {
  return {kq.data_ptr<uint8_t>(), ks.data_ptr<at::Half>(), kz.defined() ? kz.data_ptr<at::Half>() : nullptr,
          vq.data_ptr<uint8_t>(), vs.data_ptr<at::Half>(), vz.defined() ? vz.data_ptr<at::Half>() : nullptr,
          rk.data_ptr<float>(), rv.data_ptr<float>(), rk.size(1), kq.size(2), kq.size(3), kq.size(4) * 8 / bits,
          vq.size(2), vq.size(3) * 8 / bits, vs.size(3), rk.size(2)};
}

// attend_head for a format's bits (8, 4 or 2): one switch, here, for every caller
inline void attend_head_bits(int64_t bits, const QuantKV &L, int64_t b, int64_t h, const float *q, int64_t rep,
                             int64_t lo, int64_t n, int64_t res, float scale, float *o_out) {
  if (bits == 8) attend_head<8>(L, b, h, q, rep, lo, n, res, scale, o_out);
  else if (bits == 4) attend_head<4>(L, b, h, q, rep, lo, n, res, scale, o_out);
  else attend_head<2>(L, b, h, q, rep, lo, n, res, scale, o_out);
}
