// One decode step of the delta rule (Gated DeltaNet, Kimi Delta Attention) and of lightning attention's decayed
// linear state, in place, one (row, head) job per thread (layers/delta_kernel.py says why and how).
#include "common.h"

#if defined(__x86_64__)
#include <xmmintrin.h>
#endif

// Columns of the (dk, dv) state are independent: column j's read kv[j], its correction delta[j] and its output o[j]
// need only column j. So a head is walked in column blocks of U vectors, all dk rows each: pass 1 reads the block
// (kv and the output's old-state part in 2U registers), pass 2 rewrites it from cache while delta stays in
// registers; the state streams from memory once. On AVX-512 (32 registers) a block is a whole 128-wide row (U = 8,
// W = 16), so pass 1 reads the head's 64 KiB front to back and pass 2 rereads it from L2: 0.69-1.0 of one bare
// in-place pass over the same states, where half-rows (U = 4, 32 KiB blocks from L1) made 0.52 and prefetching
// the next head during pass 2 0.54-0.64 (36 Qwen3-Next layers, 1 thread, load 9-12, 2026-12-06; the benchmark
// benchmarks/bench_gated_deltanet_step.py, and these variants against the final one in the same process).
//   S' = a S + k delta^T  (a: exp(g) per key row, one value or dk of them)
//   kv = S_a^T k = S^T (a o k),  delta = beta (v - kv)   [DELTA]   or  delta = v   [lightning]
//   o = S'^T q = S^T (a o q) + (k . q) delta
// Without DELTA nothing waits on a column sum: one pass reads, accumulates and writes.
struct Head {  // one (row, head) job: its state tile, decay, inputs and output
  float *s;                     // (dk, dv) rows ld apart
  int64_t ld, dk, dv;
  const float *a;               // exp(g): a[i * ga], ga 0 (one per head) or 1 (one per key channel)
  int64_t ga;
  const float *ak, *aq, *k, *v;  // a o k, a o q (dk), k (dk), v (dv)
  float beta, qk;               // beta; k . q
  float *o;                     // (dv)
};

template <bool DELTA, int U>
inline void column_block(const Head &hd, int64_t j0) {
  float *s = hd.s;
  const int64_t ld = hd.ld, dk = hd.dk, ga = hd.ga;
  const float *a = hd.a, *ak = hd.ak, *aq = hd.aq, *k = hd.k, *v = hd.v;
  Vec kv[U], oq[U], d[U];
  for (int u = 0; u < U; ++u) kv[u] = oq[u] = Vec(0.f);
  if (DELTA) {
    for (int64_t i = 0; i < dk; ++i) {  // pass 1: read only
      const float *row = s + i * ld + j0;
      const Vec ck(ak[i]), cq(aq[i]);
      for (int u = 0; u < U; ++u) {
        const Vec x = Vec::loadu(row + u * W);
        kv[u] = at::vec::fmadd(ck, x, kv[u]);
        oq[u] = at::vec::fmadd(cq, x, oq[u]);
      }
    }
    for (int u = 0; u < U; ++u) d[u] = Vec(hd.beta) * (Vec::loadu(v + j0 + u * W) - kv[u]);
  } else {
    for (int u = 0; u < U; ++u) d[u] = Vec::loadu(v + j0 + u * W);
  }
  for (int64_t i = 0; i < dk; ++i) {  // pass 2 (lightning: the only pass): S' = a S + k delta^T
    float *row = s + i * ld + j0;
    const Vec ai(a[i * ga]), ki(k[i]), cq(aq[i]);
    for (int u = 0; u < U; ++u) {
      const Vec x = Vec::loadu(row + u * W);
      if (!DELTA) oq[u] = at::vec::fmadd(cq, x, oq[u]);
      at::vec::fmadd(ai, x, ki * d[u]).store(row + u * W);
    }
  }
  for (int u = 0; u < U; ++u) at::vec::fmadd(Vec(hd.qk), d[u], oq[u]).store(hd.o + j0 + u * W);
}

