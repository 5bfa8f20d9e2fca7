// y = x W^T with W held packed (layers/packed.py says the layout): never dequantized as a whole.
//
// By rows of x: at 1, run_one (d Σxq + c Σx per group, each code converted and multiplied once); at a few,
// run_batch (each weight dequantized in a register, w = d q + c, and multiplied into four rows of x); from
// GEMM_MIN_ROWS, run_gemm (tiles dequantized to float32, then torch's GEMM). run<> is what a shape whose groups do
// not split into whole vectors takes at any rows below GEMM_MIN_ROWS: R rows dequantized into an L1 buffer, then
// every row of x over them. Each weight is read from memory once a call, as bits/8 bytes. With int8 activations
// (x8, approximate), x is rounded per group first (round_x8) and, up to X8_MAX_ROWS rows on AVX-512 VNNI, run_x8
// takes the integer dot products.
// Included by packed_linear.cpp (PackedLinear's kernel) and decode_stack.cpp (a whole decode step).
#pragma once
#include "common.h"
#include "quant_unpack.h"  // half_to_float: a row's scales or zeros, once per row, not once per group

constexpr int64_t R = 4;  // output rows dequantized and multiplied together

#if defined(__AVX2__)
#include <immintrin.h>
#endif

// o[j] = d code(p[j]) + c for j < n, where code is the byte (BITS 8), its low nibble (SHIFT 0) or its high
// one (SHIFT 4): 16 (AVX-512) or 8 (AVX2) bytes widened to int32 lanes per step. (A plain loop, which gcc
// vectorises badly for 16-element runs, made int4 g32 4x slower than int4 g128: 221 vs 57 us at 576x1536.)
template <int BITS, int SHIFT>
inline void dequant_run(const uint8_t *__restrict p, int64_t n, float d, float c, float *__restrict o) {
  int64_t j = 0;
#if defined(__AVX512F__)
  const __m512 vd = _mm512_set1_ps(d), vc = _mm512_set1_ps(c);
  for (; j + 16 <= n; j += 16) {
    __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i *>(p + j)));
    if constexpr (BITS == 4) b = _mm512_and_si512(_mm512_srli_epi32(b, SHIFT), _mm512_set1_epi32(15));
    _mm512_storeu_ps(o + j, _mm512_fmadd_ps(vd, _mm512_cvtepi32_ps(b), vc));
  }
#elif defined(__AVX2__) && defined(__FMA__)
  const __m256 vd = _mm256_set1_ps(d), vc = _mm256_set1_ps(c);
  for (; j + 8 <= n; j += 8) {
    __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i *>(p + j)));
    if constexpr (BITS == 4) b = _mm256_and_si256(_mm256_srli_epi32(b, SHIFT), _mm256_set1_epi32(15));
    _mm256_storeu_ps(o + j, _mm256_fmadd_ps(vd, _mm256_cvtepi32_ps(b), vc));
  }
#endif
  for (; j < n; ++j) o[j] = d * float(BITS == 8 ? p[j] : (p[j] >> SHIFT) & 15) + c;
}

// One packed row's K weights as floats. q: the row's bytes; s, z: its groups' scale and zero as floats (z null:
// symmetric, c = -2^(bits-1) d). 4-bit groups hold element j in the low nibble of byte j and element
// j + len/2 in the high nibble (GGUF Q4's order), so both halves unpack as contiguous runs.
template <int BITS>
inline void dequant_row(const uint8_t *__restrict q, const float *s, const float *z, int64_t K, int64_t G,
                        float *__restrict w) {
  constexpr float OFF = float(1 << (BITS - 1));
  for (int64_t k0 = 0, g = 0; k0 < K; k0 += G, ++g) {
    const int64_t len = std::min(G, K - k0);
    const float d = s[g], c = z ? z[g] : -OFF * d;
    if constexpr (BITS == 8) {
      dequant_run<8, 0>(q + k0, len, d, c, w + k0);
    } else {
      dequant_run<4, 0>(q + k0 / 2, len / 2, d, c, w + k0);
      dequant_run<4, 4>(q + k0 / 2, len / 2, d, c, w + k0 + len / 2);
    }
  }
}

// out[m, r] = x[m] . w[r] for r < RR (RR rows of K floats in w), every m < M
template <int RR>
inline void dot_rows_x(const float *x, int64_t M, int64_t K, const float *w, float *out, int64_t ldo) {
  for (int64_t m = 0; m < M; ++m) {
    const float *xm = x + m * K;
    Vec a[RR];
    for (int r = 0; r < RR; ++r) a[r] = Vec(0.f);
    int64_t k = 0;
    for (; k + W <= K; k += W) {
      const Vec xv = Vec::loadu(xm + k);
      for (int r = 0; r < RR; ++r) a[r] = at::vec::fmadd(xv, Vec::loadu(w + r * K + k), a[r]);
    }
    for (int r = 0; r < RR; ++r) {
      float t = hsum(a[r]);
      for (int64_t kk = k; kk < K; ++kk) t += xm[kk] * w[r * K + kk];
      out[m * ldo + r] = t;
    }
  }
}

