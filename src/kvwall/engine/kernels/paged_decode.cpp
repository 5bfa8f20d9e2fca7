// Decode attention read in place from a paged pool (caches/paged_kernel.py says why and when): fp32 blocks as they
// are; bf16, fp16 and fp8 (e4m3) blocks and packed integer blocks (8, 4 or 2 bits) converted a block's run of
// tokens at a time into an L1-sized buffer, never into a (B, H, S, D) copy.
#include "quant_unpack.h"

// Every block a row reads lies in the pool and its tokens fit its block table.
static void check_tables(const torch::Tensor &table, const torch::Tensor &lengths, int64_t B, int64_t NB, int64_t bs) {
  TORCH_CHECK(table.is_contiguous() && lengths.is_contiguous(), "buffers must be contiguous");
  TORCH_CHECK(table.size(0) == B && lengths.size(0) == B, "one table row and one length per query row");
  const int64_t nb = table.size(1), *tab = table.data_ptr<int64_t>(), *len = lengths.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(len[b] <= nb * bs, "a row holds more tokens than its block table covers");
    for (int64_t i = 0; i < (len[b] + bs - 1) / bs; ++i)
      TORCH_CHECK(tab[b * nb + i] >= 0 && tab[b * nb + i] < NB, "a block table entry lies outside the pool");
  }
}

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

struct Scratch {  // one thread's buffers
  std::vector<float> s, buf, w, vs, vz, zsum;
};

// attend_job (common.h) over a pool whose blocks are read through K and V (FloatRows, IntRows): the rep query heads
// qq (rep, D) that read KV head h over the n tokens a row holds (its new one written: the queries are at position
// n - 1), or the last `window` of them; a block's run of tokens is converted at once, (run, D) floats in L1.
// -> yy (rep, Dv), left as it was for a row holding nothing.
template <class Rows>
void attend_rows_job(const float *qq, int64_t rep, int64_t D, int64_t Dv, const Rows &K, const Rows &V,
                     const int64_t *blk, int64_t H, int64_t h, int64_t bs, int64_t n, int64_t window, float scale,
                     float *yy, Scratch &sc) {
  const int64_t lo = window > 0 ? std::max<int64_t>(0, n - window) : 0, N = n - lo;
  if (N <= 0) return;  // a row holding nothing
  sc.s.assign(rep * N, 0.f);  // (rep, N) scores, then weights
  sc.buf.resize(bs * std::max(D, Dv));
  float *buf = sc.buf.data();
  auto runs = [&](auto body) {  // each block's run [t0, t1) of the tokens seen, with its first slot in the pool
    for (int64_t t0 = lo; t0 < n;) {
      const int64_t t1 = std::min(n, (t0 / bs + 1) * bs);
      body(t0, t1 - t0, (blk[t0 / bs] * H + h) * bs + t0 % bs);
      t0 = t1;
    }
  };
  runs([&](int64_t t0, int64_t run, int64_t slot) {  // keys: (run, D) floats, then a dot per query head
    K.rows(slot, run, buf);
    for (int64_t i = 0; i < run; ++i)
      for (int64_t r = 0; r < rep; ++r) sc.s[r * N + t0 + i - lo] = dot(qq + r * D, buf + i * D, D) * scale;
  });
  std::vector<float> l(rep);
  for (int64_t r = 0; r < rep; ++r) l[r] = exp_shifted(sc.s.data() + r * N, 0, N).second;
  std::fill(yy, yy + rep * Dv, 0.f);
  if constexpr (Rows::folded) {
    // y[j] = Σ_t p[t] (z[t, g] + s[t, g] c[t, j]) = Σ_t (p[t] s[t, g]) c[t, j] + Σ_t p[t] z[t, g], g = j / gs
    const int64_t NG = V.NG, gs = V.gs;
    sc.w.resize(bs), sc.vs.resize(bs * NG), sc.vz.resize(bs * NG);
    sc.zsum.assign(rep * NG, 0.f);
    runs([&](int64_t t0, int64_t run, int64_t slot) {
      V.codes(slot, run, buf);  // (run, Dv) codes
      for (int64_t i = 0; i < run * NG; ++i) {  // the run's scales and zero points, (run, NG)
        sc.vs[i] = float(V.s[slot * NG + i]);
        sc.vz[i] = V.zero(slot + i / NG, i % NG, sc.vs[i]);
      }
      for (int64_t r = 0; r < rep; ++r)
        for (int64_t g = 0; g < NG; ++g) {
          const float *p = sc.s.data() + r * N + t0 - lo;
          float zs = 0.f;
          for (int64_t i = 0; i < run; ++i) {
            sc.w[i] = p[i] * sc.vs[i * NG + g];
            zs += p[i] * sc.vz[i * NG + g];
          }
          sc.zsum[r * NG + g] += zs;
          dot_span(sc.w.data(), buf, Dv, run, yy + r * Dv, g * gs, (g + 1) * gs);
        }
    });
    for (int64_t r = 0; r < rep; ++r)
      for (int64_t j = 0; j < Dv; ++j) yy[r * Dv + j] += sc.zsum[r * NG + j / gs];
  } else {
    runs([&](int64_t t0, int64_t run, int64_t slot) {
      V.rows(slot, run, buf);  // (run, Dv) floats
      for (int64_t r = 0; r < rep; ++r) dot_span(sc.s.data() + r * N + t0 - lo, buf, Dv, run, yy + r * Dv, 0, Dv);
    });
  }
  for (int64_t r = 0; r < rep; ++r)
    for (int64_t j = 0; j < Dv; ++j) yy[r * Dv + j] /= l[r];
}