// The columns past the last whole vector, one at a time (dv not a multiple of W: the tests' small heads).
template <bool DELTA>
inline void column_tail(const Head &hd, int64_t j0) {
  float *s = hd.s;
  const int64_t ld = hd.ld, dk = hd.dk, ga = hd.ga;
  const float *a = hd.a, *ak = hd.ak, *aq = hd.aq, *k = hd.k, *v = hd.v;
  for (int64_t j = j0; j < hd.dv; ++j) {
    float kv = 0.f, oq = 0.f;
    for (int64_t i = 0; i < dk; ++i) kv += ak[i] * s[i * ld + j], oq += aq[i] * s[i * ld + j];
    const float d = DELTA ? hd.beta * (v[j] - kv) : v[j];
    for (int64_t i = 0; i < dk; ++i) s[i * ld + j] = a[i * ga] * s[i * ld + j] + k[i] * d;
    hd.o[j] = oq + hd.qk * d;
  }
}

// q, k (B, H, dk), v (B, H, dv), g (B, H, G) the log decay (G = 1: one per head; G = dk: one per key channel),
// beta (B, H) (DELTA only), all contiguous fp32; S (B, H, dk, dv) fp32 with dense rows. S is updated in place.
// -> o (B, H, dv).
template <bool DELTA>
torch::Tensor step(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor g, torch::Tensor beta,
                   torch::Tensor S) {
  TORCH_CHECK(S.dim() == 4 && S.scalar_type() == torch::kFloat && S.stride(3) == 1, "S must be fp32 (B, H, dk, dv)");
  const int64_t B = S.size(0), H = S.size(1), dk = S.size(2), dv = S.size(3), G = g.size(2);
  for (const auto &t : {q, k, v, g})
    TORCH_CHECK(t.is_contiguous() && t.scalar_type() == torch::kFloat, "q, k, v, g must be contiguous fp32");
  TORCH_CHECK(q.size(2) == dk && k.size(2) == dk && v.size(2) == dv && (G == 1 || G == dk), "shapes disagree");
  if (DELTA) TORCH_CHECK(beta.is_contiguous() && beta.scalar_type() == torch::kFloat, "beta must be contiguous fp32");
  auto o = torch::empty({B, H, dv}, q.options());
  const float *pq = q.data_ptr<float>(), *pk = k.data_ptr<float>(), *pv = v.data_ptr<float>();
  const float *pg = g.data_ptr<float>(), *pb = DELTA ? beta.data_ptr<float>() : nullptr;
  float *ps = S.data_ptr<float>(), *po = o.data_ptr<float>();
  const int64_t sb = S.stride(0), sh = S.stride(1), ld = S.stride(2);
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
#if defined(__x86_64__)
    const unsigned int csr = _mm_getcsr();
    _mm_setcsr(csr | 0x8040);  // flush denormals to zero: a state decayed step after step underflows, and denormal
#endif                          // arithmetic is many times slower (values < 1e-38 only)
    std::vector<float> a(G), ak(dk), aq(dk);
    for (int64_t job = begin; job < end; ++job) {
      const int64_t b = job / H, h = job % H;
      const float *qq = pq + job * dk, *kk = pk + job * dk, *gg = pg + job * G;
      for (int64_t i = 0; i < G; ++i) a[i] = std::exp(gg[i]);
      const int64_t ga = G == 1 ? 0 : 1;
      for (int64_t i = 0; i < dk; ++i) ak[i] = a[i * ga] * kk[i], aq[i] = a[i * ga] * qq[i];
      const Head hd{ps + b * sb + h * sh, ld, dk, dv, a.data(), ga, ak.data(), aq.data(), kk, pv + job * dv,
                    DELTA ? pb[job] : 0.f, dot(qq, kk, dk), po + job * dv};
      int64_t j = 0;
      if constexpr (W >= 16)  // 32 vector registers (AVX-512): a 128-wide row in one block, read front to back
        for (; j + 8 * W <= dv; j += 8 * W) column_block<DELTA, 8>(hd, j);
      for (; j + 4 * W <= dv; j += 4 * W) column_block<DELTA, 4>(hd, j);
      for (; j + W <= dv; j += W) column_block<DELTA, 1>(hd, j);
      column_tail<DELTA>(hd, j);
    }
#if defined(__x86_64__)
    _mm_setcsr(csr);
#endif
  });
  return o;
}

torch::Tensor delta_step(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor g, torch::Tensor beta,
                         torch::Tensor S) {
  return step<true>(q, k, v, g, beta, S);
}

torch::Tensor linear_step(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor g, torch::Tensor S) {
  return step<false>(q, k, v, g, torch::Tensor(), S);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("delta_step", &delta_step);
  m.def("linear_step", &linear_step);
}
