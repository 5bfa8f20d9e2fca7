// Absorbed MLA decode attention over the latent cache (layers/latent_kernel.py says how).
#include "common.h"

constexpr int64_t CHUNK = 256;  // tokens per parallel job: their rows stay in L2 while every head reads them

// scores of heads [h, h + 4) for one token: Σ_i q[i] row[i] over the latent and the rope key
inline void four_scores(const float *q, int64_t K, const float *c, int64_t r, const float *pe, int64_t dr,
                        float *out) {
  Vec a[4] = {Vec(0.f), Vec(0.f), Vec(0.f), Vec(0.f)};
  float tail[4] = {0.f, 0.f, 0.f, 0.f};
  auto part = [&](const float *row, int64_t n, int64_t off) {
    int64_t i = 0;
    for (; i + W <= n; i += W) {
      const Vec x = Vec::loadu(row + i);
      for (int k = 0; k < 4; ++k) a[k] = at::vec::fmadd(Vec::loadu(q + k * K + off + i), x, a[k]);
    }
    for (; i < n; ++i)
      for (int k = 0; k < 4; ++k) tail[k] += q[k * K + off + i] * row[i];
  };
  part(c, r, 0);
  part(pe, dr, r);
  for (int k = 0; k < 4; ++k) out[k] = hsum(a[k]) + tail[k];
}

// o[h][0..r) += Σ_t w[h * ws + t] c[t * cs + 0..r) for h < H: four heads x four vectors of c held in registers,
// so each row of c is read H / 4 times (not H) and every load feeds four FMAs.
inline void weighted_rows(const float *w, int64_t ws, int64_t H, const float *c, int64_t cs, int64_t n, int64_t r,
                          float *o) {
  int64_t h = 0;
  for (; h + 4 <= H; h += 4) {
    int64_t j = 0;
    for (; j + 4 * W <= r; j += 4 * W) {
      Vec a[4][4];
      for (int k = 0; k < 4; ++k)
        for (int u = 0; u < 4; ++u) a[k][u] = Vec::loadu(o + (h + k) * r + j + u * W);
      for (int64_t t = 0; t < n; ++t) {
        const float *row = c + t * cs + j;
        const Vec x[4] = {Vec::loadu(row), Vec::loadu(row + W), Vec::loadu(row + 2 * W), Vec::loadu(row + 3 * W)};
        for (int k = 0; k < 4; ++k) {
          const Vec wk(w[(h + k) * ws + t]);
          for (int u = 0; u < 4; ++u) a[k][u] = at::vec::fmadd(wk, x[u], a[k][u]);
        }
      }
      for (int k = 0; k < 4; ++k)
        for (int u = 0; u < 4; ++u) a[k][u].store(o + (h + k) * r + j + u * W);
    }
    for (int k = 0; k < 4; ++k) dot_span(w + (h + k) * ws, c, cs, n, o + (h + k) * r, j, r);
  }
  for (; h < H; ++h) dot_span(w + h * ws, c, cs, n, o + h * r, 0, r);
}

inline float one_score(const float *q, const float *c, int64_t r, const float *pe, int64_t dr) {
  float s = 0.f;
  for (int64_t i = 0; i < r; ++i) s += q[i] * c[i];
  for (int64_t i = 0; i < dr; ++i) s += q[r + i] * pe[i];
  return s;
}

