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

#if defined(__AVX512F__)
// fma_cols for 16- or 8-byte columns (CB) and R <= 8 query heads, the accumulators in registers: each load of
// codes widened once to 16 lanes (an 8-byte one leaves the upper 8 zero), then its 8 / BITS fields (lane l of field i: value PER l + i) multiplied into every
// head's sums, unpacked in registers (no buffer), put back into element order once at the end.
template <int BITS, int R>
inline void fma16(const uint8_t *p, int64_t stride, int64_t CB, int64_t K, const float *coef, int64_t cs,
                  float *out, int64_t os) {
  constexpr int PER = 8 / BITS, KS = R * PER <= 4 ? 2 : 1;  // KS: two k chains where few sums hide FMA latency
  __m512 acc[KS][R][PER];
  for (int s = 0; s < KS; ++s)
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < PER; ++i) acc[s][r][i] = _mm512_setzero_ps();
  const __m512i mask = _mm512_set1_epi32((1 << BITS) - 1);
  auto step = [&](int s, int64_t k) {
    const __m128i *at = reinterpret_cast<const __m128i *>(p + k * stride);
    const __m512i b = _mm512_cvtepu8_epi32(CB == 16 ? _mm_loadu_si128(at) : _mm_loadl_epi64(at));
    __m512 f[PER];
    for (int i = 0; i < PER; ++i)
      f[i] = _mm512_cvtepi32_ps(BITS == 8 ? b : _mm512_and_si512(_mm512_srli_epi32(b, i * BITS), mask));
    for (int r = 0; r < R; ++r) {
      const __m512 c = _mm512_set1_ps(coef[r * cs + k]);
      for (int i = 0; i < PER; ++i) acc[s][r][i] = _mm512_fmadd_ps(c, f[i], acc[s][r][i]);
    }
  };
  int64_t k = 0;
  for (; k + KS <= K; k += KS)
    for (int s = 0; s < KS; ++s) step(s, k + s);
  for (; k < K; ++k) step(0, k);
  const __m512i pair_lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m512i pair_hi = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
  const __m512i q_lo = _mm512_setr_epi64(0, 8, 1, 9, 2, 10, 3, 11), q_hi = _mm512_setr_epi64(4, 12, 5, 13, 6, 14, 7, 15);
  auto quads = [](__m512 x, __m512i idx, __m512 y) {
    return _mm512_castpd_ps(_mm512_permutex2var_pd(_mm512_castps_pd(x), idx, _mm512_castps_pd(y)));
  };
  for (int r = 0; r < R; ++r) {
    __m512 a[PER], e[PER];
    for (int i = 0; i < PER; ++i) a[i] = KS == 2 ? _mm512_add_ps(acc[0][r][i], acc[KS - 1][r][i]) : acc[0][r][i];
    if constexpr (PER == 1) e[0] = a[0];
    else if constexpr (PER == 2) {
      e[0] = _mm512_permutex2var_ps(a[0], pair_lo, a[1]);
      e[1] = _mm512_permutex2var_ps(a[0], pair_hi, a[1]);
    } else {  // interleave fields 0/1 and 2/3, then those pairs as 64-bit lanes
      const __m512 a0 = _mm512_permutex2var_ps(a[0], pair_lo, a[1]), a1 = _mm512_permutex2var_ps(a[0], pair_hi, a[1]);
      const __m512 b0 = _mm512_permutex2var_ps(a[2], pair_lo, a[3]), b1 = _mm512_permutex2var_ps(a[2], pair_hi, a[3]);
      e[0] = quads(a0, q_lo, b0), e[1] = quads(a0, q_hi, b0), e[2] = quads(a1, q_lo, b1), e[3] = quads(a1, q_hi, b1);
    }
    for (int64_t i = 0; i < PER && 16 * i < CB * PER; ++i) {  // CB PER values: 8 bytes of int8 fill half a vector
      float *o = out + r * os + 16 * i;
      const __mmask16 m = CB * PER - 16 * i >= 16 ? 0xffff : __mmask16((1u << (CB * PER - 16 * i)) - 1);
      _mm512_mask_storeu_ps(o, m, _mm512_add_ps(_mm512_maskz_loadu_ps(m, o), e[i]));
    }
  }
}
#elif defined(__AVX2__) && defined(__FMA__)
// fma_cols on AVX2 for 16- or 8-byte columns: as fma16, with 8 bytes (NH halves of a column) widened to 8 lanes and
// their 8 / BITS fields multiplied into RC heads' sums held in registers (at most 8 of AVX2's 16: RC x NH x fields),
// added into out in element order once at the end. The plain loop below read and wrote out's row for every k: on an
// AVX2-only host it was 17 % of Gemma 3 270M's decode step at 4 rows of 2k tokens with the int4 cache.
template <int BITS, int NH, int RC>
inline void fma8(const uint8_t *p, int64_t stride, int64_t K, const float *coef, int64_t cs, float *out, int64_t os) {
  constexpr int PER = 8 / BITS;
  __m256 acc[RC][NH][PER];
  for (int r = 0; r < RC; ++r)
    for (int h = 0; h < NH; ++h)
      for (int i = 0; i < PER; ++i) acc[r][h][i] = _mm256_setzero_ps();
  const __m256i mask = _mm256_set1_epi32((1 << BITS) - 1);
  for (int64_t k = 0; k < K; ++k) {
    __m256 f[NH][PER];  // lane l of field i of half h: value 8 PER h + PER l + i
    for (int h = 0; h < NH; ++h) {
      const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i *>(p + k * stride + 8 * h)));
      for (int i = 0; i < PER; ++i)
        f[h][i] = _mm256_cvtepi32_ps(BITS == 8 ? b : _mm256_and_si256(_mm256_srli_epi32(b, i * BITS), mask));
    }
    for (int r = 0; r < RC; ++r) {
      const __m256 c = _mm256_set1_ps(coef[r * cs + k]);
      for (int h = 0; h < NH; ++h)
        for (int i = 0; i < PER; ++i) acc[r][h][i] = _mm256_fmadd_ps(c, f[h][i], acc[r][h][i]);
    }
  }
  for (int r = 0; r < RC; ++r)
    for (int h = 0; h < NH; ++h)
      for (int i = 0; i < PER; ++i) {
        float lanes[8];
        _mm256_storeu_ps(lanes, acc[r][h][i]);
        for (int l = 0; l < 8; ++l) out[r * os + 8 * PER * h + PER * l + i] += lanes[l];
      }
}

