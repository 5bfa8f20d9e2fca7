// y = x W^T with W held packed (layers/packed.py says the layout): never dequantized as a whole.
//
// By rows of x: at 1, run_one (d Σxq + c Σx per group, each code converted and multiplied once); at a few,
// run_batch (each weight dequantized in a register, w = d q + c, and multiplied into four rows of x); from
// GEMM_MIN_ROWS, run_gemm (tiles dequantized to float32, then torch's GEMM). run<> is what a shape whose groups do
// not split into whole vectors takes at any rows below GEMM_MIN_ROWS: R rows dequantized into an L1 buffer, then
// every row of x over them. Each weight is read from memory once a call, as bits/8 bytes. With int8 activations
// (x8, approximate), x is rounded per group first (round_x8) and, on AVX-512 VNNI with the codes' second, tiled
// layout (x8_tiles), run_x8 takes the integer dot products at every number of rows.
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
// every path: on a CPU with AVX-512 VNNI, given the codes' tiles, the integer kernel below computes the sums in
// int32 (the float path's values to float32 rounding); elsewhere the rounded x (M, K) goes through the float paths.

// Row x (K) rounded per group of G: a (K) int8 codes, s (NG) their scales, as (NG) s Σ a, xr (K) = s a as floats
// (null: not wanted, the integer kernel reads a)
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
      if (xr) xr[k0 + j] = sg * float(v);
      sum += v;
    }
    s[g] = sg;
    as[g] = sg * float(sum);
  }
}

// x rounded (round_x8) and laid out in the codes' byte order: per row, lo (and, 4-bit, hi) QB bytes: byte b of a
// group holds element b (8-bit), or elements b (low nibble, lo) and b + G/2 (high nibble, hi); per row and group, s,
// as (s Σ a) and off (Σ a: OFF times it comes off the group's int32 sum, symmetric formats)
struct X8Rows {
  int64_t QB, NG;
  std::vector<int8_t> lo, hi;
  std::vector<float> s, as;
  std::vector<int32_t> off;
};

#if defined(__AVX512VNNI__) && defined(__AVX512F__)
#define KVWALL_X8 1
// The integer kernel reads the codes again in a second layout, 16 packed rows interleaved 4 bytes at a time
// (layers/packed.py x8_tiles: q (N, QB) -> (N/16, QB/4, 16, 4), the scales and zeros (N, NG) -> (N/16, NG, 16)).
// One 64-byte load then holds the same 4 bytes of 16 rows, all in one group (a group's bytes are a multiple of 4),
// so one vpdpbusd against 4 activations broadcast adds 4 products into each of 16 rows' sums, a group's sums stay
// in int32 to its last step, and 5 more instructions (an add, the offset, a convert, a multiply, an FMA) scale 16
// outputs: G/4 vpdpbusd (8-bit; twice as many 4-bit) and 5 per group and row of x, 1.6 per 64 q8_0 weights. The
// codes' own layout put lanes of two groups in one vector and needed a convert, a permute and an FMA per 16 lanes
// (5), and the float batch tiles take 4 FMAs and the weights' unpacking.
constexpr int64_t X8_TILE = 16;  // packed rows interleaved: one int32 lane each
// rows of x per pass over a tile: 4 x 2 int32 sums and 4 outputs in registers. 8 was no faster (Gemma 3's 73
// matrices at 8 rows: 21.7 ms against 19.6; at 16, 38.3 against 31.1; median of 3 interleaved runs, 2 threads,
// 2026-12-07 on the AMD EPYC AVX-512 host, benchmarks/bench_packed_batch.py --activations int8: an observation)
constexpr int X8_ROWS = 4;
// Whether the integer kernel takes this shape: whole 4-byte lanes, each inside one group (a group's bytes, G bits/8,
// a multiple of 4), whole groups
inline bool x8_fits(int bits, int64_t K, int64_t G) {
  const int64_t gb = G * bits / 8;
  return (bits == 8 || bits == 4) && G % 2 == 0 && gb % 4 == 0 && K % G == 0;
}


