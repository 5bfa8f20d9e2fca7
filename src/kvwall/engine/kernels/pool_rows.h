// Decode attention over K/V pools held in a smaller format and read in place: bf16, fp16 and fp8 (e4m3) blocks
// and packed integer blocks (8, 4 or 2 bits). A run of up to ROW_TILE tokens of one block is converted at once into
// an L1-sized buffer, never into a (B, H, S, D) copy, so the pool is read at its own bytes an element (fp8: one
// instead of fp32's four). One walk (attend_rows_part) serves every format: the paged pools of kvwall serve
// (paged_decode.cpp) and the fp8 cache in the fused decode step (decode_stack.cpp, caches/fp8.py).
#pragma once
#include "quant_unpack.h"

constexpr int64_t ROW_TILE = 64;  // tokens converted at once: 64 x 64-wide heads = 16 KiB of floats, in L1

constexpr float E4M3_MAX = 448.f;  // the largest finite e4m3fn (caches/fp8.py: E4M3_MAX)

// x rounded as caches/fp8.py writes it: clamped to +-448 (e4m3fn has no infinity: an overflow would be NaN),
// then torch's cast to float8_e4m3fn (c10's round to nearest even) -> its byte
inline uint8_t to_e4m3(float x) { return c10::Float8_e4m3fn(std::min(std::max(x, -E4M3_MAX), E4M3_MAX)).x; }

// n bf16 values to fp32: bf16 is fp32's top half, a 16-bit shift, exact (fp16: quant_unpack.h's half_to_float)
inline void bf16_to_float(const uint16_t *__restrict p, float *__restrict out, int64_t n) {
  uint32_t *o = reinterpret_cast<uint32_t *>(out);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) o[i] = uint32_t(p[i]) << 16;
}

// One side (K or V) of a float pool of 16- or 8-bit elements: token slot i's `width` values start at p + i * width.
// rows() converts `run` consecutive slots to (run, width) fp32.
template <class T>
struct FloatRows {
  static constexpr bool folded = false;
  const T *p;
  int64_t width;
  void rows(int64_t slot, int64_t run, float *buf) const {
    if constexpr (std::is_same_v<T, uint16_t>) bf16_to_float(p + slot * width, buf, run * width);
    else if constexpr (std::is_same_v<T, at::Half>) half_to_float(p + slot * width, buf, run * width);
    else e4m3_to_float(p + slot * width, buf, run * width);  // uint8_t: fp8 e4m3fn codes
  }
};

// One side of an integer pool, caches/quant.py's layout per token: `width` values in groups of gs, packed
// little end first (width * BITS / 8 bytes), an fp16 scale and (asymmetric) an fp16 zero point per group;
// x = z + s * c, or, symmetric (z null), s * (c - 2^(BITS-1)): z = -2^(BITS-1) s.
template <int BITS>
struct IntRows {
  static constexpr bool folded = true;  // values: scales folded into the weights, zero points summed apart
  const uint8_t *q;
  const at::Half *s, *z;
  int64_t width, gs, NG;
  float zero(int64_t slot, int64_t g, float sc) const {
    return z ? float(z[slot * NG + g]) : -float(1 << (BITS - 1)) * sc;
  }
  void codes(int64_t slot, int64_t run, float *buf) const { unpack<BITS>(q + slot * width * BITS / 8, buf, run * width); }
  void rows(int64_t slot, int64_t run, float *buf) const {  // dequantized, (run, width): z + s c, in registers
    codes(slot, run, buf);
    for (int64_t i = 0; i < run; ++i)
      for (int64_t g = 0; g < NG; ++g) {
        const float sc = float(s[(slot + i) * NG + g]), zc = zero(slot + i, g, sc);
        float *x = buf + i * width + g * gs;
        int64_t j = 0;
        for (; j + W <= gs; j += W) at::vec::fmadd(Vec::loadu(x + j), Vec(sc), Vec(zc)).store(x + j);
        for (; j < gs; ++j) x[j] = zc + sc * x[j];
      }
  }
};

