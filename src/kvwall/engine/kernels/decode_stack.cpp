// A decode step's whole stack of attention + gated-MLP layers in one call (engine/decode_stack.py says when and
// why). Per layer, for B rows that each add one token at the end of what their cache holds:
//     h = norm1(x);  q, k, v = qkv(h);  [q, k = q_norm(q), k_norm(k)];  q, k = rope(q), rope(k);  cache <- k, v
//     a = o(attend(q, cache));  [a = post1(a)];  x += a
//     h = norm2(x);  m = down(act(gate(h)) * up(h));  [m = post2(m)];  x += m
// the same ops, in the same order, as engine/model.py's Block over layers/attention.py and layers/mlp.py.
#include "pool_rows.h"
#include "packed.h"
#include "quantized_attend.h"

namespace py = pybind11;

// y = x W^T (+ b): W packed (q, s, z: packed.h's layout; bits 4 or 8), float (w (N, K), any strides), or
// another layout whose module's forward `fn` (bias included) is called back in Python (oneDNN's: layers/onednn.py)
inline c10::optional<torch::Tensor> opt(const torch::Tensor &t) {
  return t.defined() ? c10::optional<torch::Tensor>(t) : c10::nullopt;
}

struct Proj {
  torch::Tensor w, q, s, z, b;
  torch::Tensor qt, st, zt;  // int8 activations' tiles (PackedLinear.x8_tiles), if any
  int64_t bits = 0, group = 0;
  bool x8 = false;  // int8 activations (packed.h's round_x8)
  py::object fn;

