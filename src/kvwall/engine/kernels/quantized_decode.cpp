// Decode attention straight from the quantized cache's packed bytes (caches/quant_kernel.py says how).
#include "common.h"

#if defined(__AVX512F__)
// 4- and 2-bit values of `bytes` bytes to floats, 16 bytes per step: widen, mask out each field, convert,
// then interleave the fields back into element order. -> bytes done (a multiple of 16).
template <int BITS>
inline int64_t unpack_avx512(const uint8_t *p, float *out, int64_t bytes) {
  const __m512i pair_lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m512i pair_hi = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
  const __m512i mask = _mm512_set1_epi32((1 << BITS) - 1);
  int64_t i = 0;
  for (; i + 16 <= bytes; i += 16) {
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i *>(p + i)));
    auto field = [&](int k) { return _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(b, k * BITS), mask)); };
    if constexpr (BITS == 4) {  // out[2i + k] = field k of byte i
      const __m512 f0 = field(0), f1 = field(1);
      _mm512_storeu_ps(out + 2 * i, _mm512_permutex2var_ps(f0, pair_lo, f1));
      _mm512_storeu_ps(out + 2 * i + 16, _mm512_permutex2var_ps(f0, pair_hi, f1));
    } else {  // BITS == 2: out[4i + k]; interleave fields 0/1 and 2/3, then those pairs as 64-bit lanes
      const __m512 a0 = _mm512_permutex2var_ps(field(0), pair_lo, field(1));
      const __m512 a1 = _mm512_permutex2var_ps(field(0), pair_hi, field(1));
      const __m512 b0 = _mm512_permutex2var_ps(field(2), pair_lo, field(3));
      const __m512 b1 = _mm512_permutex2var_ps(field(2), pair_hi, field(3));
      const __m512i q_lo = _mm512_setr_epi64(0, 8, 1, 9, 2, 10, 3, 11), q_hi = _mm512_setr_epi64(4, 12, 5, 13, 6, 14, 7, 15);
      auto quads = [](__m512 x, __m512i idx, __m512 y) {
        return _mm512_castpd_ps(_mm512_permutex2var_pd(_mm512_castps_pd(x), idx, _mm512_castps_pd(y)));
      };
      _mm512_storeu_ps(out + 4 * i, quads(a0, q_lo, b0));
      _mm512_storeu_ps(out + 4 * i + 16, quads(a0, q_hi, b0));
      _mm512_storeu_ps(out + 4 * i + 32, quads(a1, q_lo, b1));
      _mm512_storeu_ps(out + 4 * i + 48, quads(a1, q_hi, b1));
    }
  }
  return i;
}
#endif

template <int BITS>
inline void unpack(const uint8_t *__restrict p, float *__restrict out, int64_t n) {  // n values, little end first
  if constexpr (BITS == 8) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) out[i] = p[i];
  } else {
    constexpr int PER = 8 / BITS, MASK = (1 << BITS) - 1;
    int64_t i0 = 0;
#if defined(__AVX512F__)
    i0 = unpack_avx512<BITS>(p, out, n / PER);  // 16 bytes at a time; the rest below
#endif
#pragma omp simd
    for (int64_t i = i0; i < n / PER; ++i) {
      const int byte = p[i];
      for (int k = 0; k < PER; ++k) out[i * PER + k] = (byte >> (k * BITS)) & MASK;
    }
  }
}

struct Layer {  // one layer's buffers, as QuantizedLayer allocates them (contiguous)
  const uint8_t *kq; const at::Half *ks, *kz;  // (B, H, C, D, G*bits/8), (B, H, C, D) x2
  const uint8_t *vq; const at::Half *vs, *vz;  // (B, H, Tq, Dv*bits/8), (B, H, Tq, NG) x2
  const float *rk, *rv;                        // (B, H, slots, D|Dv): the full-precision residual
  int64_t H, C, D, G, Tq, Dv, NG, slots;
};

constexpr int64_t TILE = 128;  // tokens of values unpacked at once (TILE x Dv floats)

// One (row b, KV head h): the rep query heads q (rep, D) against the row's tokens [lo, n + res): the
// quantized ones [0, n) (token t at position t) and the full-precision residual (slot i at position n + i).
template <int BITS>
void attend_head(const Layer &L, int64_t b, int64_t h, const float *q, int64_t rep, int64_t lo, int64_t n,
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

// q (B, H, rep, D) fp32; the layer's buffers; rk, rv (B, H, slots, D|Dv) fp32 residual; n, res, pos (B,) int64:
// row b's quantized tokens, residual tokens and query position (-1: padding, sees every held token);
// window (0: none). -> (B, H, rep, Dv): softmax(q k / sqrt) v over the tokens each query sees.
torch::Tensor quantized_decode(torch::Tensor q, torch::Tensor kq, torch::Tensor ks, c10::optional<torch::Tensor> kz,
                               torch::Tensor vq, torch::Tensor vs, c10::optional<torch::Tensor> vz, torch::Tensor rk,
                               torch::Tensor rv, torch::Tensor n, torch::Tensor res, torch::Tensor pos,
                               int64_t window, int64_t bits, double scale) {
  for (const auto &t : {q, kq, ks, vq, vs, rk, rv}) TORCH_CHECK(t.is_contiguous(), "buffers must be contiguous");
  TORCH_CHECK(bits == 8 || bits == 4 || bits == 2, "bits must be 8, 4 or 2");
  const int64_t B = q.size(0), H = q.size(1), rep = q.size(2), D = q.size(3);
  Layer L{kq.data_ptr<uint8_t>(), ks.data_ptr<at::Half>(), kz ? kz->data_ptr<at::Half>() : nullptr,
          vq.data_ptr<uint8_t>(), vs.data_ptr<at::Half>(), vz ? vz->data_ptr<at::Half>() : nullptr,
          rk.data_ptr<float>(), rv.data_ptr<float>(),
          H, kq.size(2), D, kq.size(4) * 8 / bits, vq.size(2), vq.size(3) * 8 / bits, vs.size(3), rk.size(2)};
  TORCH_CHECK(kq.size(3) == D && rk.size(3) == D && rv.size(3) == L.Dv, "buffers do not match the query");
  auto y = torch::empty({B, H, rep, L.Dv}, q.options());
  const int64_t *pn = n.data_ptr<int64_t>(), *pr = res.data_ptr<int64_t>(), *pp = pos.data_ptr<int64_t>();
  const float *pq = q.data_ptr<float>();
  float *py = y.data_ptr<float>();
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    for (int64_t job = begin; job < end; ++job) {
      const int64_t b = job / H, h = job % H, nb = pn[b], rb = pr[b], p = pp[b];
      const int64_t lo = (window > 0 && p >= 0) ? std::max<int64_t>(0, p - window + 1) : 0;
      const float *qq = pq + job * rep * D;
      float *yy = py + job * rep * L.Dv;
      if (lo >= nb + rb) {  // a row holding nothing (a padding row that never started): zeros, as over empty slots
        std::fill(yy, yy + rep * L.Dv, 0.f);
        continue;
      }
      if (bits == 8) attend_head<8>(L, b, h, qq, rep, lo, nb, rb, float(scale), yy);
      else if (bits == 4) attend_head<4>(L, b, h, qq, rep, lo, nb, rb, float(scale), yy);
      else attend_head<2>(L, b, h, qq, rep, lo, nb, rb, float(scale), yy);
    }
  });
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("quantized_decode", &quantized_decode); }
