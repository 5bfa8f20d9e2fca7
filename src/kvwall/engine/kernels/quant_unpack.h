// Reading packed K/V in registers, shared by the kernels that attend from quantized or 8-bit float caches:
// unpack<BITS> (8-, 4- and 2-bit integer codes to floats) and e4m3_to_float (fp8 e4m3 bytes to floats).
#pragma once
#include "common.h"
#include <c10/util/Float8_e4m3fn.h>

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

// n fp8 e4m3fn bytes to floats, exactly (torch's float8_e4m3fn -> float32 for every code but NaN, 0x7f/0xff: a
// cache never holds NaN, its writes are clamped to +-448). The code s.eeee.mmm placed as the fp16 bits
// s.0eeee.mmm0000000 is the same number times 2^-8 (fp16's exponent bias 15 against e4m3's 7), for normals and
// subnormals alike; fp16 -> fp32 is one instruction (_mm512_cvtph_ps) where AVX-512 is.
inline void e4m3_to_float(const uint8_t *__restrict p, float *__restrict out, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m256i sign = _mm256_set1_epi16(0x80), rest = _mm256_set1_epi16(0x7f);
  const __m512 two8 = _mm512_set1_ps(256.f);
  for (; i + 16 <= n; i += 16) {
    const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i *>(p + i)));
    const __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(b, sign), 8),
                                      _mm256_slli_epi16(_mm256_and_si256(b, rest), 7));
    _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_cvtph_ps(h), two8));
  }
#endif
  for (; i < n; ++i) out[i] = float(c10::Float8_e4m3fn(p[i], c10::Float8_e4m3fn::from_bits()));
}

// n fp16 values to floats, 16 (AVX-512) or 8 (F16C) at a time: a scalar at::Half -> float conversion is a
// dozen integer instructions, and the quantized kernels convert a scale and a zero point per group.
inline void half_to_float(const at::Half *__restrict p, float *__restrict out, int64_t n) {
  int64_t i = 0;
  const auto *h = reinterpret_cast<const uint16_t *>(p);
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(out + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(h + i))));
#elif defined(__F16C__)
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i *>(h + i))));
#endif
  for (; i < n; ++i) out[i] = float(p[i]);
}