// Batch 1 without the L1 buffer: Σ_k x_k (d q_k + c) = d Σ_k x_k q_k + c Σ_k x_k per group, so each code is
// converted and multiplied by x once (one FMA) and the group's scale is applied to a vector of partial sums;
// Σ_k x_k per group (xs) is shared by every row. 4-bit rows go R at a time, sharing each load of x; 8-bit rows one
// at a time, read front to back (ONE_ROW): R 8-bit rows side by side ran Gemma 3 270M's Q8_0 head (262144 x 640,
// 178 MB, out of cache) at 12 GB/s on this machine's 2 threads, one at a time at 18-24 GB/s (14-15 -> 7.4-9.9 ms
// a step); 4-bit rows lost by it (q4_1 1536 x 576: 10-12 -> 8 GB/s). Accumulators take groups in turn (four at one
// row, two at R), so the group scales' FMAs do not chain: a 16-weight int8 group is one vector, and Gemma 3's ffn_down
// (Q6_K as int8 g16, 128 groups a row) waited on one FMA's latency per group with two.
#if defined(__AVX512F__)
using VF = __m512;
constexpr int64_t L = 16;  // floats per vector; bytes of codes widened per step
inline VF vzero() { return _mm512_setzero_ps(); }
inline VF vload(const float *p) { return _mm512_loadu_ps(p); }
inline VF vload_first(const float *p, int64_t n) { return _mm512_maskz_loadu_ps((__mmask16)((1u << n) - 1), p); }
inline VF vset(float v) { return _mm512_set1_ps(v); }
inline VF vfma(VF a, VF b, VF c) { return _mm512_fmadd_ps(a, b, c); }
inline float vsum(VF v) { return _mm512_reduce_add_ps(v); }
inline __m512i widen(const uint8_t *p) {
  return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i *>(p)));
}
inline VF codes8(const uint8_t *p) { return _mm512_cvtepi32_ps(widen(p)); }
inline void codes4(const uint8_t *p, VF &lo, VF &hi) {
  const __m512i b = widen(p);
  lo = _mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(15)));
  hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
}
#define KVWALL_FUSED 1
#elif defined(__AVX2__) && defined(__FMA__)
using VF = __m256;
constexpr int64_t L = 8;
inline VF vzero() { return _mm256_setzero_ps(); }
inline VF vload(const float *p) { return _mm256_loadu_ps(p); }
inline VF vload_first(const float *p, int64_t n) {  // n < 8 floats, the rest 0
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_maskload_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32(int(n)), lanes));
}
inline VF vset(float v) { return _mm256_set1_ps(v); }
inline VF vfma(VF a, VF b, VF c) { return _mm256_fmadd_ps(a, b, c); }
inline float vsum(VF v) {
  const __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)));
}
inline __m256i widen(const uint8_t *p) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i *>(p)));
}
inline VF codes8(const uint8_t *p) { return _mm256_cvtepi32_ps(widen(p)); }
inline void codes4(const uint8_t *p, VF &lo, VF &hi) {
  const __m256i b = widen(p);
  lo = _mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(15)));
  hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
}
#define KVWALL_FUSED 1
#endif

#ifdef KVWALL_FUSED
// Whether every group (the last, shorter one too) splits into whole vectors: 8-bit len % L, 4-bit (len/2) % L.
inline bool fused_fits(int bits, int64_t K, int64_t G) {
  const int64_t per = bits == 8 ? L : 2 * L;
  return G % per == 0 && (K % G) % per == 0;
}

// Σ_g a_g b_g over n groups, lane by lane (the caller sums the lanes)
inline VF dot_groups(const float *a, const float *b, int64_t n) {
  VF t = vzero();
  int64_t g = 0;
  for (; g + L <= n; g += L) t = vfma(vload(a + g), vload(b + g), t);
  if (g < n) t = vfma(vload_first(a + g, n - g), vload_first(b + g, n - g), t);
  return t;
}