// One job: the n tokens whose latent rows are c[t * cs] (r) and rope keys pe[t * ps] (dr), positions kp[t], for a
// query at position qp with the heads' queries qb (H, r + dr) -> st: per head (max, sum) of the chunk's softmax,
// then per head the sum of its weights times the rows (r). sc: scratch of H * CHUNK scores.
inline void chunk_stats(const float *qb, int64_t H, const float *cb, int64_t cs, const float *pb, int64_t ps,
                        const int64_t *kp, int64_t qp, int64_t n, int64_t r, int64_t dr, float scale, float *sc,
                        float *st) {
  const int64_t K = r + dr;
  for (int64_t t = 0; t < n; ++t) {
    const float *ct = cb + t * cs, *pt = pb + t * ps;
    const bool seen = qp < 0 || (kp[t] >= 0 && kp[t] <= qp);
    float out[4];
    int64_t h = 0;
    for (; h + 4 <= H; h += 4) {
      four_scores(qb + h * K, K, ct, r, pt, dr, out);
      for (int k = 0; k < 4; ++k) sc[(h + k) * CHUNK + t] = out[k];
    }
    for (; h < H; ++h) sc[h * CHUNK + t] = one_score(qb + h * K, ct, r, pt, dr);
    for (h = 0; h < H; ++h)
      sc[h * CHUNK + t] = seen ? sc[h * CHUNK + t] * scale : -std::numeric_limits<float>::infinity();
  }
  for (int64_t h = 0; h < H; ++h) {  // per head: max, sum; then per head: sum_t w[t] c[t]
    const auto ms = exp_shifted(sc + h * CHUNK, 0, n);
    st[2 * h] = ms.first, st[2 * h + 1] = ms.second;
  }
  std::fill(st + 2 * H, st + H * (r + 2), 0.f);
  weighted_rows(sc, CHUNK, H, cb, cs, n, r, st + 2 * H);
}

// Merge the chunks' softmax statistics of each row (the split softmax of flash decoding) -> o_lat (B, H, r).
inline torch::Tensor merge_chunks(const std::vector<float> &stats, int64_t B, int64_t chunks, int64_t H, int64_t r,
                                  const torch::TensorOptions &options) {
  auto o = torch::zeros({B, H, r}, options);
  float *po = o.data_ptr<float>();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h) {
      float top = -std::numeric_limits<float>::infinity(), den = 0.f;
      auto job_stats = [&](int64_t j) { return stats.data() + (b * chunks + j) * H * (r + 2); };
      for (int64_t j = 0; j < chunks; ++j) top = std::max(top, job_stats(j)[2 * h]);
      float *oo = po + (b * H + h) * r;
      if (top == -std::numeric_limits<float>::infinity()) continue;  // nothing visible: zeros
      for (int64_t j = 0; j < chunks; ++j) {
        const float *st = job_stats(j);
        if (st[2 * h + 1] == 0.f) continue;
        const float w = std::exp(st[2 * h] - top);
        den += w * st[2 * h + 1];
        for (int64_t i = 0; i < r; ++i) oo[i] += w * st[2 * H + h * r + i];
      }
      for (int64_t i = 0; i < r; ++i) oo[i] /= den;
    }
  return o;
}

// q (B, H, r + dr) fp32: [q_lat ; q_rot] per head; c (B, S, r), pe (B, S, dr): rows dense, any row/batch
// stride; k_pos (B|1, S) int64; p (B,) int64 query positions. -> o_lat (B, H, r) fp32.
torch::Tensor mla_decode(torch::Tensor q, torch::Tensor c, torch::Tensor pe, torch::Tensor k_pos, torch::Tensor p,
                         double scale) {
  TORCH_CHECK(q.is_contiguous() && c.stride(2) == 1 && pe.stride(2) == 1, "rows must be dense");
  TORCH_CHECK(k_pos.is_contiguous() && p.is_contiguous(), "positions must be contiguous");
  const int64_t B = q.size(0), H = q.size(1), K = q.size(2), S = c.size(1), r = c.size(2), dr = pe.size(2);
  TORCH_CHECK(K == r + dr && pe.size(1) == S, "q must be [q_lat ; q_rot] for the cache's widths");
  const int64_t chunks = (S + CHUNK - 1) / CHUNK, jobs = B * chunks, kpb = k_pos.size(0) == 1 ? 0 : S;
  const float *pq = q.data_ptr<float>(), *pc = c.data_ptr<float>(), *ppe = pe.data_ptr<float>();
  const int64_t *pk = k_pos.data_ptr<int64_t>(), *pp = p.data_ptr<int64_t>();
  std::vector<float> stats(jobs * H * (r + 2));  // per job: (max, sum) per head, then sum weight * c (r) per head
  at::parallel_for(0, jobs, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> sc(H * CHUNK);
    for (int64_t job = begin; job < end; ++job) {
      const int64_t b = job / chunks, s0 = (job % chunks) * CHUNK, n = std::min(CHUNK, S - s0);
      const float *cb = pc + b * c.stride(0) + s0 * c.stride(1), *pb = ppe + b * pe.stride(0) + s0 * pe.stride(1);
      chunk_stats(pq + b * H * K, H, cb, c.stride(1), pb, pe.stride(1), pk + b * kpb + s0, pp[b], n, r, dr,
                  float(scale), sc.data(), stats.data() + job * H * (r + 2));
    }
  });
  return merge_chunks(stats, B, chunks, H, r, q.options());
}

