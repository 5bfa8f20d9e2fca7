// The fused selective scan of Mamba prefill (layers/scan_kernel.py says why and how).
#include "common.h"

#if defined(__x86_64__)
#include <xmmintrin.h>
#endif

// Vectorised over channels: a block of W channels (one SIMD vector) keeps its N states in registers
// while it walks the tokens; B_t[n], C_t[n] are broadcast. No horizontal sums. NN > 0 fixes N at
// compile time (the common d_state = 16) so the state loop unrolls into registers; NN = 0 is generic.
struct Rows {  // a (B, T, X) tensor whose last dimension is contiguous: element (b, t, x) at b*sb + t*st + x
  const float *p;
  int64_t sb, st;
  const float *at(int64_t b, int64_t t) const { return p + b * sb + t * st; }
};

template <int NN>
void scan_block(int64_t b, int64_t e0, int64_t T, int64_t E, int64_t N, Rows pu, Rows pdt,
                const float *pA, Rows pB, Rows pC, const float *ph, float *py, float *pho) {
  constexpr int64_t AHEAD = 16;
  constexpr int64_t CAP = NN > 0 ? NN : 256;
  const int64_t n_state = NN > 0 ? NN : N;
  Vec hs[CAP], a[CAP];
  float buf[W];
  for (int64_t n = 0; n < n_state; ++n) {
    a[n] = Vec::loadu(pA + n * E + e0);
    for (int64_t w = 0; w < W; ++w) buf[w] = ph[(b * E + e0 + w) * N + n];
    hs[n] = Vec::loadu(buf);
  }
  for (int64_t t = 0; t < T; ++t) {
    const int64_t i = (b * T + t) * E + e0;
    if (t + AHEAD < T) {  // rows are kilobytes apart (a column walk): the hardware prefetcher won't follow
      __builtin_prefetch(pu.at(b, t + AHEAD) + e0, 0, 3);
      __builtin_prefetch(pdt.at(b, t + AHEAD) + e0, 0, 3);
      __builtin_prefetch(py + i + AHEAD * E, 0, 3);
    }
    const Vec d = Vec::loadu(pdt.at(b, t) + e0), du = d * Vec::loadu(pu.at(b, t) + e0);
    const float *bb = pB.at(b, t), *cc = pC.at(b, t);
    Vec acc(0.f);
#pragma GCC unroll 16
    for (int64_t n = 0; n < n_state; ++n) {  // h = exp(d a) h + d u B ; y += C h
      hs[n] = (d * a[n]).exp_u20() * hs[n] + du * Vec(bb[n]);
      acc = acc + hs[n] * Vec(cc[n]);
    }
    acc.store(py + i);
  }
  for (int64_t n = 0; n < n_state; ++n) {
    hs[n].store(buf);
    for (int64_t w = 0; w < W; ++w) pho[(b * E + e0 + w) * N + n] = buf[w];
  }
}

// u, dt: (B, T, E); At: (N, E) = A transposed; Bm, Cm: (B, T, N); h: (B, E, N); float32. u, dt, Bm, Cm may
// be strided views (the model hands over slices of larger projections) as long as their last dim is dense.
std::vector<torch::Tensor> selective_scan(torch::Tensor u, torch::Tensor dt, torch::Tensor At,
                                          torch::Tensor Bm, torch::Tensor Cm, torch::Tensor h) {
  const int64_t B = u.size(0), T = u.size(1), E = u.size(2), N = At.size(0);
  TORCH_CHECK(E % W == 0, "d_inner must be a multiple of ", W);
  TORCH_CHECK(N <= 256, "d_state must be at most 256");
  auto y = torch::empty({B, T, E}, u.options());  // dense (B, T, E), whatever the strides of u
  auto hout = torch::empty_like(h);
  auto rows = [](const torch::Tensor &x) {
    TORCH_CHECK(x.stride(2) == 1, "the last dimension must be dense");
    return Rows{x.data_ptr<float>(), x.stride(0), x.stride(1)};
  };
  const Rows pu = rows(u), pdt = rows(dt), pB = rows(Bm), pC = rows(Cm);
  const float *pA = At.data_ptr<float>(), *ph = h.data_ptr<float>();
  float *py = y.data_ptr<float>(), *pho = hout.data_ptr<float>();
  const int64_t blocks = E / W;
  at::parallel_for(0, B * blocks, 1, [&](int64_t begin, int64_t end) {
#if defined(__x86_64__)
    const unsigned int csr = _mm_getcsr();
    _mm_setcsr(csr | 0x8040);  // flush denormals to zero: exp(ΔA) of a long decay underflows, and
#endif                          // denormal arithmetic would be many times slower (values < 1e-38 only)
    for (int64_t job = begin; job < end; ++job) {
      const int64_t b = job / blocks, e0 = (job % blocks) * W;
      if (N == 16)
        scan_block<16>(b, e0, T, E, N, pu, pdt, pA, pB, pC, ph, py, pho);
      else
        scan_block<0>(b, e0, T, E, N, pu, pdt, pA, pB, pC, ph, py, pho);
    }
#if defined(__x86_64__)
    _mm_setcsr(csr);
#endif
  });
  return {y, hout};
}