// y[n0 + r] for r < RR: one row of x (K) against RR packed rows (sf: their scales per group; cf: their zeros per
// group, asymmetric formats; null: symmetric, c = -OFF d)
template <int BITS, int RR>
inline void fused_rows(const float *x, const float *xs, const uint8_t *q, int64_t QB, const float *sf,
                       const float *cf, int64_t NG, int64_t K, int64_t G, float *y) {
  constexpr float OFF = float(1 << (BITS - 1));
  constexpr int NA = RR == 1 ? 4 : 2;  // accumulators a row, taking groups in turn (ONE_ROW: why 4 at one row)
  VF acc[RR][NA];
  for (int r = 0; r < RR; ++r)
    for (int a = 0; a < NA; ++a) acc[r][a] = vzero();
  for (int64_t k0 = 0, g = 0; k0 < K; k0 += G, ++g) {
    const int64_t len = std::min(G, K - k0);
    // two partial sums a row, each vector of the group into the other: a group's FMAs chained one after another
    // (four at AVX2's 8 lanes and G = 32) left batch 1 waiting on FMA latency (Gemma 3's Q8_0 head, alone on 2
    // AVX2 cores: 16.1 -> 12.4-13.6 ms a call, observations of 2026-12-07)
    VF p0[RR], p1[RR];
    for (int r = 0; r < RR; ++r) p0[r] = p1[r] = vzero();
    if constexpr (BITS == 8) {
      int64_t j = 0;
      for (; j + 2 * L <= len; j += 2 * L) {
        const VF x0 = vload(x + k0 + j), x1 = vload(x + k0 + j + L);
        for (int r = 0; r < RR; ++r) {
          p0[r] = vfma(x0, codes8(q + r * QB + k0 + j), p0[r]);
          p1[r] = vfma(x1, codes8(q + r * QB + k0 + j + L), p1[r]);
        }
      }
      if (j < len) {
        const VF x0 = vload(x + k0 + j);
        for (int r = 0; r < RR; ++r) p0[r] = vfma(x0, codes8(q + r * QB + k0 + j), p0[r]);
      }
    } else {
      const int64_t h = len / 2;
      for (int64_t j = 0; j < h; j += L) {
        const VF xlo = vload(x + k0 + j), xhi = vload(x + k0 + h + j);
        for (int r = 0; r < RR; ++r) {
          VF lo, hi;
          codes4(q + r * QB + k0 / 2 + j, lo, hi);
          if constexpr (RR == 1) {
            p0[r] = vfma(xlo, lo, p0[r]);
            p1[r] = vfma(xhi, hi, p1[r]);
          } else {  // R rows are R chains already, and a second partial each spilled AVX2's 16 registers
            p0[r] = vfma(xhi, hi, vfma(xlo, lo, p0[r]));
          }
        }
      }
    }
    // the group's scale into the row's first accumulator, then the accumulators rotate (named, not indexed by
    // g % NA: an index the compiler cannot resolve kept them in memory, a store and a load a group)
    for (int r = 0; r < RR; ++r) {
      const VF t = vfma(vset(sf[r * NG + g]), RR == 1 ? p0[r] + p1[r] : p0[r], acc[r][0]);
      for (int a = 0; a + 1 < NA; ++a) acc[r][a] = acc[r][a + 1];
      acc[r][NA - 1] = t;
    }
  }
  for (int r = 0; r < RR; ++r) {
    // Σ_g c_g xs_g: symmetric c_g = -OFF d_g (cf null), so -OFF Σ_g d_g xs_g; as vectors (a scalar chain of NG
    // FMAs a row was a third of the uops of Gemma 3's 640-wide rows, 128 groups a row at int8 g16)
    const VF c = cf ? dot_groups(cf + r * NG, xs, NG) : dot_groups(sf + r * NG, xs, NG) * vset(-OFF);
    VF t = c;
    for (int a = 0; a < NA; ++a) t = t + acc[r][a];
    y[r] = vsum(t);
  }
}

template <int BITS>
torch::Tensor run_one(const torch::Tensor &x, const torch::Tensor &q, const torch::Tensor &s, const torch::Tensor &z,
                      int64_t G) {
  const int64_t K = x.size(1), N = q.size(0), NG = s.size(1), QB = q.size(1);
  auto y = torch::empty({1, N}, x.options());
  const float *xp = x.data_ptr<float>();
  const uint8_t *qp = q.data_ptr<uint8_t>();
  const at::Half *sp = s.data_ptr<at::Half>(), *zp = z.defined() ? z.data_ptr<at::Half>() : nullptr;
  float *yp = y.data_ptr<float>();
  std::vector<float> xs(NG, 0.f);  // Σ x over each group
  for (int64_t g = 0; g < NG; ++g)
    for (int64_t k = g * G; k < std::min(K, (g + 1) * G); ++k) xs[g] += xp[k];
  const int64_t tiles = (N + R - 1) / R;
  at::parallel_for(0, tiles, std::max<int64_t>(1, 65536 / std::max<int64_t>(1, K * R)), [&](int64_t t0, int64_t t1) {
    std::vector<float> sf(R * NG), cf(R * NG);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n0 = t * R, rows = std::min(R, N - n0);
      half_to_float(sp + n0 * NG, sf.data(), rows * NG);  // rows n0.. are contiguous: one conversion
      if (zp) half_to_float(zp + n0 * NG, cf.data(), rows * NG);
      const float *c = zp ? cf.data() : nullptr;
      if (BITS != 8 && rows == R) {  // 8-bit rows one at a time: ONE_ROW (above)
        fused_rows<BITS, R>(xp, xs.data(), qp + n0 * QB, QB, sf.data(), c, NG, K, G, yp + n0);
      } else {
        for (int64_t r = 0; r < rows; ++r)
          fused_rows<BITS, 1>(xp, xs.data(), qp + (n0 + r) * QB, QB, sf.data() + r * NG, c ? c + r * NG : nullptr,
                              NG, K, G, yp + n0 + r);
      }
    }
  });
  return y;
}

