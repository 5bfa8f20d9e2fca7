// Decode attention read in place from a paged pool (caches/paged_kernel.py says why and when): fp32 blocks as they
// are (common.h's attend_part); bf16, fp16 and fp8 (e4m3) blocks and packed integer blocks (8, 4 or 2 bits)
// through pool_rows.h's readers, a run of tokens at a time converted into an L1-sized buffer.
#include "pool_rows.h"

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

// Every (row, KV head) job of decode attention over a pool, cut along its tokens where the jobs are few (common.h's
// cut_jobs: at batch 1 a model has few KV heads), each piece's part(qq, h, blk, a, e, o, m, l) (attend_part's
// outputs) merged -> y (B, H, rep, Dv): the rep query heads of row b that read KV head h over the tokens the row
// holds (its new one written: the queries are at position n - 1), or the last `window` of them; zeros for a row
// holding nothing.
template <class Part>
void attend_all(const torch::Tensor &q, const torch::Tensor &table, const torch::Tensor &lengths, int64_t Dv,
                int64_t window, torch::Tensor &y, Part part) {
  const int64_t H = q.size(1), rep = q.size(2), D = q.size(3), nb = table.size(1);
  const int64_t *tab = table.data_ptr<int64_t>(), *len = lengths.data_ptr<int64_t>();
  const float *pq = q.data_ptr<float>();
  float *py = y.data_ptr<float>();
  const auto ps = cut_jobs(q.size(0) * H, [&](int64_t job) {
    const int64_t n = len[job / H];
    return std::pair<int64_t, int64_t>{window > 0 ? std::max<int64_t>(0, n - window) : 0, n};
  }, ROW_TILE);
  run_pieces(ps, q.size(0) * H, rep, Dv, [&](const Piece &pc, float *o, float *m, float *l) {
    part(pq + pc.job * rep * D, pc.job % H, tab + pc.job / H * nb, pc.a, pc.e, o, m, l);
  }, [&](int64_t job) { return py + job * rep * Dv; });
}

// attend_all over pools read through K and V (FloatRows, IntRows: pool_rows.h)
template <class Rows>
void attend_rows(const torch::Tensor &q, const Rows &K, const Rows &V, const torch::Tensor &table,
                 const torch::Tensor &lengths, int64_t bs, int64_t Dv, int64_t window, double scale, torch::Tensor &y) {
  const int64_t H = q.size(1), rep = q.size(2), D = q.size(3);
  attend_all(q, table, lengths, Dv, window, y, [&](const float *qq, int64_t h, const int64_t *blk, int64_t a, int64_t e,
                                                  float *o, float *m, float *l) {
    thread_local RowScratch sc;
    attend_rows_part(qq, rep, D, Dv, K, V, blk, H, h, bs, a, e, float(scale), o, m, l, sc);
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
  const int64_t NB = kp.size(0), bs = kp.size(2), Dv = vp.size(3);
  TORCH_CHECK(kp.size(1) == H && kp.size(3) == D && vp.size(0) == NB && vp.size(1) == H && vp.size(2) == bs,
              "the pools do not match the query");
  check_tables(table, lengths, B, NB, bs);
  auto y = torch::zeros({B, H, rep, Dv}, q.options());
  switch (kp.scalar_type()) {
    case at::kFloat: {  // fp32: read where it lies, no buffer
      const float *pk = kp.data_ptr<float>(), *pv = vp.data_ptr<float>();
      attend_all(q, table, lengths, Dv, window, y, [&](const float *qq, int64_t h, const int64_t *blk, int64_t a,
                                                       int64_t e, float *o, float *m, float *l) {
        thread_local std::vector<float> s;
        attend_part(qq, rep, D, Dv, pk, pv, blk, H, h, bs, a, e, float(scale), o, m, l, s);
      });
      break;
    }
    case at::kBFloat16: {
      auto k = reinterpret_cast<const uint16_t *>(kp.data_ptr<at::BFloat16>());
      auto v = reinterpret_cast<const uint16_t *>(vp.data_ptr<at::BFloat16>());
      attend_rows(q, FloatRows<uint16_t>{k, D}, FloatRows<uint16_t>{v, Dv}, table, lengths, bs, Dv, window, scale, y);
      break;
    }
    case at::kHalf:
      attend_rows(q, FloatRows<at::Half>{kp.data_ptr<at::Half>(), D}, FloatRows<at::Half>{vp.data_ptr<at::Half>(), Dv},
                 table, lengths, bs, Dv, window, scale, y);
      break;
    case at::kFloat8_e4m3fn: {
      auto k = reinterpret_cast<const uint8_t *>(kp.data_ptr<c10::Float8_e4m3fn>());
      auto v = reinterpret_cast<const uint8_t *>(vp.data_ptr<c10::Float8_e4m3fn>());
      attend_rows(q, FloatRows<uint8_t>{k, D}, FloatRows<uint8_t>{v, Dv}, table, lengths, bs, Dv, window, scale, y);
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
  with_bits(bits, [&](auto tag) {
    constexpr int BITS = decltype(tag)::value;
    const auto K = int_rows<BITS>(kq, ks, kz ? *kz : torch::Tensor(), D);
    const auto V = int_rows<BITS>(vq, vs, vz ? *vz : torch::Tensor(), Dv);
    attend_rows(q, K, V, table, lengths, bs, Dv, window, scale, y);
  });
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode);
  m.def("paged_decode_int", &paged_decode_int);
}