// The backward of scan_block for training (kvwall recall). Per block: the forward again, keeping every state in
// `hist` (T + 1 rows of N vectors: h0, then h after each token; 128 KiB at T 256, N 16, W 8), then a reverse
// walk with G = dL/dh in registers:  G_t = G_{t+1} a_{t+1} + gy_t C_t;  X = G_t h_{t-1} a_t (= dL/d(ΔA));
// dΔ = Σ_n X A + (Σ_n G B) u;  du = (Σ_n G B) Δ;  dA += X Δ;  dB_t[n] = Σ_e G Δu;  dC_t[n] = Σ_e gy h_t.
// The Σ_e of dB and dC cross channels: each block writes its own partial sum (B, T, blocks, N), summed in torch;
// dA is per batch row (B, N, E), summed in torch too. No two jobs write the same element.
template <int NN>
void scan_block_backward(int64_t b, int64_t e0, int64_t T, int64_t E, int64_t N, const float *pu,
                         const float *pdt, const float *pA, const float *pB, const float *pC, const float *ph,
                         const float *pgy, const float *pgh, float *hist, float *pgu, float *pgdt, float *pgA,
                         float *pgB, float *pgC, float *pgh0) {
  constexpr int64_t CAP = NN > 0 ? NN : 256;
  const int64_t n_state = NN > 0 ? NN : N, blocks = E / W, blk = e0 / W;
  Vec hs[CAP], a[CAP], g[CAP], gA[CAP];
  float buf[W];
  for (int64_t n = 0; n < n_state; ++n) {
    a[n] = Vec::loadu(pA + n * E + e0);
    for (int64_t w = 0; w < W; ++w) buf[w] = ph[(b * E + e0 + w) * N + n];
    hs[n] = Vec::loadu(buf);
    hs[n].store(hist + n * W);
    for (int64_t w = 0; w < W; ++w) buf[w] = pgh[(b * E + e0 + w) * N + n];
    g[n] = Vec::loadu(buf);
    gA[n] = Vec(0.f);
  }
  for (int64_t t = 0; t < T; ++t) {
    const int64_t i = (b * T + t) * E + e0;
    const Vec d = Vec::loadu(pdt + i), du = d * Vec::loadu(pu + i);
    const float *bb = pB + (b * T + t) * N;
    float *row = hist + (t + 1) * n_state * W;
#pragma GCC unroll 16
    for (int64_t n = 0; n < n_state; ++n) {
      hs[n] = (d * a[n]).exp_u20() * hs[n] + du * Vec(bb[n]);
      hs[n].store(row + n * W);
    }
  }
  for (int64_t t = T - 1; t >= 0; --t) {
    const int64_t i = (b * T + t) * E + e0, o = ((b * T + t) * blocks + blk) * N;
    const Vec d = Vec::loadu(pdt + i), uu = Vec::loadu(pu + i), du = d * uu, gy = Vec::loadu(pgy + i);
    const float *bb = pB + (b * T + t) * N, *cc = pC + (b * T + t) * N;
    const float *now = hist + (t + 1) * n_state * W, *before = hist + t * n_state * W;
    Vec gdt(0.f), gdu(0.f);
    for (int64_t n = 0; n < n_state; ++n) {
      g[n] = g[n] + gy * Vec(cc[n]);  // G_t
      pgC[o + n] = hsum(gy * Vec::loadu(now + n * W));
      const Vec ea = (d * a[n]).exp_u20(), x = g[n] * Vec::loadu(before + n * W) * ea;
      gdt = gdt + x * a[n];
      gA[n] = gA[n] + x * d;
      gdu = gdu + g[n] * Vec(bb[n]);
      pgB[o + n] = hsum(g[n] * du);
      g[n] = g[n] * ea;  // on to h_{t-1}
    }
    (gdt + gdu * uu).store(pgdt + i);
    (gdu * d).store(pgu + i);
  }
  for (int64_t n = 0; n < n_state; ++n) {
    g[n].store(buf);
    for (int64_t w = 0; w < W; ++w) pgh0[(b * E + e0 + w) * N + n] = buf[w];
    gA[n].store(pgA + (b * N + n) * E + e0);
  }
}