template <int BITS, int NH>
inline void fma8_heads(const uint8_t *p, int64_t stride, int64_t K, const float *coef, int64_t cs, int64_t R,
                       float *out, int64_t os) {
  constexpr int RC = std::max(1, 8 / (NH * (8 / BITS)));  // heads whose sums fit 8 registers
  int64_t r = 0;
  for (; r + RC <= R; r += RC) fma8<BITS, NH, RC>(p, stride, K, coef + r * cs, cs, out + r * os, os);
  for (; r < R; ++r) fma8<BITS, NH, 1>(p, stride, K, coef + r * cs, cs, out + r * os, os);
}
#endif

// out[r * os + v] += Σ_k coef[r * cs + k] code_k[v] for r < R, v < CB * 8 / BITS: code_k the values packed in
// the CB bytes at p + k * stride (little end first). Keys: k a channel, v a chunk's token; values: k a token, v a
// channel of one group. The dequantization's scale and zero point are folded into coef and a bias by the caller.
template <int BITS>
inline void fma_cols(const uint8_t *p, int64_t stride, int64_t CB, int64_t K, const float *coef, int64_t cs,
                     int64_t R, float *out, int64_t os) {
#if defined(__AVX512F__)
  if (CB == 16 || CB == 8) {
    for (int64_t r0 = 0; r0 < R; r0 += 8) {
      const float *c = coef + r0 * cs;
      float *o = out + r0 * os;
      switch (std::min<int64_t>(8, R - r0)) {
        case 1: fma16<BITS, 1>(p, stride, CB, K, c, cs, o, os); break;
        case 2: fma16<BITS, 2>(p, stride, CB, K, c, cs, o, os); break;
        case 3: fma16<BITS, 3>(p, stride, CB, K, c, cs, o, os); break;
        case 4: fma16<BITS, 4>(p, stride, CB, K, c, cs, o, os); break;
        case 5: fma16<BITS, 5>(p, stride, CB, K, c, cs, o, os); break;
        case 6: fma16<BITS, 6>(p, stride, CB, K, c, cs, o, os); break;
        case 7: fma16<BITS, 7>(p, stride, CB, K, c, cs, o, os); break;
        default: fma16<BITS, 8>(p, stride, CB, K, c, cs, o, os);
      }
    }
    return;
  }
#elif defined(__AVX2__) && defined(__FMA__)
  if (CB == 16) return fma8_heads<BITS, 2>(p, stride, K, coef, cs, R, out, os);
  if (CB == 8) return fma8_heads<BITS, 1>(p, stride, K, coef, cs, R, out, os);
#endif
  const int64_t NV = CB * 8 / BITS;
  float v[128];  // CB <= 16 bytes: at most 64 values
  for (int64_t k = 0; k < K; ++k) {
    unpack<BITS>(p + k * stride, v, NV);
    for (int64_t r = 0; r < R; ++r) {
      const float c = coef[r * cs + k];
      float *o = out + r * os;
#pragma omp simd
      for (int64_t j = 0; j < NV; ++j) o[j] += c * v[j];
    }
  }
}