// -- a few rows (a batched decode step): each weight dequantized once, in a register -----------------------------
// y[m, r] for m < MM, r < RR: MM rows of x (stride ldx) against RR packed rows. Each L weights of a row are
// dequantized in a register (w = d q + c: one FMA, the GEMM path's values bit for bit) and multiplied into MM rows
// of x: 1 + MM FMAs per L weights, MM x RR independent accumulators. run<> (below), which writes R dequantized rows
// to an L1 buffer and then runs each row of x over them, kept its four accumulators in memory on AVX2 (gcc stored
// them every step) and ran Gemma 3 270M's Q8_0 head at 13 G multiply-adds/s at 4 rows where torch's sgemm reaches
// ~70 on the same 2 cores (49 ms against 14 ms at 1 row, 2026-12-07, AMD EPYC with AVX2 only).
template <int BITS, int RR, int MM>
inline void tile_rows(const float *x, int64_t ldx, const uint8_t *q, int64_t QB, const float *sf, const float *cf,
                      int64_t NG, int64_t K, int64_t G, float *y, int64_t ldy) {
  constexpr float OFF = float(1 << (BITS - 1));
  VF acc[MM][RR];
  for (int m = 0; m < MM; ++m)
    for (int r = 0; r < RR; ++r) acc[m][r] = vzero();
  for (int64_t k0 = 0, g = 0; k0 < K; k0 += G, ++g) {
    const int64_t len = std::min(G, K - k0);
    VF d[RR], c[RR];
    for (int r = 0; r < RR; ++r) {
      const float dr = sf[r * NG + g];
      d[r] = vset(dr);
      c[r] = vset(cf ? cf[r * NG + g] : -OFF * dr);
    }
    if constexpr (BITS == 8) {
      for (int64_t j = 0; j < len; j += L) {
        VF w[RR];
        for (int r = 0; r < RR; ++r) w[r] = vfma(d[r], codes8(q + r * QB + k0 + j), c[r]);
        for (int m = 0; m < MM; ++m) {
          const VF xv = vload(x + m * ldx + k0 + j);
          for (int r = 0; r < RR; ++r) acc[m][r] = vfma(xv, w[r], acc[m][r]);
        }
      }
    } else {
      const int64_t h = len / 2;  // element j in byte j's low nibble, j + h in its high one
      for (int64_t j = 0; j < h; j += L) {
        VF lo[RR], hi[RR];
        for (int r = 0; r < RR; ++r) {
          codes4(q + r * QB + k0 / 2 + j, lo[r], hi[r]);
          lo[r] = vfma(d[r], lo[r], c[r]);
          hi[r] = vfma(d[r], hi[r], c[r]);
        }
        for (int m = 0; m < MM; ++m) {
          const VF xl = vload(x + m * ldx + k0 + j), xh = vload(x + m * ldx + k0 + h + j);
          for (int r = 0; r < RR; ++r) acc[m][r] = vfma(xh, hi[r], vfma(xl, lo[r], acc[m][r]));
        }
      }
    }
  }
  for (int m = 0; m < MM; ++m)
    for (int r = 0; r < RR; ++r) y[m * ldy + r] = vsum(acc[m][r]);
}

// rows rows (RR or fewer) of the packed matrix against every row of x (M), four rows of x at a time
template <int BITS, int RR>
inline void tile_all(const float *x, int64_t M, const uint8_t *q, int64_t QB, const float *sf, const float *cf,
                     int64_t NG, int64_t K, int64_t G, int64_t rows, float *y, int64_t N) {
  if (rows < RR) {  // the matrix's last, short tile: a row at a time
    for (int64_t r = 0; r < rows; ++r)
      tile_all<BITS, 1>(x, M, q + r * QB, QB, sf + r * NG, cf ? cf + r * NG : nullptr, NG, K, G, 1, y + r, N);
    return;
  }
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) tile_rows<BITS, RR, 4>(x + m * K, K, q, QB, sf, cf, NG, K, G, y + m * N, N);
  const float *xm = x + m * K;
  float *ym = y + m * N;
  switch (M - m) {
    case 3: tile_rows<BITS, RR, 3>(xm, K, q, QB, sf, cf, NG, K, G, ym, N); break;
    case 2: tile_rows<BITS, RR, 2>(xm, K, q, QB, sf, cf, NG, K, G, ym, N); break;
    case 1: tile_rows<BITS, RR, 1>(xm, K, q, QB, sf, cf, NG, K, G, ym, N); break;
    default: break;
  }
}

constexpr int64_t RB = 2;  // packed rows a batch tile holds: 2 x 4 accumulators + 2 weights + 4 scales fit AVX2's 16

template <int BITS>
torch::Tensor run_batch(const torch::Tensor &x, const torch::Tensor &q, const torch::Tensor &s, const torch::Tensor &z,
                        int64_t G) {
  const int64_t M = x.size(0), K = x.size(1), N = q.size(0), NG = s.size(1), QB = q.size(1);
  auto y = torch::empty({M, N}, x.options());  // (M, N)
  const float *xp = x.data_ptr<float>();
  const uint8_t *qp = q.data_ptr<uint8_t>();
  const at::Half *sp = s.data_ptr<at::Half>(), *zp = z.defined() ? z.data_ptr<at::Half>() : nullptr;
  float *yp = y.data_ptr<float>();
  const int64_t tiles = (N + RB - 1) / RB;
  at::parallel_for(0, tiles, std::max<int64_t>(1, 65536 / std::max<int64_t>(1, K * RB * M)), [&](int64_t t0, int64_t t1) {
    std::vector<float> sf(RB * NG), cf(RB * NG);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n0 = t * RB, rows = std::min(RB, N - n0);
      half_to_float(sp + n0 * NG, sf.data(), rows * NG);  // rows n0.. are contiguous: one conversion
      if (zp) half_to_float(zp + n0 * NG, cf.data(), rows * NG);
      tile_all<BITS, RB>(xp, M, qp + n0 * QB, QB, sf.data(), zp ? cf.data() : nullptr, NG, K, G, rows, yp + n0, N);
    }
  });
  return y;
}
#endif