// All dense float32: u, dt, gy (B, T, E); At (N, E); Bm, Cm (B, T, N); h, gh (B, E, N).
// -> du, ddt (B, T, E); dA per batch row (B, N, E); dB, dC per channel block (B, T, E / W, N); dh0 (B, E, N).
std::vector<torch::Tensor> selective_scan_backward(torch::Tensor u, torch::Tensor dt, torch::Tensor At,
                                                   torch::Tensor Bm, torch::Tensor Cm, torch::Tensor h,
                                                   torch::Tensor gy, torch::Tensor gh) {
  const int64_t B = u.size(0), T = u.size(1), E = u.size(2), N = At.size(0), blocks = E / W;
  TORCH_CHECK(E % W == 0, "d_inner must be a multiple of ", W);
  TORCH_CHECK(N <= 256, "d_state must be at most 256");
  for (const auto &x : {u, dt, At, Bm, Cm, h, gy, gh}) TORCH_CHECK(x.is_contiguous(), "inputs must be dense");
  auto gu = torch::empty_like(u), gdt = torch::empty_like(u), gh0 = torch::empty_like(h);
  auto gA = torch::empty({B, N, E}, u.options()), gB = torch::empty({B, T, blocks, N}, u.options());
  auto gC = torch::empty({B, T, blocks, N}, u.options());
  const float *pu = u.data_ptr<float>(), *pdt = dt.data_ptr<float>(), *pA = At.data_ptr<float>();
  const float *pB = Bm.data_ptr<float>(), *pC = Cm.data_ptr<float>(), *ph = h.data_ptr<float>();
  const float *pgy = gy.data_ptr<float>(), *pgh = gh.data_ptr<float>();
  float *pgu = gu.data_ptr<float>(), *pgdt = gdt.data_ptr<float>(), *pgA = gA.data_ptr<float>();
  float *pgB = gB.data_ptr<float>(), *pgC = gC.data_ptr<float>(), *pgh0 = gh0.data_ptr<float>();
  at::parallel_for(0, B * blocks, 1, [&](int64_t begin, int64_t end) {
#if defined(__x86_64__)
    const unsigned int csr = _mm_getcsr();
    _mm_setcsr(csr | 0x8040);  // flush denormals to zero, as the forward
#endif
    std::vector<float> hist((T + 1) * N * W);
    for (int64_t job = begin; job < end; ++job) {
      const int64_t b = job / blocks, e0 = (job % blocks) * W;
      if (N == 16)
        scan_block_backward<16>(b, e0, T, E, N, pu, pdt, pA, pB, pC, ph, pgy, pgh, hist.data(), pgu, pgdt, pgA,
                                pgB, pgC, pgh0);
      else
        scan_block_backward<0>(b, e0, T, E, N, pu, pdt, pA, pB, pC, ph, pgy, pgh, hist.data(), pgu, pgdt, pgA,
                               pgB, pgC, pgh0);
    }
#if defined(__x86_64__)
    _mm_setcsr(csr);
#endif
  });
  return {gu, gdt, gA, gB, gC, gh0};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("selective_scan", &selective_scan);
  m.def("selective_scan_backward", &selective_scan_backward);
}
