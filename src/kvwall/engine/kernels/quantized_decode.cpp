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
  const auto ps = cut_jobs(B * H, [&](int64_t job) {  // row b's tokens [lo, n + res); nothing: a padding row
    const int64_t b = job / H, p = pp[b];
    const int64_t lo = (window > 0 && p >= 0) ? std::max<int64_t>(0, p - window + 1) : 0;
    return std::pair<int64_t, int64_t>{std::min(lo, pn[b] + pr[b]), pn[b] + pr[b]};
  }, quant_align(L));
  thread_local QuantScratch sc;
  run_pieces(ps, B * H, rep, L.Dv, [&](const Piece &pc, float *o, float *m, float *l) {
    attend_part_bits(bits, L, pc.job / H, pc.job % H, pq + pc.job * rep * D, rep, pc.a, pc.e, pn[pc.job / H],
                     float(scale), o, m, l, sc);
  }, [&](int64_t job) { return py + job * rep * L.Dv; });  // a row holding nothing: zeros, as over empty slots
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("quantized_decode", &quantized_decode); }