template <int BITS>
torch::Tensor run(const torch::Tensor &x, const torch::Tensor &q, const torch::Tensor &s, const torch::Tensor &z,
                  int64_t G) {
  const int64_t M = x.size(0), K = x.size(1), N = q.size(0), NG = s.size(1), QB = q.size(1);
  auto y = torch::empty({M, N}, x.options());
  const float *xp = x.data_ptr<float>();
  const uint8_t *qp = q.data_ptr<uint8_t>();
  const at::Half *sp = s.data_ptr<at::Half>(), *zp = z.defined() ? z.data_ptr<at::Half>() : nullptr;
  float *yp = y.data_ptr<float>();
  const int64_t tiles = (N + R - 1) / R;
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, K * M / 4));  // ~16k FMAs a task at least
  at::parallel_for(0, tiles, grain, [&](int64_t t0, int64_t t1) {
    std::vector<float> w(R * K);
    std::vector<float> part(M * R), sf(NG), zf(NG);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n0 = t * R, rows = std::min(R, N - n0);
      for (int64_t r = 0; r < rows; ++r) {
        half_to_float(sp + (n0 + r) * NG, sf.data(), NG);
        if (zp) half_to_float(zp + (n0 + r) * NG, zf.data(), NG);
        dequant_row<BITS>(qp + (n0 + r) * QB, sf.data(), zp ? zf.data() : nullptr, K, G, w.data() + r * K);
      }
      if (rows == R) {
        dot_rows_x<R>(xp, M, K, w.data(), part.data(), R);
      } else {
        for (int64_t r = 0; r < rows; ++r) dot_rows_x<1>(xp, M, K, w.data() + r * K, part.data() + r, R);
      }
      for (int64_t m = 0; m < M; ++m)
        for (int64_t r = 0; r < rows; ++r) yp[m * N + n0 + r] = part[m * R + r];
    }
  });
  return y;
}

// -- many rows (a prefill): dequantize once, then a real GEMM --------------------------------------------------
// At M rows the row kernel above does M K FMAs per R rows with one load of x and R of w per R FMAs, a GEMV's
// arithmetic intensity; a GEMM keeps blocks of x and w in registers and runs near the FMA peak. So from
// GEMM_MIN_ROWS rows on, the weight is dequantized once per call, GEMM_TILE_FLOATS floats (a tile of whole rows)
// at a time, into float32, and torch's GEMM (at::mm: MKL's sgemm in torch's x86 builds) multiplies x by the tile
// into its columns of y. The dequantization costs N K converts against the GEMM's M N K FMAs (1/M of the work).
// GEMM_MIN_ROWS: benchmarks/bench_prefill.py --crossover --threads 1 (SmolLM2-135M's four matrix shapes, int4 g32
// with zeros as Q4_1, fastest of 15 calls, 2026-12-06 on the shared 2-core dev box): the GEMM path took 0.92-1.03x
// the row kernel's time at 4 rows, 1.49-1.63x less at 16, 1.78-2.09x less at 32 and 2.3-4.4x less at 512. 32, not
// 16: at 2 threads the GEMM path has two parallel regions to the row kernel's one (the dequantization, then the
// GEMM's), each a wait on a descheduled thread on a busy machine, so it starts where its margin is about 2x.
// Against the batch tiles (run_batch, which replaced that row kernel; --crossover --threads 2, 2026-12-07 on an
// AVX2-only host, benchmarks/results/prefill_crossover_avx2_t2.json) the GEMM path was 1.01-1.21x faster at 32
// rows and 1.24-1.46x at 48 (an earlier run that hour, in a slower phase of the machine: 0.72-0.81x at 32, even
// at 48-64), so 32 stays.
constexpr int64_t GEMM_MIN_ROWS = 32;
constexpr int64_t GEMM_TILE_FLOATS = int64_t(1) << 20;  // 4 MiB of dequantized weights a tile (SmolLM2: one tile)

// Rows n0 .. n0 + rows - 1 of the packed matrix as floats into w (rows, K), the rows split across threads; QB bytes
// and NG groups per packed row. These are exactly layers/packed.py's dequantize() values, bit for bit: d is a
// float16 (11 significant bits) and q < 2^8, so d q is exact in float32 (19 of 24 bits), and dequant_row's
// fused multiply-add and torch's mul-then-add both round only the sum (c = -2^(bits-1) d is exact too).
template <int BITS>
inline void dequant_rows(const uint8_t *qp, const at::Half *sp, const at::Half *zp, int64_t n0, int64_t rows,
                         int64_t K, int64_t G, int64_t QB, int64_t NG, float *w) {
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(1, K)), [&](int64_t r0, int64_t r1) {
    std::vector<float> sf(NG), zf(NG);
    for (int64_t r = r0; r < r1; ++r) {
      half_to_float(sp + (n0 + r) * NG, sf.data(), NG);
      if (zp) half_to_float(zp + (n0 + r) * NG, zf.data(), NG);
      dequant_row<BITS>(qp + (n0 + r) * QB, sf.data(), zp ? zf.data() : nullptr, K, G, w + r * K);
    }
  });
}

template <int BITS>
torch::Tensor run_gemm(const torch::Tensor &x, const torch::Tensor &q, const torch::Tensor &s, const torch::Tensor &z,
                       int64_t G) {
  const int64_t M = x.size(0), K = x.size(1), N = q.size(0), NG = s.size(1), QB = q.size(1);
  const at::Half *sp = s.data_ptr<at::Half>(), *zp = z.defined() ? z.data_ptr<at::Half>() : nullptr;
  const int64_t tile = std::max<int64_t>(1, std::min(N, GEMM_TILE_FLOATS / std::max<int64_t>(1, K)));
  auto w = torch::empty({tile, K}, x.options());  // (tile, K) float32: the dequantized rows of one tile
  auto y = torch::empty({M, N}, x.options());  // (M, N)
  for (int64_t n0 = 0; n0 < N; n0 += tile) {
    const int64_t rows = std::min(tile, N - n0);
    dequant_rows<BITS>(q.data_ptr<uint8_t>(), sp, zp, n0, rows, K, G, QB, NG, w.data_ptr<float>());
    auto wt = w.narrow(0, 0, rows).t();  // (K, rows)
    if (rows == N) {
      at::mm_out(y, x, wt);  // (M, N): the whole matrix in one tile
    } else {
      auto ys = y.narrow(1, n0, rows);  // (M, rows), row stride N: the GEMM writes it in place
      at::mm_out(ys, x, wt);
    }
  }
  return y;
}

