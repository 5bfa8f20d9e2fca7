// Decode attention straight from the quantized cache's packed bytes (caches/quant_kernel.py says how).
#include "quantized_attend.h"

// q (B, H, rep, D) fp32; the layer's buffers; rk, rv (B, H, slots, D|Dv) fp32 residual; n, res, pos (B,) int64:
// row b's quantized tokens, residual tokens and query position (-1: padding, sees every held token);
// window (0: none). -> (B, H, rep, Dv): softmax(q k / sqrt) v over the tokens each query sees.
torch::Tensor quantized_decode(torch::Tensor q, torch::Tensor kq, torch::Tensor ks, c10::optional<torch::Tensor> kz,
                               torch::Tensor vq, torch::Tensor vs, c10::optional<torch::Tensor> vz, torch::Tensor rk,
                               torch::Tensor rv, torch::Tensor n, torch::Tensor res, torch::Tensor pos,
                               int64_t window, int64_t bits, double scale) {
  for (const auto &t : {q, kq, ks, vq, vs, rk, rv, n, res, pos})
    TORCH_CHECK(t.is_contiguous(), "buffers must be contiguous");
  for (const auto &t : {n, res, pos})
    TORCH_CHECK(t.scalar_type() == at::kLong && t.numel() == q.size(0), "n, res, pos: one int64 per row");
  TORCH_CHECK(bits == 8 || bits == 4 || bits == 2, "bits must be 8, 4 or 2");
  const int64_t B = q.size(0), H = q.size(1), rep = q.size(2), D = q.size(3);
  const QuantKV L = quant_kv(kq, ks, kz ? *kz : torch::Tensor(), vq, vs, vz ? *vz : torch::Tensor(), rk, rv,
                             bits);
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
      attend_head_bits(bits, L, b, h, qq, rep, lo, nb, rb, float(scale), yy);
    }
  });
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("quantized_decode", &quantized_decode); }