// MM (1 to X8_ROWS) rows of x, from row m0, against one tile of 16 packed rows: y[m][n] for the tile's n < live.
// t[m][e]: group sums in int32, even and odd steps apart so that the dpbusd latency does not chain.
template <int BITS, int MM>
inline void x8_tile(const X8Rows &x, int64_t m0, const uint8_t *qt, const at::Half *st, const at::Half *zt,
                    int64_t gb, float *y, int64_t ldy, __mmask16 live) {
  constexpr int32_t OFF = 1 << (BITS - 1);
  const int64_t steps = gb / 4;  // 4-byte steps per group
  const __m512i nib = _mm512_set1_epi8(15);
  __m512 acc[MM];
  for (int m = 0; m < MM; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < x.NG; ++g) {
    __m512i t[MM][2];
    for (int m = 0; m < MM; ++m) t[m][0] = t[m][1] = _mm512_setzero_si512();
    const int64_t b0 = g * gb;  // the group's first byte in a row (of codes and of lo, hi)
    auto step = [&](int64_t j, int e) {
      const __m512i c = _mm512_loadu_si512(qt + (b0 + 4 * j) * X8_TILE);  // (16, 4) bytes
      __m512i clo = c, chi = c;
      if constexpr (BITS == 4) clo = _mm512_and_si512(c, nib), chi = _mm512_and_si512(_mm512_srli_epi16(c, 4), nib);
      for (int m = 0; m < MM; ++m) {
        int32_t a;
        std::memcpy(&a, x.lo.data() + (m0 + m) * x.QB + b0 + 4 * j, 4);
        t[m][e] = _mm512_dpbusd_epi32(t[m][e], clo, _mm512_set1_epi32(a));
        if constexpr (BITS == 4) {
          std::memcpy(&a, x.hi.data() + (m0 + m) * x.QB + b0 + 4 * j, 4);
          t[m][e] = _mm512_dpbusd_epi32(t[m][e], chi, _mm512_set1_epi32(a));
        }
      }
    };
    int64_t j = 0;
    for (; j + 2 <= steps; j += 2) step(j, 0), step(j + 1, 1);  // constant e: the sums stay in registers
    if (j < steps) step(j, 0);
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(st + g * X8_TILE)));
    const __m512 c = zt ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(zt + g * X8_TILE)))
                        : _mm512_setzero_ps();
    for (int m = 0; m < MM; ++m) {
      const int64_t mg = (m0 + m) * x.NG + g;
      __m512i sum = _mm512_add_epi32(t[m][0], t[m][1]);
      if (!zt) sum = _mm512_sub_epi32(sum, _mm512_set1_epi32(OFF * x.off[mg]));  // Σ (q - OFF) a, exact
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(d, _mm512_set1_ps(x.s[mg])), acc[m]);
      if (zt) acc[m] = _mm512_fmadd_ps(c, _mm512_set1_ps(x.as[mg]), acc[m]);  // + c_g s Σ a
    }
  }
  for (int m = 0; m < MM; ++m) _mm512_mask_storeu_ps(y + m * ldy, live, acc[m]);
}

// Every row of x (M) against the tiles: the threads split the tiles, and each pass over a tile takes X8_ROWS rows
template <int BITS>
inline torch::Tensor run_x8(const X8Rows &x, int64_t M, int64_t N, const torch::Tensor &qt, const torch::Tensor &st,
                            const torch::Tensor &zt, int64_t G) {
  const int64_t gb = G * BITS / 8, NT = (N + X8_TILE - 1) / X8_TILE;
  TORCH_CHECK(qt.size(0) == NT && qt.numel() == NT * X8_TILE * x.QB, "x8 tiles do not match the codes");
  auto y = torch::empty({M, N}, torch::kFloat32);  // (M, N)
  if (M == 0) return y;  // no rows (an expert no token chose)
  const uint8_t *qp = qt.data_ptr<uint8_t>();
  const at::Half *sp = st.data_ptr<at::Half>(), *zp = zt.defined() ? zt.data_ptr<at::Half>() : nullptr;
  float *yp = y.data_ptr<float>();
  at::parallel_for(0, NT, std::max<int64_t>(1, 16384 / (x.QB * M)), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const uint8_t *q = qp + t * X8_TILE * x.QB;
      const at::Half *s = sp + t * X8_TILE * x.NG, *z = zp ? zp + t * X8_TILE * x.NG : nullptr;
      const int64_t n0 = t * X8_TILE, n = std::min(X8_TILE, N - n0);
      const __mmask16 live = __mmask16((1u << n) - 1);
      int64_t m = 0;
      for (; m + X8_ROWS <= M; m += X8_ROWS) x8_tile<BITS, X8_ROWS>(x, m, q, s, z, gb, yp + m * N + n0, N, live);
      switch (M - m) {
        case 3: x8_tile<BITS, 3>(x, m, q, s, z, gb, yp + m * N + n0, N, live); break;
        case 2: x8_tile<BITS, 2>(x, m, q, s, z, gb, yp + m * N + n0, N, live); break;
        case 1: x8_tile<BITS, 1>(x, m, q, s, z, gb, yp + m * N + n0, N, live); break;
        default: break;
      }
    }
  });
  return y;
}
#endif