// The packed matrix as float32 (N, K), exactly layers/packed.py's dequantize() (the GEMM path's values).
inline torch::Tensor packed_dequantize(torch::Tensor q, torch::Tensor s, c10::optional<torch::Tensor> z, int64_t bits,
                                       int64_t K, int64_t group) {
  TORCH_CHECK(q.dtype() == torch::kUInt8 && q.is_contiguous() && q.size(1) * 8 == K * bits,
              "q: contiguous (N, K bits/8) uint8");
  TORCH_CHECK(s.dtype() == torch::kFloat16 && s.is_contiguous(), "scales: contiguous float16");
  const torch::Tensor zz = z.has_value() ? z->contiguous() : torch::Tensor();
  const at::Half *zp = zz.defined() ? zz.data_ptr<at::Half>() : nullptr;
  const int64_t N = q.size(0);
  auto w = torch::empty({N, K}, torch::kFloat32);  // (N, K)
  if (bits == 8)
    dequant_rows<8>(q.data_ptr<uint8_t>(), s.data_ptr<at::Half>(), zp, 0, N, K, group, q.size(1), s.size(1),
                    w.data_ptr<float>());
  else
    dequant_rows<4>(q.data_ptr<uint8_t>(), s.data_ptr<at::Half>(), zp, 0, N, K, group, q.size(1), s.size(1),
                    w.data_ptr<float>());
  return w;
}

// -- int8 activations (PackedLinear.x8; --weights ...+a8): approximate, llama.cpp's way ---------------------------
// Each row of x is rounded to int8 per weight group before the matmul: m = max|x| over the group, a = round(x 127/m)
// (ties to even; a = 0 where m = 0), and the group's x is s a with s = m/127; llama.cpp rounds activations the same
// way (per 32, its q8_0) for its integer dot products. y is then exactly that rounded x times the dequantized W, on
// every path: up to X8_MAX_ROWS rows of x, on a CPU with AVX-512 VNNI, the integer kernel below computes the sums in
// int32 (the float path's values to float32 rounding); elsewhere the rounded x (M, K) goes through the float paths.

// Row x (K) rounded per group of G: a (K) int8 codes, s (NG) their scales, as (NG) s Σ a, xr (K) = s a as floats
inline void round_x8(const float *x, int64_t K, int64_t G, int8_t *a, float *s, float *as, float *xr) {
  for (int64_t k0 = 0, g = 0; k0 < K; k0 += G, ++g) {
    const int64_t len = std::min(G, K - k0);
    float m = 0.f;
    for (int64_t j = 0; j < len; ++j) m = std::max(m, std::fabs(x[k0 + j]));
    const float inv = m > 0.f ? 127.f / m : 0.f, sg = m / 127.f;
    int32_t sum = 0;
    for (int64_t j = 0; j < len; ++j) {
      const int32_t v = int32_t(std::nearbyint(x[k0 + j] * inv));  // |v| <= 127: x inv <= 127 in float
      a[k0 + j] = int8_t(v);
      xr[k0 + j] = sg * float(v);
      sum += v;
    }
    s[g] = sg;
    as[g] = sg * float(sum);
  }
}

#if defined(__AVX512VNNI__) && defined(__AVX512F__)
#define KVWALL_X8 1
// Rows of x up to which the integer kernel runs; from there the rounded x takes the float paths (batch tiles, GEMM).
// Gemma 3 270M's 73 packed matrices, one call each, median of 5, in one process, exact against int8 activations
// (2026-12-07, 2-core Xeon with VNNI, an observation): 1 row 30.0 -> 16.7 ms, 2 rows 25.9 -> 24.5, 3 rows 27.3 ->
// 31.5, 4 rows 28.2 -> 30.9. From 3 rows the batch tiles' one FMA per weight and row of x beats the integer
// step's convert, permute and FMA per 16 lanes and row (port 0 carries vpdpbusd, the convert and half the FMAs).
constexpr int64_t X8_MAX_ROWS = 2;
// Whether the integer kernel takes this shape: whole 4-byte lanes, each inside one group (a group's bytes, G bits/8,
// a multiple of 4), whole groups; a row's last 64-byte step may be part of one (SmolLM2's 576 4-bit codes: 288 bytes)
inline bool x8_fits(int bits, int64_t K, int64_t G) {
  const int64_t gb = G * bits / 8;
  return (bits == 8 || bits == 4) && G % 2 == 0 && gb % 4 == 0 && K % G == 0;
}

// Row m of x, rounded (round_x8) and laid out in the codes' byte order: lo (and, 4-bit, hi) QB bytes, off the
// symmetric offset of each 4-byte lane (QB/4, then 16 zeros), s and as per group (NG)
struct X8Rows {
  int64_t QB, NG;
  std::vector<int8_t> lo, hi;
  std::vector<int32_t> off;
  const float *s, *as;
  const int8_t *lo_(int64_t m) const { return lo.data() + m * QB; }
  const int8_t *hi_(int64_t m) const { return hi.empty() ? nullptr : hi.data() + m * QB; }
  const int32_t *off_(int64_t m) const { return off.data() + m * (QB / 4 + 16); }
};