// The widest column a kernel reads at once: 16 bytes where the row (or group) of `bytes` is a multiple of it
inline int64_t col_bytes(int64_t bytes) { return std::gcd<int64_t>(16, bytes); }

struct QuantScratch {  // one thread's buffers
  std::vector<float> s, buf, qs, ksf, kzf, vs, vz, w, zsum;
};

// One (row b, KV head h): the rep query heads q (rep, D) against the row's tokens [a, e), of which [0, n) are
// quantized (token t at position t) and the rest the full-precision residual (slot i at position n + i); the
// caller cuts at multiples of lcm(G, TILE), so that a span ends where a chunk does (its start may be any window's).
// -> o (rep, Dv), m, l (rep): attend_part's unnormalised outputs (common.h). Scales and zero points are converted
// once a chunk or tile (half_to_float), not once a query head: at::Half's scalar conversion was most of the time.
template <int BITS>
void attend_part_q(const QuantKV &L, int64_t b, int64_t h, const float *q, int64_t rep, int64_t a, int64_t e,
                   int64_t n, float scale, float *o, float *m, float *l, QuantScratch &sc) {
  const int64_t D = L.D, G = L.G, Dv = L.Dv, NG = L.NG, gv = Dv / NG, qe = std::min(e, n);
  const int64_t KB = G * BITS / 8, VB = Dv * BITS / 8, bh = b * L.H + h;
  const int64_t a0 = a < n ? a / G * G : a, S = e - a0;  // scores cover [a0, e): whole chunks
  const float sym = -float(1 << (BITS - 1));  // symmetric: z = -2^(bits-1) s
  const float *rk = L.rk + bh * L.slots * D, *rv = L.rv + bh * L.slots * Dv;
  clear_part(o, m, l, rep, Dv);
  if (e <= a) return;
  sc.s.assign(rep * S, 0.f);
  sc.buf.resize(TILE * NG);  // a tile's (tt, NG) scales or zero points
  sc.qs.resize(rep * D), sc.ksf.resize(D), sc.kzf.resize(D), sc.w.resize(rep * NG * TILE);  // w: (rep, NG, tt)
  sc.vs.resize(TILE * NG), sc.vz.resize(TILE * NG);
  sc.zsum.assign(rep * NG, 0.f);
  float *s = sc.s.data(), *buf = sc.buf.data(), *qs = sc.qs.data(), *ksf = sc.ksf.data(), *kzf = sc.kzf.data();
  // quantized keys: chunk c's bytes are (D, G) codes; score[t] = Σ_d (q[d] s[d]) k[d, t] + Σ_d q[d] z[d]
  const int64_t CBk = col_bytes(KB), CBv = col_bytes(gv * BITS / 8);
  for (int64_t c = a0 / G; c * G < qe; ++c) {
    const int64_t cd = (bh * L.C + c) * D;
    half_to_float(L.ks + cd, ksf, D);
    if (L.kz) half_to_float(L.kz + cd, kzf, D);
    else
      for (int64_t d = 0; d < D; ++d) kzf[d] = sym * ksf[d];
    for (int64_t r = 0; r < rep; ++r) {
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) qs[r * D + d] = q[r * D + d] * ksf[d];
    }
    float *out = s + c * G - a0;  // (rep, G) of rows S apart
    for (int64_t cb = 0; cb < KB; cb += CBk)
      fma_cols<BITS>(L.kq + cd * KB + cb, KB, CBk, D, qs, D, rep, out + cb * 8 / BITS, S);
    for (int64_t r = 0; r < rep; ++r) {
      const float bias = dot(q + r * D, kzf, D);
      for (int64_t j = 0; j < G; ++j) out[r * S + j] = (out[r * S + j] + bias) * scale;
    }
  }
  for (int64_t t = std::max(a, n); t < e; ++t)  // residual keys, full precision
    for (int64_t r = 0; r < rep; ++r) s[r * S + t - a0] = dot(q + r * D, rk + (t - n) * D, D) * scale;
  // softmax over [a, e), per query head: scores become exp(score - m); l = their sum
  for (int64_t r = 0; r < rep; ++r) std::tie(m[r], l[r]) = exp_shifted(s + r * S, a - a0, S);
  // quantized values, TILE tokens at a time: out[j] = Σ_t (p[t] s[t, g]) v[t, j] + Σ_t p[t] z[t, g], g = j / gv
  float *vs = sc.vs.data(), *vz = sc.vz.data(), *w = sc.w.data();
  for (int64_t t0 = a; t0 < qe; t0 += TILE) {
    const int64_t tt = std::min(TILE, qe - t0), bt = bh * L.Tq + t0;
    half_to_float(L.vs + bt * NG, buf, tt * NG);  // (tt, NG) -> vs (NG, tt): a group's scales in a run
    for (int64_t t = 0; t < tt; ++t)
      for (int64_t g = 0; g < NG; ++g) vs[g * tt + t] = buf[t * NG + g];
    if (L.vz) {
      half_to_float(L.vz + bt * NG, buf, tt * NG);
      for (int64_t t = 0; t < tt; ++t)
        for (int64_t g = 0; g < NG; ++g) vz[g * tt + t] = buf[t * NG + g];
    }
    for (int64_t r = 0; r < rep; ++r)  // w (rep, NG, tt): each head's weights times each group's scales
      for (int64_t g = 0; g < NG; ++g) {
        const float *p = s + r * S + t0 - a0, *sg = vs + g * tt;
        float *wg = w + (r * NG + g) * TILE;
#pragma omp simd
        for (int64_t t = 0; t < tt; ++t) wg[t] = p[t] * sg[t];
        sc.zsum[r * NG + g] += L.vz ? dot(p, vz + g * tt, tt) : sym * std::accumulate(wg, wg + tt, 0.f);
      }
    for (int64_t cb = 0; cb < VB; cb += CBv)  // a column of CBv bytes lies in one group
      fma_cols<BITS>(L.vq + bt * VB + cb, VB, CBv, tt, w + (cb * 8 / BITS / gv) * TILE, NG * TILE, rep,
                     o + cb * 8 / BITS, Dv);
  }
  const int64_t r0 = std::max(a, n);  // residual values, then each group's zero-point sum
  for (int64_t r = 0; r < rep; ++r) {
    if (r0 < e) dot_span(s + r * S + r0 - a0, rv + (r0 - n) * Dv, Dv, e - r0, o + r * Dv, 0, Dv);
    for (int64_t j = 0; j < Dv; ++j) o[r * Dv + j] += sc.zsum[r * NG + j / gv];
  }
}

