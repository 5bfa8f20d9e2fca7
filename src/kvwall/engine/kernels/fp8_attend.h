// Decode attention over float8_e4m3fn K/V pools read in place (the fp8 cache, caches/fp8.py), and the rounding
// of a new token into them. The walk is common.h's attend_job's (block tables, windows, GQA groups); each run of
// up to FP8_TILE tokens of a block is converted to floats once (quant_unpack.h's e4m3_to_float, exact) and then
// multiplied as fp32, so the cache is read at one byte an element instead of four.
#pragma once
#include "quant_unpack.h"

constexpr int64_t FP8_TILE = 64;  // tokens converted at once: 64 x 64-wide heads = 16 KiB of floats, in L1

constexpr float E4M3_MAX = 448.f;  // the largest finite e4m3fn (caches/fp8.py: E4M3_MAX)

// x rounded as caches/fp8.py writes it: clamped to +-448 (e4m3fn has no infinity: an overflow would be NaN),
// then torch's cast to float8_e4m3fn (c10's round to nearest even) -> its byte
inline uint8_t to_e4m3(float x) { return c10::Float8_e4m3fn(std::min(std::max(x, -E4M3_MAX), E4M3_MAX)).x; }

// attend_part (common.h) with kp (NB, H, bs, D) and vp (NB, H, bs, Dv) holding e4m3 bytes: the rep query heads
// qq (rep, D) over the row's tokens [a, e) -> o, m, l unnormalised. s: scores scratch; buf: conversions.
inline void attend_part_fp8(const float *qq, int64_t rep, int64_t D, int64_t Dv, const uint8_t *kp, const uint8_t *vp,
                            const int64_t *blk, int64_t H, int64_t h, int64_t bs, int64_t a, int64_t e, float scale,
                            float *o, float *m, float *l, std::vector<float> &s, std::vector<float> &buf) {
  const int64_t N = e - a;
  clear_part(o, m, l, rep, Dv);
  if (N <= 0) return;
  s.assign(rep * N, 0.f);  // (rep, N) scores, then weights
  buf.resize(FP8_TILE * std::max(D, Dv));
  // the runs [t0, t1) of consecutive tokens: within one block, at most FP8_TILE long
  auto run_end = [&](int64_t t0) { return std::min({e, (t0 / bs + 1) * bs, t0 + FP8_TILE}); };
  auto at = [&](int64_t t) { return (blk[t / bs] * H + h) * bs + t % bs; };  // token t's slot in the pool
  for (int64_t t0 = a; t0 < e;) {
    const int64_t t1 = run_end(t0);
    e4m3_to_float(kp + at(t0) * D, buf.data(), (t1 - t0) * D);  // (t1 - t0, D) keys
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t r = 0; r < rep; ++r) s[r * N + t - a] = dot(qq + r * D, buf.data() + (t - t0) * D, D) * scale;
    t0 = t1;
  }
  for (int64_t r = 0; r < rep; ++r) std::tie(m[r], l[r]) = exp_shifted(s.data() + r * N, 0, N);
  for (int64_t t0 = a; t0 < e;) {
    const int64_t t1 = run_end(t0);
    e4m3_to_float(vp + at(t0) * Dv, buf.data(), (t1 - t0) * Dv);  // (t1 - t0, Dv) values
    for (int64_t r = 0; r < rep; ++r)
      dot_span(s.data() + r * N + t0 - a, buf.data(), Dv, t1 - t0, o + r * Dv, 0, Dv);
    t0 = t1;
  }
}
