// Decode attention read in place from a paged pool (caches/paged_kernel.py says why and when).
#include "common.h"

// q (B, H, rep, D) fp32: row b's query heads grouped by the KV head they read; kp (NB, H, bs, D) and
// vp (NB, H, bs, Dv) fp32: the pool's blocks; table (B, nb) int64: row b's position t is in block
// table[b, t / bs], slot t % bs; lengths (B,) int64: tokens row b holds, its new one written already, so its
// query is at position lengths[b] - 1; window (0: none): that query sees only the last `window` tokens.
// -> (B, H, rep, Dv): softmax(q k * scale) v over the tokens each query sees (zeros for a row holding none).
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor kp, torch::Tensor vp, torch::Tensor table,
                           torch::Tensor lengths, int64_t window, double scale) {
  for (const auto &t : {q, kp, vp, table, lengths}) TORCH_CHECK(t.is_contiguous(), "buffers must be contiguous");
  TORCH_CHECK(q.scalar_type() == at::kFloat && kp.scalar_type() == at::kFloat && vp.scalar_type() == at::kFloat,
              "fp32 only");
  const int64_t B = q.size(0), H = q.size(1), rep = q.size(2), D = q.size(3);
  const int64_t NB = kp.size(0), bs = kp.size(2), Dv = vp.size(3), nb = table.size(1);
  TORCH_CHECK(kp.size(1) == H && kp.size(3) == D && vp.size(0) == NB && vp.size(1) == H && vp.size(2) == bs,
              "the pools do not match the query");
  TORCH_CHECK(table.size(0) == B && lengths.size(0) == B, "one table row and one length per query row");
  const int64_t *tab = table.data_ptr<int64_t>(), *len = lengths.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {  // every block a row reads lies in the pool
    TORCH_CHECK(len[b] <= nb * bs, "a row holds more tokens than its block table covers");
    for (int64_t i = 0; i < (len[b] + bs - 1) / bs; ++i)
      TORCH_CHECK(tab[b * nb + i] >= 0 && tab[b * nb + i] < NB, "a block table entry lies outside the pool");
  }
  auto y = torch::zeros({B, H, rep, Dv}, q.options());
  const float *pq = q.data_ptr<float>(), *pk = kp.data_ptr<float>(), *pv = vp.data_ptr<float>();
  float *py = y.data_ptr<float>();
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> s;
    for (int64_t job = begin; job < end; ++job) {
      const int64_t b = job / H;
      attend_job(pq + job * rep * D, rep, D, Dv, pk, pv, tab + b * nb, H, job % H, bs, len[b], window, float(scale),
                 py + job * rep * Dv, s);
    }
  });
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("paged_decode", &paged_decode); }