// y[m] (MM rows of x against one packed row) = Σ_g d_g s_mg Σ_{k in g} (q_k - OFF) a_mk (symmetric), or
// Σ_g d_g s_mg Σ q_k a_mk + c_g as_mg with zeros c_g. 64 bytes of codes a step, loaded once for the MM rows (1, 2):
// vpdpbusd multiplies unsigned codes by signed activations four at a time into 16 int32 lanes. 8-bit: one code a
// byte, against lo. 4-bit: byte j of a group holds element j (low nibble, against lo) and j + G/2 (high nibble,
// against hi), two vpdpbusd into the same lanes. Symmetric, each lane's OFF Σ a (off) comes off in int32, so the sum
// is exact where subtracting OFF d Σ s a in float at the end cancelled to a few ulps of the group's Σ|x| (a row
// whose true y was 0 came out 5e-7). Lane l of step j lies in group (64 j + 4 l) / gb (gb = a group's bytes), so the
// lanes are scaled by d_g s_g permuted out of the 16 groups a window holds (perm: gb/4 index vectors, one per step
// of a window): 7 instructions per 64 8-bit weights and row of x, where the float kernel (fused_rows) spends 12
// and a group's scale FMA. Each row of x keeps two accumulators (even and odd steps), so its FMAs do not chain.
template <int BITS, int MM>
inline void x8_rows(const X8Rows &x, int64_t m0, const uint8_t *q, const float *sf, const float *cf, int64_t gb,
                    const __m512i *perm, float *y, int64_t ldy) {
  __m512 acc[MM][2];
  for (int m = 0; m < MM; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
  const __m512i nib = _mm512_set1_epi8(15);
  const __mmask64 all = ~__mmask64(0);
  for (int64_t g0 = 0; g0 < x.NG; g0 += 16) {
    const int64_t n = std::min<int64_t>(16, x.NG - g0), steps = n * gb / 64, rest = n * gb % 64;
    const __mmask16 live = __mmask16((1u << n) - 1);
    const __m512 d = _mm512_maskz_loadu_ps(live, sf + g0);
    __m512 ds[MM];  // d_g s_mg for the window's 16 groups
    for (int m = 0; m < MM; ++m) ds[m] = _mm512_mul_ps(d, _mm512_maskz_loadu_ps(live, x.s + (m0 + m) * x.NG + g0));
    const int64_t b0 = g0 * gb;  // the window's first byte of codes (and of lo, hi)
    // step j into the accumulators `e`; bytes past mask k read as 0 (a row's last, part step)
    auto step = [&](int64_t j, __mmask64 k, int e) {
      const int64_t b = b0 + 64 * j;
      const __m512i c = _mm512_maskz_loadu_epi8(k, q + b);
      __m512i clo = c, chi = c;
      if constexpr (BITS == 4) clo = _mm512_and_si512(c, nib), chi = _mm512_and_si512(_mm512_srli_epi16(c, 4), nib);
      for (int m = 0; m < MM; ++m) {
        __m512i t = _mm512_dpbusd_epi32(_mm512_setzero_si512(), clo, _mm512_maskz_loadu_epi8(k, x.lo_(m0 + m) + b));
        if constexpr (BITS == 4) t = _mm512_dpbusd_epi32(t, chi, _mm512_maskz_loadu_epi8(k, x.hi_(m0 + m) + b));
        if (!cf) t = _mm512_sub_epi32(t, _mm512_loadu_si512(x.off_(m0 + m) + b / 4));  // 0 past the row's lanes
        acc[m][e] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), _mm512_permutexvar_ps(perm[j], ds[m]), acc[m][e]);
      }
    };
    int64_t j = 0;
    for (; j + 2 <= steps; j += 2) step(j, all, 0), step(j + 1, all, 1);  // constant e: acc stays in registers
    if (j < steps) step(j, all, 0);
    if (rest) step(steps, (__mmask64(1) << rest) - 1, 1);  // perm[steps] < 16: any group's d s
  }
  for (int m = 0; m < MM; ++m) {
    const __m512 t = _mm512_add_ps(acc[m][0], acc[m][1]);
    y[m * ldy] = vsum(cf ? _mm512_add_ps(t, dot_groups(cf, x.as + (m0 + m) * x.NG, x.NG)) : t);  // + Σ_g c_g as_mg
  }
}

