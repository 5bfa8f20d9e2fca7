// A decode step's whole stack of attention + gated-MLP layers in one call (engine/decode_stack.py says when and
// why). Per layer, for B rows that each add one token at the end of what their cache holds:
//     h = norm1(x);  q, k, v = qkv(h);  [q, k = q_norm(q), k_norm(k)];  q, k = rope(q), rope(k);  cache <- k, v
//     a = o(attend(q, cache));  [a = post1(a)];  x += a
//     h = norm2(x);  m = down(act(gate(h)) * up(h));  [m = post2(m)];  x += m
// the same ops, in the same order, as engine/model.py's Block over layers/attention.py and layers/mlp.py.
#include "packed.h"

namespace py = pybind11;

// y = x W^T (+ b): W packed (q, s, z: packed.h's layout; bits 4 or 8), float (w (N, K), any strides), or
// another layout whose module's forward `fn` (bias included) is called back in Python (oneDNN's: layers/onednn.py)
struct Proj {
  torch::Tensor w, q, s, z, b;
  int64_t bits = 0, group = 0;
  py::object fn;

  torch::Tensor operator()(const torch::Tensor &x) const {  // x (B, K) -> (B, N)
    if (fn) return fn(x).cast<torch::Tensor>().contiguous();
    torch::Tensor y = bits ? packed_linear(x, q, s, z.defined() ? c10::optional<torch::Tensor>(z) : c10::nullopt,
                                           bits, group)
                           : at::mm(x, w.t());
    return b.defined() ? y.add_(b) : y;
  }
};

struct Layer {
  Proj qkv, o, up, down;  // up: [gate; up] fused, as GatedMLP.w13
  torch::Tensor norm1, norm2, q_norm, k_norm, post1, post2;  // fp32 RMSNorm weights; the last four may be absent
  int64_t nq = 0, nkv = 0, d = 0, dv = 0;  // query heads, KV heads, key and value head widths
  int64_t window = 0, rope = -1;  // window 0: none; rope: which of the step's rotary tables (-1: none)
  double scale = 1.0;
  bool gelu = false;  // the gate's activation: gelu (tanh approximation), else silu
};

// out = rms_norm(x) * (offset + w) for each of `rows` rows of D (in place when out == x)
inline void norm_rows(const float *x, const torch::Tensor &w, float *out, int64_t rows, int64_t D, float eps,
                      float offset) {
  const float *pw = w.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) norm_row(x + r * D, pw, out + r * D, D, eps, offset);
}

// One head in place: layers/rope.py rotate(): v * cos + [v2, v1] * sin_swapped (sin with its first half negated)
inline void rotate_head(float *v, const float *cos, const float *sin_swapped, int64_t d) {
  const int64_t half = d / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float a = v[i], c = v[i + half];
    v[i] = a * cos[i] + c * sin_swapped[i];
    v[i + half] = c * cos[i + half] + a * sin_swapped[i + half];
  }
}

// gu (B, 2F): [gate, up] -> (B, F) act(gate) * up; gelu is the tanh approximation (gelu_tanh), else silu
torch::Tensor gate(const torch::Tensor &gu, bool gelu) {
  const int64_t B = gu.size(0), F = gu.size(1) / 2;
  auto y = torch::empty({B, F}, gu.options());
  const float *pg = gu.data_ptr<float>();
  float *py = y.data_ptr<float>();
  for (int64_t r = 0; r < B; ++r) gate_row(pg + r * 2 * F, pg + r * 2 * F + F, py + r * F, F, gelu);
  return y;
}

// x += y, row by row (both (B, D) contiguous)
inline void add_into(float *x, const float *y, int64_t n) {
  int64_t i = 0;
  for (; i + W <= n; i += W) (Vec::loadu(x + i) + Vec::loadu(y + i)).store(x + i);
  for (; i < n; ++i) x[i] += y[i];
}

struct Stack {
  std::vector<Layer> layers;
  double eps, offset;  // every norm's (the model's RMSNorm: offset 1 is Gemma's (1 + w))

  Stack(double eps, double offset) : eps(eps), offset(offset) {}
  void add(const Layer &layer) { layers.push_back(layer); }