// f(std::integral_constant<int, BITS>) for a format's bits (8, 4 or 2): one switch for the integer pools' callers
template <class F>
void with_bits(int64_t bits, F f) {
  if (bits == 8) f(std::integral_constant<int, 8>{});
  else if (bits == 4) f(std::integral_constant<int, 4>{});
  else f(std::integral_constant<int, 2>{});
}

// IntRows over one side of a pool: codes (NB, H, bs, width BITS / 8) uint8, scales s and zero points z (NB, H, bs, G)
// fp16 (z undefined: symmetric)
template <int BITS>
IntRows<BITS> int_rows(const torch::Tensor &codes, const torch::Tensor &s, const torch::Tensor &z, int64_t width) {
  const int64_t NG = s.size(3);
  return {codes.data_ptr<uint8_t>(), s.data_ptr<at::Half>(), z.defined() ? z.data_ptr<at::Half>() : nullptr, width,
          width / NG, NG};
}

// One token's `width` values x written as IntRows reads them, bit for bit what caches/quant.py's quantize writes:
// the same fp32 operations in the same order, fp16 rounding by c10::Half (to nearest even, as torch's .half()),
// torch.round's ties to even by nearbyint. Per group of gs values: asymmetric (z given) s = fp16(max((hi - lo) /
// (2^BITS - 1), 1e-8)), z = fp16(lo), c = clamp(round((x - z) / s), 0, 2^BITS - 1); symmetric s = fp16(max(max|x| /
// (2^(BITS-1) - 1), 1e-8)), c = clamp(round(x / s), 1 - 2^(BITS-1), 2^(BITS-1) - 1) + 2^(BITS-1). Codes packed
// little end first. Over a constant group s rounds to 0 (1e-8 is below fp16's smallest subnormal) and 0 / 0 is NaN:
// that code is stored as 0, as torch's cast stores it, and read back as z + 0 c either way.
template <int BITS>
void quantize_token(const float *x, int64_t width, int64_t gs, uint8_t *q, at::Half *s, at::Half *z) {
  constexpr int levels = (1 << BITS) - 1, half = 1 << (BITS - 1), per = 8 / BITS;
  std::fill_n(q, width * BITS / 8, uint8_t(0));
  for (int64_t g = 0; g < width / gs; ++g) {
    const float *xg = x + g * gs;
    float lo = xg[0], hi = xg[0], amax = 0.f;
    for (int64_t i = 0; i < gs; ++i) {
      lo = std::min(lo, xg[i]), hi = std::max(hi, xg[i]), amax = std::max(amax, std::abs(xg[i]));
    }
    float zf = 0.f, cmin = float(1 - half), cmax = float(half - 1), shift = float(half);
    if (z) {
      s[g] = at::Half(std::max((hi - lo) / float(levels), 1e-8f));
      z[g] = at::Half(lo);
      zf = float(z[g]), cmin = 0.f, cmax = float(levels), shift = 0.f;
    } else {
      s[g] = at::Half(std::max(amax / float(half - 1), 1e-8f));
    }
    const float sf = float(s[g]);
    for (int64_t i = 0; i < gs; ++i) {
      const float r = std::nearbyint((z ? xg[i] - zf : xg[i]) / sf);
      const int code = r == r ? int(std::min(std::max(r, cmin), cmax) + shift) : 0;
      const int64_t at = g * gs + i;
      q[at / per] |= uint8_t(code << (at % per * BITS));
    }
  }
}

struct RowScratch {  // one thread's buffers
  std::vector<float> s, buf, w, vs, vz, zsum;
};