// DeepSeek Sparse Attention's decode: mla_decode over the k slots top (B, k) each row picked, read where they lie.
// c (N, bs, r), pe (N, bs, dr): the cache's blocks of bs slots (a contiguous cache: one block of S slots per row),
// rows dense, any stride; rows (B, nb) int64: each row's block table; slot s of row b is block rows[b][s / bs],
// offset s % bs. k_pos (B, k) int64: the picked slots' positions (-1: empty). A chunk's picked rows are copied into
// a buffer (CHUNK x (r + dr) floats, in L2) and scored there: the cache is read only at the picked rows, once.
torch::Tensor mla_decode_picked(torch::Tensor q, torch::Tensor c, torch::Tensor pe, torch::Tensor rows,
                                torch::Tensor top, torch::Tensor k_pos, torch::Tensor p, double scale) {
  TORCH_CHECK(q.is_contiguous() && c.stride(2) == 1 && pe.stride(2) == 1, "rows must be dense");
  TORCH_CHECK(rows.is_contiguous() && top.is_contiguous() && k_pos.is_contiguous() && p.is_contiguous(),
              "the block table, picks and positions must be contiguous");
  const int64_t B = q.size(0), H = q.size(1), K = q.size(2), bs = c.size(1), r = c.size(2), dr = pe.size(2);
  const int64_t k = top.size(1), nb = rows.size(1);
  TORCH_CHECK(K == r + dr && pe.size(1) == bs && k_pos.size(1) == k, "q must be [q_lat ; q_rot] for the widths");
  const int64_t chunks = std::max<int64_t>(1, (k + CHUNK - 1) / CHUNK), jobs = B * chunks;
  const float *pq = q.data_ptr<float>(), *pc = c.data_ptr<float>(), *ppe = pe.data_ptr<float>();
  const int64_t *prow = rows.data_ptr<int64_t>(), *ptop = top.data_ptr<int64_t>(), *pk = k_pos.data_ptr<int64_t>();
  const int64_t *pp = p.data_ptr<int64_t>();
  std::vector<float> stats(jobs * H * (r + 2));
  at::parallel_for(0, jobs, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> sc(H * CHUNK), cbuf(CHUNK * r), pbuf(CHUNK * dr);
    for (int64_t job = begin; job < end; ++job) {
      const int64_t b = job / chunks, s0 = (job % chunks) * CHUNK, n = std::max<int64_t>(0, std::min(CHUNK, k - s0));
      for (int64_t t = 0; t < n; ++t) {  // the picked rows, gathered where they lie
        const int64_t s = ptop[b * k + s0 + t], blk = prow[b * nb + s / bs], off = s % bs;
        std::copy_n(pc + blk * c.stride(0) + off * c.stride(1), r, cbuf.data() + t * r);
        std::copy_n(ppe + blk * pe.stride(0) + off * pe.stride(1), dr, pbuf.data() + t * dr);
      }
      chunk_stats(pq + b * H * K, H, cbuf.data(), r, pbuf.data(), dr, pk + b * k + s0, pp[b], n, r, dr,
                  float(scale), sc.data(), stats.data() + job * H * (r + 2));
    }
  });
  return merge_chunks(stats, B, chunks, H, r, q.options());
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("mla_decode", &mla_decode);
  m.def("mla_decode_picked", &mla_decode_picked);
}