  // x (B, D) fp32 contiguous: the residual stream of B rows, updated in place and returned.
  // cos, sin: per rotary table, (B, d) fp32 at each row's new position (sin: RopeTables.sin_swapped).
  // kp, vp: per layer, (NB, Hkv, bs, d) and (NB, Hkv, bs, dv) fp32 pools; table (B, nb), lengths (B,) int64:
  // paged_decode's block tables (a contiguous cache: row b is block b of bs = max_len slots). Row b's new token
  // goes to position lengths[b] - 1.
  torch::Tensor step(torch::Tensor x, std::vector<torch::Tensor> cos, std::vector<torch::Tensor> sin,
                     std::vector<torch::Tensor> kp, std::vector<torch::Tensor> vp, torch::Tensor table,
                     torch::Tensor lengths) {
    TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous() && x.dim() == 2, "x: contiguous (B, D) fp32");
    TORCH_CHECK(kp.size() == layers.size() && vp.size() == layers.size(), "one K and one V pool per layer");
    TORCH_CHECK(cos.size() == sin.size(), "one sin table per cos table");
    TORCH_CHECK(table.scalar_type() == at::kLong && lengths.scalar_type() == at::kLong && table.is_contiguous() &&
                    lengths.is_contiguous(), "table and lengths: contiguous int64");
    const int64_t B = x.size(0), D = x.size(1), nb = table.size(1);
    TORCH_CHECK(table.size(0) == B && lengths.size(0) == B, "one table row and one length per row of x");
    const int64_t *tab = table.data_ptr<int64_t>(), *len = lengths.data_ptr<int64_t>();
    for (size_t i = 0; i < cos.size(); ++i)
      TORCH_CHECK(cos[i].is_contiguous() && sin[i].is_contiguous() && cos[i].scalar_type() == at::kFloat &&
                      sin[i].scalar_type() == at::kFloat && cos[i].size(0) == B && cos[i].sizes() == sin[i].sizes(),
                  "rotary tables: contiguous (B, d) fp32");
    for (size_t i = 0; i < layers.size(); ++i) check_layer(layers[i], kp[i], vp[i], cos, B, D, tab, nb, len);
    float *px = x.data_ptr<float>();
    auto h = torch::empty({B, D}, x.options());
    for (size_t i = 0; i < layers.size(); ++i) {
      const Layer &L = layers[i];
      norm_rows(px, L.norm1, h.data_ptr<float>(), B, D, float(eps), float(offset));
      torch::Tensor qkv = L.qkv(h);  // (B, (Hq + Hkv) d + Hkv dv)
      TORCH_CHECK(qkv.size(1) == (L.nq + L.nkv) * L.d + L.nkv * L.dv, "qkv's width does not match the heads");
      torch::Tensor a = L.o(attention(L, qkv, kp[i], vp[i], cos, sin, tab, nb, len));  // (B, Hq dv) -> (B, D)
      TORCH_CHECK(a.sizes() == x.sizes(), "o's output is not (B, D)");
      if (L.post1.defined()) norm_rows(a.data_ptr<float>(), L.post1, a.data_ptr<float>(), B, D, eps, offset);
      add_into(px, a.data_ptr<float>(), B * D);
      norm_rows(px, L.norm2, h.data_ptr<float>(), B, D, float(eps), float(offset));
      torch::Tensor gu = L.up(h);  // (B, 2F): [gate, up]
      TORCH_CHECK(gu.size(1) % 2 == 0, "gate and up must be the same width");
      torch::Tensor m = L.down(gate(gu, L.gelu));  // (B, D)
      TORCH_CHECK(m.sizes() == x.sizes(), "down's output is not (B, D)");
      if (L.post2.defined()) norm_rows(m.data_ptr<float>(), L.post2, m.data_ptr<float>(), B, D, eps, offset);
      add_into(px, m.data_ptr<float>(), B * D);
    }
    return x;
  }

  // Shapes a step relies on, checked before anything is written: a wrong pool or table must not write out of bounds.
  void check_layer(const Layer &L, const torch::Tensor &k, const torch::Tensor &v,
                   const std::vector<torch::Tensor> &cos, int64_t B, int64_t D, const int64_t *tab, int64_t nb,
                   const int64_t *len) const {
    TORCH_CHECK(k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat && k.is_contiguous() &&
                    v.is_contiguous(), "K/V pools: contiguous fp32");
    TORCH_CHECK(k.dim() == 4 && k.size(1) == L.nkv && k.size(3) == L.d && v.dim() == 4 && v.size(0) == k.size(0) &&
                    v.size(1) == L.nkv && v.size(2) == k.size(2) && v.size(3) == L.dv,
                "the pools do not match the layer");
    TORCH_CHECK(L.norm1.numel() == D && L.norm2.numel() == D, "norm weights must be (D,)");
    TORCH_CHECK(L.rope < int64_t(cos.size()) && (L.rope < 0 || cos[L.rope].size(1) == L.d),
                "a layer's rotary table is missing or not head-wide");
    const int64_t NB = k.size(0), bs = k.size(2);
    for (int64_t b = 0; b < B; ++b) {
      TORCH_CHECK(len[b] >= 1 && len[b] <= nb * bs, "a row's length lies outside its block table");
      for (int64_t j = 0; j < (len[b] + bs - 1) / bs; ++j)
        TORCH_CHECK(tab[b * nb + j] >= 0 && tab[b * nb + j] < NB, "a block table entry lies outside the pool");
    }
  }

  // qkv (B, (Hq + Hkv) d + Hkv dv): norms and rotation of q and k in place, k and v written to the pools at each
  // row's new position, then every query head over its KV head's tokens -> (B, Hq dv)
  torch::Tensor attention(const Layer &L, torch::Tensor qkv, const torch::Tensor &k, const torch::Tensor &v,
                          const std::vector<torch::Tensor> &cos, const std::vector<torch::Tensor> &sin,
                          const int64_t *tab, int64_t nb, const int64_t *len) const {
    const int64_t B = qkv.size(0), width = qkv.size(1), H = L.nkv, d = L.d, dv = L.dv, rep = L.nq / H;
    const int64_t bs = k.size(2);
    float *p = qkv.data_ptr<float>(), *pk = k.data_ptr<float>(), *pv = v.data_ptr<float>();
    for (int64_t b = 0; b < B; ++b) {
      float *row = p + b * width;
      for (int64_t j = 0; j < L.nq + H; ++j) {  // the query heads, then the key heads, side by side in qkv
        float *head = row + j * d;
        const torch::Tensor &w = j < L.nq ? L.q_norm : L.k_norm;
        if (w.defined()) norm_row(head, w.data_ptr<float>(), head, d, float(eps), float(offset));
        if (L.rope >= 0)
          rotate_head(head, cos[L.rope].data_ptr<float>() + b * d, sin[L.rope].data_ptr<float>() + b * d, d);
      }
      const int64_t t = len[b] - 1, blk = tab[b * nb + t / bs];
      for (int64_t j = 0; j < H; ++j) {
        std::copy_n(row + (L.nq + j) * d, d, pk + ((blk * H + j) * bs + t % bs) * d);
        std::copy_n(row + (L.nq + H) * d + j * dv, dv, pv + ((blk * H + j) * bs + t % bs) * dv);
      }
    }
    auto y = torch::empty({B, L.nq * dv}, qkv.options());  // every row holds a token: attend_job writes it all
    float *py = y.data_ptr<float>();
    at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> s;
      for (int64_t job = begin; job < end; ++job) {
        const int64_t b = job / H, j = job % H;  // query heads j rep .. (j + 1) rep - 1 read KV head j
        attend_job(p + b * width + j * rep * d, rep, d, dv, pk, pv, tab + b * nb, H, j, bs, len[b], L.window,
                   float(L.scale), py + (b * L.nq + j * rep) * dv, s);
      }
    });
    return y;
  }
};

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<Proj>(m, "Proj")
      .def(py::init<>())
      .def_readwrite("w", &Proj::w).def_readwrite("q", &Proj::q).def_readwrite("s", &Proj::s)
      .def_readwrite("z", &Proj::z).def_readwrite("b", &Proj::b)
      .def_readwrite("bits", &Proj::bits).def_readwrite("group", &Proj::group).def_readwrite("fn", &Proj::fn)
      .def("__call__", &Proj::operator(), "x (B, K) fp32 contiguous -> (B, N), as a step calls it");
  py::class_<Layer>(m, "Layer")
      .def(py::init<>())
      .def_readwrite("qkv", &Layer::qkv).def_readwrite("o", &Layer::o).def_readwrite("up", &Layer::up)
      .def_readwrite("down", &Layer::down)
      .def_readwrite("norm1", &Layer::norm1).def_readwrite("norm2", &Layer::norm2)
      .def_readwrite("q_norm", &Layer::q_norm).def_readwrite("k_norm", &Layer::k_norm)
      .def_readwrite("post1", &Layer::post1).def_readwrite("post2", &Layer::post2)
      .def_readwrite("nq", &Layer::nq).def_readwrite("nkv", &Layer::nkv).def_readwrite("d", &Layer::d)
      .def_readwrite("dv", &Layer::dv).def_readwrite("window", &Layer::window).def_readwrite("rope", &Layer::rope)
      .def_readwrite("scale", &Layer::scale).def_readwrite("gelu", &Layer::gelu);
  py::class_<Stack>(m, "Stack")
      .def(py::init<double, double>())
      .def("add", &Stack::add)
      .def("step", &Stack::step, "one decode step through every layer (arguments: Stack::step in decode_stack.cpp)");
}