// attend_part (common.h) over a pool read through K and V (FloatRows, IntRows): kp (NB, H, bs, D) and vp (NB, H,
// bs, Dv) as the Rows read them, blk the row's block table (a contiguous cache: one block of bs = its length); the
// rep query heads qq (rep, D) that read KV head h over the row's tokens [a, e) -> o (rep, Dv), m, l (rep)
// unnormalised (run_pieces merges and normalises them).
template <class Rows>
void attend_rows_part(const float *qq, int64_t rep, int64_t D, int64_t Dv, const Rows &K, const Rows &V,
                      const int64_t *blk, int64_t H, int64_t h, int64_t bs, int64_t a, int64_t e, float scale,
                      float *o, float *m, float *l, RowScratch &sc) {
  const int64_t N = e - a;
  clear_part(o, m, l, rep, Dv);
  if (N <= 0) return;
  sc.s.assign(rep * N, 0.f);  // (rep, N) scores, then weights
  sc.buf.resize(ROW_TILE * std::max(D, Dv));
  float *buf = sc.buf.data();
  auto runs = [&](auto body) {  // the runs [t0, t0 + run) of one block, at most ROW_TILE long, with their first slot
    for (int64_t t0 = a; t0 < e;) {
      const int64_t t1 = std::min({e, (t0 / bs + 1) * bs, t0 + ROW_TILE});
      body(t0, t1 - t0, (blk[t0 / bs] * H + h) * bs + t0 % bs);
      t0 = t1;
    }
  };
  runs([&](int64_t t0, int64_t run, int64_t slot) {  // keys: (run, D) floats, then a dot per query head
    K.rows(slot, run, buf);
    for (int64_t i = 0; i < run; ++i)
      for (int64_t r = 0; r < rep; ++r) sc.s[r * N + t0 + i - a] = dot(qq + r * D, buf + i * D, D) * scale;
  });
  for (int64_t r = 0; r < rep; ++r) std::tie(m[r], l[r]) = exp_shifted(sc.s.data() + r * N, 0, N);
  if constexpr (Rows::folded) {
    // o[j] = Σ_t p[t] (z[t, g] + s[t, g] c[t, j]) = Σ_t (p[t] s[t, g]) c[t, j] + Σ_t p[t] z[t, g], g = j / gs
    const int64_t NG = V.NG, gs = V.gs;
    sc.w.resize(ROW_TILE), sc.vs.resize(ROW_TILE * NG), sc.vz.resize(ROW_TILE * NG);
    sc.zsum.assign(rep * NG, 0.f);
    runs([&](int64_t t0, int64_t run, int64_t slot) {
      V.codes(slot, run, buf);  // (run, Dv) codes
      for (int64_t i = 0; i < run * NG; ++i) {  // the run's scales and zero points, (run, NG)
        sc.vs[i] = float(V.s[slot * NG + i]);
        sc.vz[i] = V.zero(slot + i / NG, i % NG, sc.vs[i]);
      }
      for (int64_t r = 0; r < rep; ++r)
        for (int64_t g = 0; g < NG; ++g) {
          const float *p = sc.s.data() + r * N + t0 - a;
          float zs = 0.f;
          for (int64_t i = 0; i < run; ++i) {
            sc.w[i] = p[i] * sc.vs[i * NG + g];
            zs += p[i] * sc.vz[i * NG + g];
          }
          sc.zsum[r * NG + g] += zs;
          dot_span(sc.w.data(), buf, Dv, run, o + r * Dv, g * gs, (g + 1) * gs);
        }
    });
    for (int64_t r = 0; r < rep; ++r)
      for (int64_t j = 0; j < Dv; ++j) o[r * Dv + j] += sc.zsum[r * NG + j / gs];
  } else {
    runs([&](int64_t t0, int64_t run, int64_t slot) {
      V.rows(slot, run, buf);  // (run, Dv) floats
      for (int64_t r = 0; r < rep; ++r) dot_span(sc.s.data() + r * N + t0 - a, buf, Dv, run, o + r * Dv, 0, Dv);
    });
  }
}