  torch::Tensor operator()(const torch::Tensor &x) const {  // x (B, K) -> (B, N)
    if (fn) return fn(x).cast<torch::Tensor>().contiguous();
    torch::Tensor y = bits ? packed_linear(x, q, s, opt(z),
                                           bits, group, -1, x8, opt(qt), opt(st), opt(zt))
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

// One layer's cache as a step writes and reads it in place (caches/base.py's KVView says which cache hands over which)
enum class Kind : int64_t { fp32, fp8, kivi, ints };

struct KV {
  Kind kind = Kind::fp32;
  // fp32, fp8: pools (NB, H, bs, D) and (NB, H, bs, Dv), fp32 or float8_e4m3fn, read through the step's block table;
  // kivi: the full-precision residual rk (Bc, H, slots, D) and rv (Bc, H, slots, Dv) fp32 (Bc >= B rows);
  // ints (serve's integer pools, QuantizedPages): the codes (NB, H, bs, D bits / 8) and (NB, H, bs, Dv bits / 8) uint8
  torch::Tensor k, v;
  // kivi: QuantizedLayer's packed key chunks kq (Bc, H, C, D, G bits / 8) uint8, ks, kz (Bc, H, C, D, 1) fp16, packed
  // values vq (Bc, H, C G, Dv bits / 8) uint8, vs, vz (Bc, H, C G, Dv / gv) fp16; kz, vz absent: a symmetric format
  // ints: ks, kz (NB, H, bs, D / gk) and vs, vz (NB, H, bs, Dv / gv) fp16: each token's scales and zero points
  torch::Tensor kq, ks, kz, vq, vs, vz;
  int64_t bits = 0;  // kivi, ints: 8, 4 or 2
  // fp32 ring (caches/sliding.py's RingLayer, row b = block b): sink slots 0 .. sink - 1 hold positions < sink, slot
  // sink + (p - sink) % ring position p past them; a row holding n tokens holds min(n, sink + ring) slots, each one
  // a position its query sees, so attention reads them all. pos (rows, sink + ring) int64: the position in each slot,
  // kept for the steps that run layer by layer. ring 0: not a ring.
  int64_t ring = 0, sink = 0;
  torch::Tensor pos;
  int64_t window = -1;  // the window attention uses here: -1 the layer's own, 0 none (a sliding:W cache's own choice)
};

// The slots row b's queries read: a ring's held slots, else positions a .. len - 1 with a window's start
inline std::pair<int64_t, int64_t> seen(const Layer &L, const KV &kv, int64_t len) {
  if (kv.ring) return {0, std::min(len, kv.sink + kv.ring)};
  const int64_t window = kv.window >= 0 ? kv.window : L.window;
  return {window > 0 ? std::max<int64_t>(0, len - window) : 0, len};
}

// The slot position t goes to: a ring's (see KV), else t itself
inline int64_t slot_of(const KV &kv, int64_t t) {
  return kv.ring == 0 || t < kv.sink ? t : kv.sink + (t - kv.sink) % kv.ring;
}

struct Stack {
  std::vector<Layer> layers;
  double eps, offset;  // every norm's (the model's RMSNorm: offset 1 is Gemma's (1 + w))

  Stack(double eps, double offset) : eps(eps), offset(offset) {}
  void add(const Layer &layer) { layers.push_back(layer); }

  // x (B, D) fp32 contiguous: the residual stream of B rows, updated in place and returned.
  // cos, sin: per rotary table, (B, d) fp32 at each row's new position (sin: RopeTables.sin_swapped).
  // kv: per layer, its cache (KV). lengths (B,) int64: the tokens row b holds, its new one (at position
  // lengths[b] - 1) included. table (B, nb) int64: the pools' block tables, paged_decode's (a contiguous cache: row
  // b is block b of bs = max_len slots). quantized (B,) int64: the tokens row b holds in quantized chunks (kivi
  // layers: its new token goes to residual slot lengths[b] - 1 - quantized[b]); empty without kivi layers.
  torch::Tensor step(torch::Tensor x, std::vector<torch::Tensor> cos, std::vector<torch::Tensor> sin,
                     const std::vector<KV> &kv, torch::Tensor table, torch::Tensor lengths, torch::Tensor quantized) {
    TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous() && x.dim() == 2, "x: contiguous (B, D) fp32");
    TORCH_CHECK(kv.size() == layers.size(), "one cache view per layer");
    TORCH_CHECK(cos.size() == sin.size(), "one sin table per cos table");
    TORCH_CHECK(table.scalar_type() == at::kLong && lengths.scalar_type() == at::kLong && table.is_contiguous() &&
                    lengths.is_contiguous(), "table and lengths: contiguous int64");
    const int64_t B = x.size(0), D = x.size(1), nb = table.size(1);
    TORCH_CHECK(table.size(0) == B && lengths.size(0) == B, "one table row and one length per row of x");
    const int64_t *tab = table.data_ptr<int64_t>(), *len = lengths.data_ptr<int64_t>();
    TORCH_CHECK(quantized.scalar_type() == at::kLong && quantized.is_contiguous(), "quantized: contiguous int64");
    const int64_t *nq = quantized.numel() == B ? quantized.data_ptr<int64_t>() : nullptr;
    for (size_t i = 0; i < cos.size(); ++i)
      TORCH_CHECK(cos[i].is_contiguous() && sin[i].is_contiguous() && cos[i].scalar_type() == at::kFloat &&
                      sin[i].scalar_type() == at::kFloat && cos[i].size(0) == B && cos[i].sizes() == sin[i].sizes(),
                  "rotary tables: contiguous (B, d) fp32");
    for (size_t i = 0; i < layers.size(); ++i) check_layer(layers[i], kv[i], cos, B, D, tab, nb, len, nq);
    float *px = x.data_ptr<float>();
    auto h = torch::empty({B, D}, x.options());
    for (size_t i = 0; i < layers.size(); ++i) {
      const Layer &L = layers[i];
      norm_rows(px, L.norm1, h.data_ptr<float>(), B, D, float(eps), float(offset));
      torch::Tensor qkv = L.qkv(h);  // (B, (Hq + Hkv) d + Hkv dv)
      TORCH_CHECK(qkv.size(1) == (L.nq + L.nkv) * L.d + L.nkv * L.dv, "qkv's width does not match the heads");
      torch::Tensor a = L.o(attention(L, qkv, kv[i], cos, sin, tab, nb, len, nq));  // (B, Hq dv) -> (B, D)
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
  void check_layer(const Layer &L, const KV &kv, const std::vector<torch::Tensor> &cos, int64_t B, int64_t D,
                   const int64_t *tab, int64_t nb, const int64_t *len, const int64_t *nq) const {
    const torch::Tensor &k = kv.k, &v = kv.v;
    TORCH_CHECK(L.norm1.numel() == D && L.norm2.numel() == D, "norm weights must be (D,)");
    TORCH_CHECK(L.rope < int64_t(cos.size()) && (L.rope < 0 || cos[L.rope].size(1) == L.d),
                "a layer's rotary table is missing or not head-wide");
    for (int64_t b = 0; b < B; ++b) TORCH_CHECK(len[b] >= 1, "a row holds no token");
    if (kv.kind == Kind::ints) return check_ints(L, kv, B, tab, nb, len);
    TORCH_CHECK(k.defined() && v.defined() && k.is_contiguous() && v.is_contiguous() && k.dim() == 4 &&
                    v.dim() == 4 && k.size(1) == L.nkv && k.size(3) == L.d && v.size(0) == k.size(0) &&
                    v.size(1) == L.nkv && v.size(2) == k.size(2) && v.size(3) == L.dv,
                "the cache's K/V do not match the layer");
    if (kv.kind == Kind::kivi) return check_kivi(kv, B, len, nq);
    const auto dtype = kv.kind == Kind::fp8 ? at::kFloat8_e4m3fn : at::kFloat;
    TORCH_CHECK(k.scalar_type() == dtype && v.scalar_type() == dtype, "K/V pools: fp32 (fp8 views: float8_e4m3fn)");
    const int64_t NB = k.size(0), bs = k.size(2);
    if (kv.ring) {
      TORCH_CHECK(kv.kind == Kind::fp32 && kv.ring > 0 && kv.sink >= 0 && bs == kv.sink + kv.ring,
                  "a ring: fp32, sink + ring slots");
      TORCH_CHECK(kv.pos.defined() && kv.pos.scalar_type() == at::kLong && kv.pos.is_contiguous() &&
                      kv.pos.dim() == 2 && kv.pos.size(0) == NB && kv.pos.size(1) == bs,
                  "a ring's positions: contiguous int64 (rows, slots)");
    }
    check_blocks(L, kv, B, NB, bs, tab, nb, len);
  }

  // Every block a row's queries read lies in the pool and its tokens fit its block table
  static void check_blocks(const Layer &L, const KV &kv, int64_t B, int64_t NB, int64_t bs, const int64_t *tab,
                           int64_t nb, const int64_t *len) {
    for (int64_t b = 0; b < B; ++b) {
      const int64_t held = seen(L, kv, len[b]).second;
      TORCH_CHECK(held <= nb * bs, "a row's length lies outside its block table");
      for (int64_t j = 0; j < (held + bs - 1) / bs; ++j)
        TORCH_CHECK(tab[b * nb + j] >= 0 && tab[b * nb + j] < NB, "a block table entry lies outside the pool");
    }
  }

  // An integer pool's view: codes, scales and zero points shaped as QuantizedPages allocates them, K and V alike
  static void check_ints(const Layer &L, const KV &kv, int64_t B, const int64_t *tab, int64_t nb, const int64_t *len) {
    TORCH_CHECK(kv.bits == 8 || kv.bits == 4 || kv.bits == 2, "int pool bits must be 8, 4 or 2");
    TORCH_CHECK(kv.ring == 0, "an int pool is not a ring");
    const int64_t NB = kv.k.defined() ? kv.k.size(0) : 0, bs = kv.k.defined() && kv.k.dim() == 4 ? kv.k.size(2) : 0;
    auto side = [&](const torch::Tensor &q, const torch::Tensor &s, const torch::Tensor &z, int64_t width) {
      TORCH_CHECK(q.defined() && s.defined() && q.is_contiguous() && s.is_contiguous() && q.dim() == 4 &&
                      s.dim() == 4 && q.scalar_type() == at::kByte && s.scalar_type() == at::kHalf,
                  "int pools: contiguous (NB, H, bs, .) uint8 codes and fp16 scales");
      TORCH_CHECK(q.size(0) == NB && q.size(1) == L.nkv && q.size(2) == bs && q.size(3) * 8 == width * kv.bits,
                  "an int pool's codes do not match the layer");
      TORCH_CHECK(s.size(0) == NB && s.size(1) == L.nkv && s.size(2) == bs && s.size(3) > 0 && width % s.size(3) == 0,
                  "an int pool's scales do not match its codes");
      TORCH_CHECK(!z.defined() || (z.is_contiguous() && z.scalar_type() == at::kHalf && z.sizes() == s.sizes()),
                  "zero points: fp16, shaped as the scales");
    };
    side(kv.k, kv.ks, kv.kz, L.d);
    side(kv.v, kv.vs, kv.vz, L.dv);
    check_blocks(L, kv, B, NB, bs, tab, nb, len);
  }

  // A kivi view (caches/quantized.py's buffers): dtypes and shapes as QuantizedLayer allocates them, and each row's
  // quantized tokens within its chunks and its new token within the residual's slots
  static void check_kivi(const KV &kv, int64_t B, const int64_t *len, const int64_t *nq) {
    TORCH_CHECK(nq, "kivi layers need each row's quantized token count");
    TORCH_CHECK(kv.bits == 8 || kv.bits == 4 || kv.bits == 2, "kivi bits must be 8, 4 or 2");
    const torch::Tensor &k = kv.k, &v = kv.v;
    TORCH_CHECK(k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat && k.size(0) >= B,
                "the residual: fp32, a row per row of the step");
    for (const torch::Tensor *t : {&kv.kq, &kv.ks, &kv.vq, &kv.vs})
      TORCH_CHECK(t->defined() && t->is_contiguous() && t->size(0) == k.size(0) && t->size(1) == k.size(1),
                  "kivi buffers: contiguous, (rows, H, ...)");
    TORCH_CHECK(kv.kq.scalar_type() == at::kByte && kv.vq.scalar_type() == at::kByte && kv.ks.scalar_type() == at::kHalf
                    && kv.vs.scalar_type() == at::kHalf, "kivi codes: uint8; scales: fp16");
    for (const torch::Tensor *t : {&kv.kz, &kv.vz})
      TORCH_CHECK(!t->defined() || (t->is_contiguous() && t->scalar_type() == at::kHalf), "zero points: fp16");
    TORCH_CHECK(!kv.kz.defined() || kv.kz.sizes() == kv.ks.sizes(), "kz must be shaped as ks");
    TORCH_CHECK(!kv.vz.defined() || kv.vz.sizes() == kv.vs.sizes(), "vz must be shaped as vs");
    const int64_t C = kv.kq.size(2), D = k.size(3), Dv = v.size(3), G = kv.kq.size(4) * 8 / kv.bits;
    TORCH_CHECK(kv.kq.dim() == 5 && kv.kq.size(3) == D && kv.ks.dim() == 5 && kv.ks.size(2) == C &&
                    kv.ks.size(3) == D && kv.ks.size(4) == 1 && G > 0, "kq/ks: (rows, H, chunks, D, ...)");
    TORCH_CHECK(kv.vq.size(2) == C * G && kv.vq.size(3) * 8 == Dv * kv.bits && kv.vs.size(2) == C * G &&
                    kv.vs.size(3) > 0 && Dv % kv.vs.size(3) == 0, "vq/vs: (rows, H, chunks G, ...)");
    for (int64_t b = 0; b < B; ++b) {
      TORCH_CHECK(nq[b] >= 0 && nq[b] % G == 0 && nq[b] <= C * G, "a row's quantized tokens lie outside its chunks");
      TORCH_CHECK(len[b] - 1 - nq[b] >= 0 && len[b] - 1 - nq[b] < k.size(2),
                  "a row's new token lies outside the residual");
    }
  }

  // qkv (B, (Hq + Hkv) d + Hkv dv): norms and rotation of q and k in place, k and v written to the cache at each
  // row's new position (write), then every query head over its KV head's tokens (attend) -> (B, Hq dv)
  torch::Tensor attention(const Layer &L, torch::Tensor qkv, const KV &kv, const std::vector<torch::Tensor> &cos,
                          const std::vector<torch::Tensor> &sin, const int64_t *tab, int64_t nb, const int64_t *len,
                          const int64_t *nq) const {
    const int64_t B = qkv.size(0), width = qkv.size(1), H = L.nkv, d = L.d;
    float *p = qkv.data_ptr<float>();
    for (int64_t b = 0; b < B; ++b) {
      float *row = p + b * width;
      for (int64_t j = 0; j < L.nq + H; ++j) {  // the query heads, then the key heads, side by side in qkv
        float *head = row + j * d;
        const torch::Tensor &w = j < L.nq ? L.q_norm : L.k_norm;
        if (w.defined()) norm_row(head, w.data_ptr<float>(), head, d, float(eps), float(offset));
        if (L.rope >= 0)
          rotate_head(head, cos[L.rope].data_ptr<float>() + b * d, sin[L.rope].data_ptr<float>() + b * d, d);
      }
      for (int64_t j = 0; j < H; ++j)
        write(L, kv, b, j, row + (L.nq + j) * d, row + (L.nq + H) * d + j * L.dv, tab + b * nb, len[b],
              nq ? nq[b] : 0);
    }
    return attend(L, kv, qkv, tab, nb, len, nq);
  }

  // Row b's new key (d) and value (dv) of KV head j into the cache, at position len - 1: a pool's slot through the
  // row's block table (fp8: rounded as caches/fp8.py writes; ints: quantized as QuantizedPages.write does), or the
  // kivi residual's slot len - 1 - nq (as QuantizedLayer.append puts it there when no chunk is flushed:
  // decode_blocks declines a step that flushes one)
  static void write(const Layer &L, const KV &kv, int64_t b, int64_t j, const float *key, const float *val,
                    const int64_t *blk, int64_t len, int64_t nq) {
    const int64_t H = L.nkv, d = L.d, dv = L.dv, t = len - 1;
    if (kv.kind == Kind::kivi) {
      const int64_t slots = kv.k.size(2), slot = t - nq;
      std::copy_n(key, d, kv.k.data_ptr<float>() + ((b * H + j) * slots + slot) * d);
      std::copy_n(val, dv, kv.v.data_ptr<float>() + ((b * H + j) * slots + slot) * dv);
      return;
    }
    const int64_t bs = kv.k.size(2), u = slot_of(kv, t), at = (blk[u / bs] * H + j) * bs + u % bs;  // pool slot
    if (kv.ring && j == 0) kv.pos.data_ptr<int64_t>()[blk[0] * bs + u] = t;
    if (kv.kind == Kind::ints) {
      with_bits(kv.bits, [&](auto tag) {
        constexpr int BITS = decltype(tag)::value;
        const int64_t NGk = kv.ks.size(3), NGv = kv.vs.size(3);
        quantize_token<BITS>(key, d, d / NGk, kv.k.data_ptr<uint8_t>() + at * d * BITS / 8,
                             kv.ks.data_ptr<at::Half>() + at * NGk,
                             kv.kz.defined() ? kv.kz.data_ptr<at::Half>() + at * NGk : nullptr);
        quantize_token<BITS>(val, dv, dv / NGv, kv.v.data_ptr<uint8_t>() + at * dv * BITS / 8,
                             kv.vs.data_ptr<at::Half>() + at * NGv,
                             kv.vz.defined() ? kv.vz.data_ptr<at::Half>() + at * NGv : nullptr);
      });
      return;
    }
    if (kv.kind == Kind::fp32) {
      std::copy_n(key, d, kv.k.data_ptr<float>() + at * d);
      std::copy_n(val, dv, kv.v.data_ptr<float>() + at * dv);
      return;
    }
    uint8_t *pk = static_cast<uint8_t *>(kv.k.data_ptr()) + at * d;
    uint8_t *pv = static_cast<uint8_t *>(kv.v.data_ptr()) + at * dv;
    for (int64_t i = 0; i < d; ++i) pk[i] = to_e4m3(key[i]);
    for (int64_t i = 0; i < dv; ++i) pv[i] = to_e4m3(val[i]);
  }

  // Every (row, KV head) job: query heads j rep .. (j + 1) rep - 1 of row b over the tokens they see -> (B, Hq dv)
  static torch::Tensor attend(const Layer &L, const KV &kv, const torch::Tensor &qkv, const int64_t *tab, int64_t nb,
                              const int64_t *len, const int64_t *nq) {
    const int64_t B = qkv.size(0), width = qkv.size(1), H = L.nkv, d = L.d, dv = L.dv, rep = L.nq / H;
    const float *p = qkv.data_ptr<float>();
    auto y = torch::empty({B, L.nq * dv}, qkv.options());  // every row holds a token: each job writes its part
    float *py = y.data_ptr<float>();
    const QuantKV Q = kv.kind == Kind::kivi ? quant_kv(kv.kq, kv.ks, kv.kz, kv.vq, kv.vs, kv.vz, kv.k, kv.v, kv.bits)
                                            : QuantKV{};
    const int64_t bs = kv.k.size(2);
    const auto ps = cut_jobs(B * H, [&](int64_t job) { return seen(L, kv, len[job / H]); },  // at position len - 1
                             kv.kind == Kind::kivi ? quant_align(Q) : ROW_TILE);
    thread_local std::vector<float> s;
    thread_local RowScratch rs;
    thread_local QuantScratch sc;
    run_pieces(ps, B * H, rep, dv, [&](const Piece &pc, float *o, float *m, float *l) {
      const int64_t b = pc.job / H, j = pc.job % H;
      const float *qq = p + b * width + j * rep * d;
      if (kv.kind == Kind::fp32)
        attend_part(qq, rep, d, dv, kv.k.data_ptr<float>(), kv.v.data_ptr<float>(), tab + b * nb, H, j, bs, pc.a,
                    pc.e, float(L.scale), o, m, l, s);
      else if (kv.kind == Kind::fp8)
        attend_rows_part(qq, rep, d, dv, FloatRows<uint8_t>{static_cast<const uint8_t *>(kv.k.data_ptr()), d},
                         FloatRows<uint8_t>{static_cast<const uint8_t *>(kv.v.data_ptr()), dv}, tab + b * nb, H, j,
                         bs, pc.a, pc.e, float(L.scale), o, m, l, rs);
      else if (kv.kind == Kind::ints)
        with_bits(kv.bits, [&](auto tag) {
          constexpr int BITS = decltype(tag)::value;
          const auto K = int_rows<BITS>(kv.k, kv.ks, kv.kz, d);
          const auto V = int_rows<BITS>(kv.v, kv.vs, kv.vz, dv);
          attend_rows_part(qq, rep, d, dv, K, V, tab + b * nb, H, j, bs, pc.a, pc.e, float(L.scale), o, m, l, rs);
        });
      else  // quantized_decode's window: the query at position len - 1 sees positions > len - 1 - window
        attend_part_bits(kv.bits, Q, b, j, qq, rep, pc.a, pc.e, nq[b], float(L.scale), o, m, l, sc);
    }, [&](int64_t job) { return py + (job / H * L.nq + job % H * rep) * dv; });
    return y;
  }
};

// The conversions a step makes, one element at a time, for tests: e4m3 bytes (uint8) -> floats as the fp8 view's
// attention reads them, and floats -> the bytes its write stores
torch::Tensor e4m3_read(torch::Tensor codes) {
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.is_contiguous(), "codes: contiguous uint8");
  auto out = torch::empty(codes.sizes(), codes.options().dtype(at::kFloat));
  e4m3_to_float(codes.data_ptr<uint8_t>(), out.data_ptr<float>(), codes.numel());
  return out;
}

torch::Tensor e4m3_write(torch::Tensor x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous(), "x: contiguous fp32");
  auto out = torch::empty(x.sizes(), x.options().dtype(at::kByte));
  const float *px = x.data_ptr<float>();
  uint8_t *po = out.data_ptr<uint8_t>();
  for (int64_t i = 0; i < x.numel(); ++i) po[i] = to_e4m3(px[i]);
  return out;
}

// x (N, width) fp32 quantized token by token as an int pool's write does (quantize_token, groups of width / G) ->
// (codes (N, width bits / 8) uint8, scales (N, G) fp16, zero points (N, G) fp16, empty when symmetric), for tests
std::vector<torch::Tensor> int_write(torch::Tensor x, int64_t bits, int64_t G, bool zero) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous() && x.dim() == 2, "x: contiguous (N, width) fp32");
  TORCH_CHECK((bits == 8 || bits == 4 || bits == 2) && G > 0 && x.size(1) % G == 0 && x.size(1) * bits % 8 == 0,
              "bits 8, 4 or 2, and G groups that divide the width");
  const int64_t N = x.size(0), width = x.size(1);
  auto q = torch::empty({N, width * bits / 8}, x.options().dtype(at::kByte));
  auto s = torch::empty({N, G}, x.options().dtype(at::kHalf));
  auto z = zero ? torch::empty({N, G}, x.options().dtype(at::kHalf)) : torch::empty({0}, x.options().dtype(at::kHalf));
  with_bits(bits, [&](auto tag) {
    constexpr int BITS = decltype(tag)::value;
    for (int64_t i = 0; i < N; ++i)
      quantize_token<BITS>(x.data_ptr<float>() + i * width, width, width / G,
                           q.data_ptr<uint8_t>() + i * width * BITS / 8, s.data_ptr<at::Half>() + i * G, zero ? z.data_ptr<at::Half>() + i * G : nullptr);
  });
  return {q, s, z};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<Proj>(m, "Proj")
      .def(py::init<>())
      .def_readwrite("w", &Proj::w).def_readwrite("q", &Proj::q).def_readwrite("s", &Proj::s)
      .def_readwrite("z", &Proj::z).def_readwrite("b", &Proj::b)
      .def_readwrite("bits", &Proj::bits).def_readwrite("group", &Proj::group).def_readwrite("fn", &Proj::fn)
      .def_readwrite("x8", &Proj::x8)
      .def_readwrite("qt", &Proj::qt)
      .def_readwrite("st", &Proj::st)
      .def_readwrite("zt", &Proj::zt)
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
  py::enum_<Kind>(m, "Kind").value("fp32", Kind::fp32).value("fp8", Kind::fp8).value("kivi", Kind::kivi)
      .value("int", Kind::ints);
  py::class_<KV>(m, "KV")
      .def(py::init<>())
      .def_readwrite("kind", &KV::kind).def_readwrite("k", &KV::k).def_readwrite("v", &KV::v)
      .def_readwrite("kq", &KV::kq).def_readwrite("ks", &KV::ks).def_readwrite("kz", &KV::kz)
      .def_readwrite("vq", &KV::vq).def_readwrite("vs", &KV::vs).def_readwrite("vz", &KV::vz)
      .def_readwrite("bits", &KV::bits).def_readwrite("ring", &KV::ring).def_readwrite("sink", &KV::sink)
      .def_readwrite("pos", &KV::pos).def_readwrite("window", &KV::window);
  m.def("e4m3_read", &e4m3_read, "uint8 e4m3 codes -> fp32, as the fp8 view's attention converts them");
  m.def("e4m3_write", &e4m3_write, "fp32 -> uint8 e4m3 codes, as the fp8 view's write rounds them");
  m.def("int_write", &int_write, "fp32 (N, width) -> an int pool's codes, scales, zero points, as a step writes them");
  py::class_<Stack>(m, "Stack")
      .def(py::init<double, double>())
      .def("add", &Stack::add)
      .def("step", &Stack::step, "one decode step through every layer (arguments: Stack::step in decode_stack.cpp)");
}