// The multiple of tokens a kivi job's pieces are cut at (cut_jobs): whole key chunks and value tiles
inline int64_t quant_align(const QuantKV &L) { return std::lcm(L.G, TILE); }

// The raw view of a QuantizedLayer's tensors (kz, vz undefined: a symmetric format). The caller checks shapes.
inline QuantKV quant_kv(const torch::Tensor &kq, const torch::Tensor &ks, const torch::Tensor &kz,
                        const torch::Tensor &vq, const torch::Tensor &vs, const torch::Tensor &vz,
                        const torch::Tensor &rk, const torch::Tensor &rv, int64_t bits) {
  return {kq.data_ptr<uint8_t>(), ks.data_ptr<at::Half>(), kz.defined() ? kz.data_ptr<at::Half>() : nullptr,
          vq.data_ptr<uint8_t>(), vs.data_ptr<at::Half>(), vz.defined() ? vz.data_ptr<at::Half>() : nullptr,
          rk.data_ptr<float>(), rv.data_ptr<float>(), rk.size(1), kq.size(2), kq.size(3), kq.size(4) * 8 / bits,
          vq.size(2), vq.size(3) * 8 / bits, vs.size(3), rk.size(2)};
}

// attend_part_q for a format's bits (8, 4 or 2): one switch, here, for every caller
inline void attend_part_bits(int64_t bits, const QuantKV &L, int64_t b, int64_t h, const float *q, int64_t rep,
                             int64_t a, int64_t e, int64_t n, float scale, float *o, float *m, float *l,
                             QuantScratch &sc) {
  if (bits == 8) attend_part_q<8>(L, b, h, q, rep, a, e, n, scale, o, m, l, sc);
  else if (bits == 4) attend_part_q<4>(L, b, h, q, rep, a, e, n, scale, o, m, l, sc);
  else attend_part_q<2>(L, b, h, q, rep, a, e, n, scale, o, m, l, sc);
}