// x (M, K) float32 contiguous; q (N, K bits/8) uint8; s, z (N, ceil(K/G)) float16 (z undefined: symmetric).
// gemm_rows: the GEMM path from that many rows on; -1: from GEMM_MIN_ROWS; 0: never (the row kernel at every M, the
// path before the GEMM one: benchmarks/bench_prefill.py times both).
inline torch::Tensor packed_linear(torch::Tensor x, torch::Tensor q, torch::Tensor s, c10::optional<torch::Tensor> z,
                                   int64_t bits, int64_t group, int64_t gemm_rows = -1, bool x8 = false,
                                   c10::optional<torch::Tensor> qt = c10::nullopt,
                                   c10::optional<torch::Tensor> st = c10::nullopt,
                                   c10::optional<torch::Tensor> zt = c10::nullopt) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.is_contiguous() && x.dim() == 2, "x: contiguous (M, K) float32");
  TORCH_CHECK(q.dtype() == torch::kUInt8 && q.is_contiguous(), "q: contiguous uint8");
  TORCH_CHECK(s.dtype() == torch::kFloat16 && s.is_contiguous(), "scales: contiguous float16");
  TORCH_CHECK(q.size(1) * 8 == x.size(1) * bits, "q's row bytes do not match K");
  const torch::Tensor zz = z.has_value() ? z->contiguous() : torch::Tensor();
  if (x8) {  // x rounded to int8 per group (round_x8), then the integer kernel (given its tiles) or the float paths
    const int64_t M = x.size(0), K = x.size(1), NG = s.size(1), QB = q.size(1);
#ifdef KVWALL_X8
    const bool tiles = qt.has_value() && st.has_value() && x8_fits(bits, K, group);
#else
    const bool tiles = false;
#endif
    std::vector<int8_t> a(M * K);
    X8Rows r{QB, NG, {}, {}, std::vector<float>(M * NG), std::vector<float>(M * NG), {}};
    auto xr = tiles ? torch::Tensor() : torch::empty_like(x);  // (M, K) the rounded rows as floats, for the float paths
    for (int64_t m = 0; m < M; ++m)
      round_x8(x.data_ptr<float>() + m * K, K, group, a.data() + m * K, r.s.data() + m * NG, r.as.data() + m * NG,
               tiles ? nullptr : xr.data_ptr<float>() + m * K);
#ifdef KVWALL_X8
    if (tiles) {
      if (bits == 8) {
        r.lo = std::move(a);  // byte b is element b
      } else {  // byte i of group g holds elements g G + i (low nibble) and g G + G/2 + i (high)
        const int64_t gb = group / 2;
        r.lo.resize(M * QB), r.hi.resize(M * QB);
        for (int64_t m = 0; m < M; ++m)
          for (int64_t b = 0; b < QB; ++b) {
            const int64_t g = b / gb, i = b % gb;
            r.lo[m * QB + b] = a[m * K + g * group + i], r.hi[m * QB + b] = a[m * K + g * group + group / 2 + i];
          }
      }
      if (!zt.has_value()) {  // Σ a over each group, for the symmetric offset
        r.off.resize(M * NG);
        for (int64_t m = 0; m < M; ++m)
          for (int64_t g = 0; g < NG; ++g) {
            int32_t t = 0;
            for (int64_t b = g * (QB / NG); b < (g + 1) * (QB / NG); ++b)
              t += r.lo[m * QB + b] + (r.hi.empty() ? 0 : r.hi[m * QB + b]);
            r.off[m * NG + g] = t;
          }
      }
      const torch::Tensor zz = zt.has_value() ? zt->contiguous() : torch::Tensor();
      return bits == 8 ? run_x8<8>(r, M, q.size(0), *qt, *st, zz, group)
                       : run_x8<4>(r, M, q.size(0), *qt, *st, zz, group);
    }
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