// Every (row, KV head) job over Rows-read pools -> y (B, H, rep, Dv).
template <class Rows>
void attend_all(const torch::Tensor &q, const Rows &K, const Rows &V, const torch::Tensor &table,
                const torch::Tensor &lengths, int64_t bs, int64_t Dv, int64_t window, double scale, torch::Tensor &y) {
  const int64_t H = q.size(1), rep = q.size(2), D = q.size(3), nb = table.size(1);
  const int64_t *tab = table.data_ptr<int64_t>(), *len = lengths.data_ptr<int64_t>();
  const float *pq = q.data_ptr<float>();
  float *py = y.data_ptr<float>();
  at::parallel_for(0, q.size(0) * H, 1, [&](int64_t begin, int64_t end) {
    Scratch sc;
    for (int64_t job = begin; job < end; ++job) {
      const int64_t b = job / H;
      attend_rows_job(pq + job * rep * D, rep, D, Dv, K, V, tab + b * nb, H, job % H, bs, len[b], window,
                      float(scale), py + job * rep * Dv, sc);
    }
  });
}

// q (B, H, rep, D) fp32: row b's query heads grouped by the KV head they read; kp (NB, H, bs, D) and
// vp (NB, H, bs, Dv) fp32, bf16, fp16 or fp8 e4m3fn (both one dtype): the pool's blocks; table (B, nb) int64: row b's
// position t is in block table[b, t / bs], slot t % bs; lengths (B,) int64: tokens row b holds, its new one written
// already, so its query is at position lengths[b] - 1; window (0: none): that query sees only the last `window`
// tokens. -> (B, H, rep, Dv) fp32: softmax(q k * scale) v over the tokens each query sees (zeros for a row holding none).
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor kp, torch::Tensor vp, torch::Tensor table,
                           torch::Tensor lengths, int64_t window, double scale) {
  for (const auto &t : {q, kp, vp}) TORCH_CHECK(t.is_contiguous(), "buffers must be contiguous");
  TORCH_CHECK(q.scalar_type() == at::kFloat && kp.scalar_type() == vp.scalar_type(),
              "an fp32 query, and K and V pools of one dtype");
  const int64_t B = q.size(0), H = q.size(1), rep = q.size(2), D = q.size(3);
  const int64_t NB = kp.size(0), bs = kp.size(2), Dv = vp.size(3), nb = table.size(1);
  TORCH_CHECK(kp.size(1) == H && kp.size(3) == D && vp.size(0) == NB && vp.size(1) == H && vp.size(2) == bs,
              "the pools do not match the query");
  check_tables(table, lengths, B, NB, bs);
  auto y = torch::zeros({B, H, rep, Dv}, q.options());
  switch (kp.scalar_type()) {
    case at::kFloat: {
      const int64_t *tab = table.data_ptr<int64_t>(), *len = lengths.data_ptr<int64_t>();
      const float *pq = q.data_ptr<float>(), *pk = kp.data_ptr<float>(), *pv = vp.data_ptr<float>();
      float *py = y.data_ptr<float>();
      at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {  // fp32: read where it lies, no buffer
        std::vector<float> s;
        for (int64_t job = begin; job < end; ++job) {
          const int64_t b = job / H;
          attend_job(pq + job * rep * D, rep, D, Dv, pk, pv, tab + b * nb, H, job % H, bs, len[b], window,
                     float(scale), py + job * rep * Dv, s);
        }
      });
      break;
    }
    case at::kBFloat16: {
      auto k = reinterpret_cast<const uint16_t *>(kp.data_ptr<at::BFloat16>());
      auto v = reinterpret_cast<const uint16_t *>(vp.data_ptr<at::BFloat16>());
      attend_all(q, FloatRows<uint16_t>{k, D}, FloatRows<uint16_t>{v, Dv}, table, lengths, bs, Dv, window, scale, y);
      break;
    }
    case at::kHalf:
      attend_all(q, FloatRows<at::Half>{kp.data_ptr<at::Half>(), D}, FloatRows<at::Half>{vp.data_ptr<at::Half>(), Dv},
                 table, lengths, bs, Dv, window, scale, y);
      break;
    case at::kFloat8_e4m3fn: {
      auto k = reinterpret_cast<const uint8_t *>(kp.data_ptr<c10::Float8_e4m3fn>());
      auto v = reinterpret_cast<const uint8_t *>(vp.data_ptr<c10::Float8_e4m3fn>());
      attend_all(q, FloatRows<uint8_t>{k, D}, FloatRows<uint8_t>{v, Dv}, table, lengths, bs, Dv, window, scale, y);
      break;
    }
    default:
      TORCH_CHECK(false, "pools of fp32, bf16, fp16 or fp8 e4m3fn only");
  }
  return y;
}

