// Small ops of a decode step fused into one call each, on the calling thread for a step's few rows:
// the residual add + RMSNorm (layers/norm.py rms_kernel says why) and SwiGLU's silu(gate) * up (layers/mlp.py).
#include "common.h"

// x (..., D) fp32; h: None, or the residual branch to add first (x's shape); w (D,) fp32.
// -> [s, y]: s = x + h (x itself when h is None), y = rms_norm(s) * (offset + w), both (..., D).
std::vector<torch::Tensor> add_rms_norm(torch::Tensor x, c10::optional<torch::Tensor> h, torch::Tensor w,
                                        double eps, double offset) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat, "fp32 only");
  const int64_t D = x.size(-1);
  TORCH_CHECK(w.dim() == 1 && w.size(0) == D, "the weight must be (D,) for x (..., D)");
  x = x.contiguous();
  w = w.contiguous();
  torch::Tensor s = x;
  if (h.has_value()) {
    TORCH_CHECK(h->sizes() == x.sizes() && h->scalar_type() == at::kFloat, "h must be fp32 and shaped like x");
    s = torch::empty_like(x);
  }
  auto y = torch::empty_like(x);
  const torch::Tensor hc = h.has_value() ? h->contiguous() : torch::Tensor();
  const float *px = x.data_ptr<float>(), *pw = w.data_ptr<float>();
  const float *ph = h.has_value() ? hc.data_ptr<float>() : nullptr;
  float *ps = s.data_ptr<float>(), *py = y.data_ptr<float>();
  const int64_t rows = D ? x.numel() / D : 0;
  // a decode step's few rows run on the calling thread: waking the pool costs more than the row (~1 us)
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(D, 1)), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float *xr = px + r * D;
      if (ph) {  // s = x + h, then normalise s
        float *sr = ps + r * D;
        const float *hr = ph + r * D;
        int64_t i = 0;
        for (; i + W <= D; i += W) (Vec::loadu(xr + i) + Vec::loadu(hr + i)).store(sr + i);
        for (; i < D; ++i) sr[i] = xr[i] + hr[i];
        xr = sr;
      }
      norm_row(xr, pw, py + r * D, D, float(eps), float(offset));
    }
  });
  return {s, y};
}

// gu (..., 2F) fp32: [gate, up] side by side, as the fused w13 projection returns them -> (..., F) silu(gate) * up,
// silu(g) = g / (1 + exp(-g)).
torch::Tensor silu_mul(torch::Tensor gu) {
  TORCH_CHECK(gu.scalar_type() == at::kFloat, "fp32 only");
  TORCH_CHECK(gu.size(-1) % 2 == 0, "gate and up must be the same width");
  gu = gu.contiguous();
  const int64_t F = gu.size(-1) / 2, rows = F ? gu.numel() / (2 * F) : 0;
  auto sizes = gu.sizes().vec();
  sizes.back() = F;
  auto y = torch::empty(sizes, gu.options());
  const float *pg = gu.data_ptr<float>();
  float *py = y.data_ptr<float>();
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(F, 1)), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) gate_row(pg + r * 2 * F, pg + r * 2 * F + F, py + r * F, F, false);
  });
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("add_rms_norm", &add_rms_norm, "residual add + RMSNorm (fp32)");
  m.def("silu_mul", &silu_mul, "silu(gate) * up (fp32)");
}