// One or two rows of x (M <= X8_MAX_ROWS) rounded (a (M, K) codes, s and as (M, NG)) against every packed row: the
// threads split the packed rows, as run_one's do
template <int BITS>
inline torch::Tensor run_x8(const int8_t *a, const float *s, const float *as, int64_t M, const torch::Tensor &q,
                            const torch::Tensor &sc, const torch::Tensor &z, int64_t K, int64_t G) {
  constexpr int32_t OFF = 1 << (BITS - 1);
  TORCH_CHECK(M >= 1 && M <= X8_MAX_ROWS, "run_x8 takes 1 to X8_MAX_ROWS rows of x");
  const int64_t N = q.size(0), NG = sc.size(1), QB = q.size(1), gb = G * BITS / 8;
  auto y = torch::empty({M, N}, torch::kFloat32);  // (M, N)
  std::vector<__m512i> perm(gb / 4);  // step j of a window: lane l -> group (64 j + 4 l) / gb
  for (int64_t j = 0; j < gb / 4; ++j) {
    alignas(64) int32_t idx[16];
    for (int l = 0; l < 16; ++l) idx[l] = int32_t((64 * j + 4 * l) / gb);
    perm[j] = _mm512_load_si512(idx);
  }
  // the activations in the codes' byte order: 8-bit, a itself; 4-bit, byte i of group g holds elements g G + i
  // (lo) and g G + G/2 + i (hi)
  X8Rows x{QB, NG, std::vector<int8_t>(a, a + M * K), {}, std::vector<int32_t>(M * (QB / 4 + 16), 0), s, as};
  if (BITS == 4) {
    x.hi.resize(M * QB);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t b = 0; b < QB; ++b) {
        const int64_t g = b / gb, i = b % gb;
        x.lo[m * QB + b] = a[m * K + g * G + i], x.hi[m * QB + b] = a[m * K + g * G + G / 2 + i];
      }
  }
  for (int64_t m = 0; m < M; ++m) {
    const int8_t *lo = x.lo_(m), *hi = x.hi_(m);
    int32_t *off = x.off.data() + m * (QB / 4 + 16);
    for (int64_t l = 0; l < QB / 4; ++l) {
      int32_t t = 0;
      for (int64_t b = 4 * l; b < 4 * l + 4; ++b) t += lo[b] + (hi ? hi[b] : 0);
      off[l] = OFF * t;
    }
  }
  const uint8_t *qp = q.data_ptr<uint8_t>();
  const at::Half *sp = sc.data_ptr<at::Half>(), *zp = z.defined() ? z.data_ptr<at::Half>() : nullptr;
  float *yp = y.data_ptr<float>();
  at::parallel_for(0, N, std::max<int64_t>(1, 65536 / (K * M)), [&](int64_t n0, int64_t n1) {
    std::vector<float> sf(NG), cf(NG);
    for (int64_t n = n0; n < n1; ++n) {
      half_to_float(sp + n * NG, sf.data(), NG);
      if (zp) half_to_float(zp + n * NG, cf.data(), NG);
      const uint8_t *qn = qp + n * QB;
      const float *c = zp ? cf.data() : nullptr;
      if (M == 2)
        x8_rows<BITS, 2>(x, 0, qn, sf.data(), c, gb, perm.data(), yp + n, N);
      else
        x8_rows<BITS, 1>(x, 0, qn, sf.data(), c, gb, perm.data(), yp + n, N);
    }
  });
  return y;
}
#endif

// x (M, K) float32 contiguous; q (N, K bits/8) uint8; s, z (N, ceil(K/G)) float16 (z undefined: symmetric).
// gemm_rows: the GEMM path from that many rows on; -1: from GEMM_MIN_ROWS; 0: never (the row kernel at every M, the
// path before the GEMM one: benchmarks/bench_prefill.py times both).
inline torch::Tensor packed_linear(torch::Tensor x, torch::Tensor q, torch::Tensor s, c10::optional<torch::Tensor> z,
                                   int64_t bits, int64_t group, int64_t gemm_rows = -1, bool x8 = false) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.is_contiguous() && x.dim() == 2, "x: contiguous (M, K) float32");
  TORCH_CHECK(q.dtype() == torch::kUInt8 && q.is_contiguous(), "q: contiguous uint8");
  TORCH_CHECK(s.dtype() == torch::kFloat16 && s.is_contiguous(), "scales: contiguous float16");
  TORCH_CHECK(q.size(1) * 8 == x.size(1) * bits, "q's row bytes do not match K");
  const torch::Tensor zz = z.has_value() ? z->contiguous() : torch::Tensor();
  if (x8) {  // x rounded to int8 per group (round_x8), then the integer kernel or the float paths on the rounded x
    const int64_t M = x.size(0), K = x.size(1), NG = s.size(1);
    std::vector<int8_t> a(M * K);
    std::vector<float> xs(M * NG), as(M * NG);
    auto xr = torch::empty_like(x);  // (M, K) the rounded rows as floats
    for (int64_t m = 0; m < M; ++m)
      round_x8(x.data_ptr<float>() + m * K, K, group, a.data() + m * K, xs.data() + m * NG, as.data() + m * NG,
               xr.data_ptr<float>() + m * K);
#ifdef KVWALL_X8
    if (M <= X8_MAX_ROWS && x8_fits(bits, K, group))
      return bits == 8 ? run_x8<8>(a.data(), xs.data(), as.data(), M, q, s, zz, K, group)
                       : run_x8<4>(a.data(), xs.data(), as.data(), M, q, s, zz, K, group);
#endif
    return packed_linear(xr, q, s, z, bits, group, gemm_rows, false);
  }
#ifdef KVWALL_FUSED
  if (x.size(0) == 1 && fused_fits(bits, x.size(1), group)) return bits == 8 ? run_one<8>(x, q, s, zz, group)
                                                                            : run_one<4>(x, q, s, zz, group);
#endif
  TORCH_CHECK(bits == 8 || bits == 4, "bits must be 4 or 8");
  if (gemm_rows < 0) gemm_rows = GEMM_MIN_ROWS;
  if (gemm_rows > 0 && x.size(0) >= gemm_rows) return bits == 8 ? run_gemm<8>(x, q, s, zz, group)
                                                            : run_gemm<4>(x, q, s, zz, group);
#ifdef KVWALL_FUSED
  if (fused_fits(bits, x.size(1), group)) return bits == 8 ? run_batch<8>(x, q, s, zz, group)
                                                           : run_batch<4>(x, q, s, zz, group);
#endif
  if (bits == 8) return run<8>(x, q, s, zz, group);
  return run<4>(x, q, s, zz, group);
}