// The same over an integer pool (serve/runner.py's QuantizedPages, caches/quant.py's layout): kq (NB, H, bs,
// D * bits / 8) uint8 codes, ks (NB, H, bs, D / gk) fp16 scales, kz like ks or None (symmetric); vq, vs, vz likewise
// for the values (Dv wide, groups of gv); bits 8, 4 or 2. -> (B, H, rep, Dv) fp32.
torch::Tensor paged_decode_int(torch::Tensor q, torch::Tensor kq, torch::Tensor ks, c10::optional<torch::Tensor> kz,
                               torch::Tensor vq, torch::Tensor vs, c10::optional<torch::Tensor> vz, torch::Tensor table,
                               torch::Tensor lengths, int64_t window, int64_t bits, double scale) {
  for (const auto &t : {q, kq, ks, vq, vs}) TORCH_CHECK(t.is_contiguous(), "buffers must be contiguous");
  TORCH_CHECK((!kz || (kz->is_contiguous() && kz->sizes() == ks.sizes())) &&
              (!vz || (vz->is_contiguous() && vz->sizes() == vs.sizes())),
              "zero points must be contiguous, shaped as the scales");
  TORCH_CHECK(bits == 8 || bits == 4 || bits == 2, "bits must be 8, 4 or 2");
  TORCH_CHECK(q.scalar_type() == at::kFloat && kq.scalar_type() == at::kByte && vq.scalar_type() == at::kByte &&
              ks.scalar_type() == at::kHalf && vs.scalar_type() == at::kHalf, "fp32 query, uint8 codes, fp16 scales");
  const int64_t B = q.size(0), H = q.size(1), rep = q.size(2), D = q.size(3);
  const int64_t NB = kq.size(0), bs = kq.size(2), Dv = vq.size(3) * 8 / bits, NGk = ks.size(3), NGv = vs.size(3);
  TORCH_CHECK(kq.size(1) == H && kq.size(3) * 8 / bits == D && vq.size(0) == NB && vq.size(1) == H && vq.size(2) == bs,
              "the pools do not match the query");
  TORCH_CHECK(ks.size(0) == NB && ks.size(2) == bs && vs.size(0) == NB && vs.size(2) == bs && D % NGk == 0 &&
              Dv % NGv == 0, "the scales do not match the codes");
  check_tables(table, lengths, B, NB, bs);
  auto y = torch::zeros({B, H, rep, Dv}, q.options());
  auto run = [&](auto tag) {
    constexpr int BITS = decltype(tag)::value;
    const IntRows<BITS> K{kq.data_ptr<uint8_t>(), ks.data_ptr<at::Half>(), kz ? kz->data_ptr<at::Half>() : nullptr,
                          D, D / NGk, NGk};
    const IntRows<BITS> V{vq.data_ptr<uint8_t>(), vs.data_ptr<at::Half>(), vz ? vz->data_ptr<at::Half>() : nullptr,
                          Dv, Dv / NGv, NGv};
    attend_all(q, K, V, table, lengths, bs, Dv, window, scale, y);
  };
  if (bits == 8) run(std::integral_constant<int, 8>{});
  else if (bits == 4) run(std::integral_constant<int, 4>{});
  else run(std::integral_constant<int, 2>{});
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode);
  m.def("paged_decode_int", &paged_decode_int);
}
