"""KIVI-style quantized cache (Liu et al. 2024, "KIVI: a tuning-free asymmetric 2bit quantization for KV cache").

Layout per attention layer and row, with g = the format's group (int8: 128, int4/int2: 32; ``int8:g32``
changes it) and R = `residual`:

* keys, per channel: every chunk of g consecutive tokens is quantized along the token axis, one
  (scale, zero) per channel per chunk. One chunk of one channel is a g-element vector in
  spec.formats' layout: ``fmt.vector_bytes(g)`` bytes.
* values, per token: each token's value vector is quantized along head_dim in groups of g:
  ``fmt.vector_bytes(v_head_dim)`` bytes.
* residual: the newest tokens stay in full precision. When the residual reaches R + g tokens
  its oldest g are quantized as one key chunk, so it always holds R..R+g-1 tokens (all of
  them while the sequence is shorter than R).

nbytes() counts the bytes holding tokens (chunks written so far + residual tokens) and equals
``predict.memory.kivi_cache_bytes``; the buffers themselves are preallocated for max_len.
Every layer keeps every token (a sliding window only masks), so compare with the spec
``with_window(None)``.

Decode (one token per row) attends straight from the packed bytes (quant_kernel.py) when its C++
kernel builds; prefill, soft-capped attention and machines without a compiler read dequantized
copies (``read``). Both compute the same attention over the same rounded values. Inside the fused decode
step (engine/decode_stack.py) the same attention runs from C++ (kernels/quantized_attend.h), the new token
written to the residual there (decode_blocks; the step that would flush a chunk flushes it first).

Error: attention sees rounded K/V; each element is off by at most scale / 2 of its group
(int8: range / 510, int4: range / 30, int2: range / 6). tests/engine/test_caches.py states and
checks the resulting bound on logits.
"""

from __future__ import annotations

import torch

from kvwall.engine.caches.base import DecodeBlocks, KVCache, KVView, attention_specs, check_length
from kvwall.engine.caches.quant import dequantize, group_size, quantize
from kvwall.engine.caches.quant_kernel import quantized_decode
from kvwall.engine.caches.registry import RESIDUAL
from kvwall.errors import KvwallError
from kvwall.spec.formats import Format, get_format
from kvwall.spec.model import Attention, ModelSpec


class QuantizedLayer:
    def __init__(self, a: Attention, batch: int, max_len: int, fmt: Format, residual: int, dtype, device):
        self.fmt, self.R, self.G = fmt, residual, fmt.group
        if (self.G * fmt.bits) % 8:
            raise KvwallError(f"{fmt.label}: a key chunk of {self.G} tokens is not a whole number of bytes")
        self.gv = group_size(fmt, a.v_head_dim)
        chunks = max(0, (max_len - residual) // self.G)
        H, D, Dv = a.n_kv_heads, a.head_dim, a.v_head_dim
        z = lambda *shape, dt=torch.float16: torch.zeros(*shape, dtype=dt, device=device)  # noqa: E731
        self.kq = z(batch, H, chunks, D, self.G * fmt.bits // 8, dt=torch.uint8)  # per channel, per chunk
        self.ks = z(batch, H, chunks, D, 1)
        self.kz = z(batch, H, chunks, D, 1) if fmt.zero_bytes else None
        self.vq = z(batch, H, chunks * self.G, Dv * fmt.bits // 8, dt=torch.uint8)  # per token
        self.vs = z(batch, H, chunks * self.G, Dv // self.gv)
        self.vz = z(batch, H, chunks * self.G, Dv // self.gv) if fmt.zero_bytes else None
        self.rk = z(batch, H, residual + self.G - 1, D, dt=dtype)  # residual: newest tokens, full precision
        self.rv = z(batch, H, residual + self.G - 1, Dv, dt=dtype)
        self.chunks = [0] * batch  # key chunks quantized, per row
        self.res = [0] * batch  # tokens in the residual, per row

    def append(self, b: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Row b gets new tokens k (H, n, D), v (H, n, Dv); flush whole chunks out of the residual."""
        keys = torch.cat([self.rk[b, :, :self.res[b]], k], 1)  # (H, res + n, D)
        vals = torch.cat([self.rv[b, :, :self.res[b]], v], 1)  # (H, res + n, Dv)
        flush = 0
        while keys.shape[1] - flush * self.G >= self.R + self.G:
            flush += 1
        if flush:
            self._store(b, keys[:, :flush * self.G], vals[:, :flush * self.G])
        keys, vals = keys[:, flush * self.G:], vals[:, flush * self.G:]
        self.res[b] = keys.shape[1]
        self.rk[b, :, :self.res[b]] = keys
        self.rv[b, :, :self.res[b]] = vals

    def _store(self, b: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Quantize whole chunks: k (H, c * G, D) per channel, v (H, c * G, Dv) per token."""
        H, n, D = k.shape
        c0, c = self.chunks[b], n // self.G
        if c0 + c > self.kq.shape[2]:
            raise KvwallError("the quantized cache is full; give it a longer max length")
        kc = k.reshape(H, c, self.G, D).transpose(2, 3)  # (H, c, D, G): one vector per channel per chunk
        q, s, zero = quantize(kc, self.fmt, self.G)
        self.kq[b, :, c0:c0 + c], self.ks[b, :, c0:c0 + c] = q, s
        if zero is not None:
            self.kz[b, :, c0:c0 + c] = zero
        q, s, zero = quantize(v, self.fmt, self.gv)  # (H, n, Dv * bits / 8), (H, n, Dv / gv)
        t0 = c0 * self.G
        self.vq[b, :, t0:t0 + n], self.vs[b, :, t0:t0 + n] = q, s
        if zero is not None:
            self.vz[b, :, t0:t0 + n] = zero
        self.chunks[b] += c

    def flush_oldest(self, b: int) -> None:
        """Row b's oldest G residual tokens quantized into a chunk now, the rest moved up: the chunk and residual
        append() leaves when the next token arrives, with that token still to write (QuantizedCache.decode_blocks)."""
        G, r = self.G, self.res[b]
        self._store(b, self.rk[b, :, :G], self.rv[b, :, :G])  # (H, G, D), (H, G, Dv)
        self.rk[b, :, :r - G] = self.rk[b, :, G:r].clone()  # (H, r - G, D)
        self.rv[b, :, :r - G] = self.rv[b, :, G:r].clone()
        self.res[b] = r - G

    def read(self, dtype):
        """All held tokens: dequantized chunks then the residual -> k (B, H, S, D), v, k_pos (B, S)."""
        C = max(self.chunks)
        B, H, _, D, _ = self.kq.shape
        kz = self.kz[:, :, :C] if self.kz is not None else None
        k = dequantize(self.kq[:, :, :C], self.ks[:, :, :C], kz, self.fmt, self.G)  # (B, H, C, D, G)
        k = k.transpose(3, 4).reshape(B, H, C * self.G, D)  # (B, H, C * G, D)
        vz = self.vz[:, :, :C * self.G] if self.vz is not None else None
        v = dequantize(self.vq[:, :, :C * self.G], self.vs[:, :, :C * self.G], vz, self.fmt, self.gv)
        k_all = torch.cat([k.to(dtype), self.rk], 2)  # (B, H, C * G + R + G - 1, D)
        v_all = torch.cat([v.to(dtype), self.rv], 2)
        return k_all, v_all, self._positions(C)

    def attend_decode(self, q: torch.Tensor, pos: torch.Tensor, scale: float, window: int | None, kernel):
        """One new token per row, attention straight from the packed bytes and the residual (quant_kernel.py).
        q (B, Hq, 1, D); pos (B, 1) -> (B, Hq, 1, Dv) fp32."""
        B, Hq, _, D = q.shape
        H, Dv = self.rk.shape[1], self.rv.shape[-1]
        qg = q.float().reshape(B, H, Hq // H, D).contiguous()  # (B, H, rep, D): the group of each KV head
        rk, rv = self.rk.float().contiguous(), self.rv.float().contiguous()  # no copy for an fp32 cache
        counts = torch.tensor([self.chunks, self.res], dtype=torch.int64)  # (2, B)
        n_q = counts[0] * self.G
        y = kernel(qg, self.kq, self.ks, self.kz, self.vq, self.vs, self.vz, rk, rv, n_q, counts[1],
                   pos[:, 0].to("cpu", torch.int64).contiguous(), window or 0, self.fmt.bits, scale)  # (B, H, rep, Dv)
        # contiguous: pos may be a column of a wider (B, T) tensor, whose row b the kernel would misread (a windowed
        # layer then attended from a wrong position: Gemma 3's int4 perplexity moved between identical runs)
        return y.reshape(B, Hq, 1, Dv)

    def view(self) -> KVView | None:
        """These buffers as the fused decode step's kivi view (an fp32 residual only: the step computes in fp32)."""
        if self.rk.dtype != torch.float32:
            return None
        return KVView("kivi", self.rk, self.rv, self.kq, self.ks, self.kz, self.vq, self.vs, self.vz, self.fmt.bits)

    def _positions(self, C: int) -> torch.Tensor:
        B, slots = len(self.chunks), self.rk.shape[2]
        q = torch.arange(C * self.G)[None].expand(B, -1)  # (B, C * G)
        r = torch.arange(slots)[None].expand(B, -1)  # (B, R + G - 1)
        n_q = torch.tensor(self.chunks)[:, None] * self.G  # (B, 1) quantized tokens per row
        n_r = torch.tensor(self.res)[:, None]
        pos = torch.cat([torch.where(q < n_q, q, -1), torch.where(r < n_r, n_q + r, -1)], 1)
        return pos.to(self.rk.device)

    def nbytes(self) -> int:
        total = 0
        for b, (c, r) in enumerate(zip(self.chunks, self.res)):
            for t in (self.kq, self.ks, self.kz):
                total += t[b, :, :c].nbytes if t is not None else 0
            for t in (self.vq, self.vs, self.vz):
                total += t[b, :, :c * self.G].nbytes if t is not None else 0
            total += self.rk[b, :, :r].nbytes + self.rv[b, :, :r].nbytes
        return total


class QuantizedCache(KVCache):
    """nbytes() = predict.memory.kivi_cache_bytes (registry.py: kivi_bytes)."""

    name = "quantized"

    @classmethod
    def create(cls, choice, spec, batch, max_len, dtype, device, residual: int = RESIDUAL) -> QuantizedCache:
        """From the registry: the format is the cache's name and options (``int4:g64:sym``)."""
        return cls(spec, batch, max_len, get_format(choice.format), residual, dtype, device)

    def __init__(self, spec: ModelSpec, batch: int, max_len: int, fmt: Format, residual: int = 32,
                 dtype=torch.float32, device="cpu"):
        if fmt.is_float() or fmt.group is None or fmt.bits not in (2, 4, 8):
            raise KvwallError(f"the quantized cache takes int8, int4 or int2 formats, not {fmt.label}")
        if spec.has("latent") or spec.has("sparse_latent"):  # DSA: MLA's latent + the indexer key (sparse_latent.py)
            raise KvwallError(f"the {fmt.label} cache quantizes softmax-attention K/V; {spec.name} uses MLA's latent "
                              "cache (use contiguous or paged)")
        assert residual >= 0 and max_len > 0, (residual, max_len)
        self.fmt, self.residual, self.max_len = fmt, residual, max_len
        self.name = fmt.label
        self.layers = [QuantizedLayer(a, batch, max_len, fmt, residual, dtype, device) if a else None
                       for a in attention_specs(spec)]
        self.new = None  # step(): each row's one new position at a decode step without padding rows, else None

    def step(self, pos):
        check_length(pos, self.max_len, self.name)
        self.new = pos[:, 0].tolist() if pos.shape[1] == 1 and pos.device.type == "cpu" else None

    def decode_blocks(self, batch: int) -> DecodeBlocks | None:
        """A decode step the fused step can take: every row adds one token right after the ones it holds (none is
        padding). The fused step writes the new token to residual slot res of every layer (`done` then counts it).
        A row whose residual is full (R + G - 1: this token's append would flush a chunk, QuantizedLayer.append) has
        that chunk, its oldest G residual tokens, flushed first (flush_oldest): the chunks and residual the layers
        would leave, so every step is the stack's (the flushing one in G used to run layer by layer: 4 steps in 128
        at int4). With R = 0 the chunk would hold the new token itself: that step is left to the layers.
        """
        new, first = self.new, self.layers[0]
        if new is None or len(new) != batch or first is None:
            return None
        G, chunks, res = first.G, first.chunks, first.res
        if any(p != c * G + r for p, c, r in zip(new, chunks, res)):
            return None  # padding (-1) or a gap
        if any(layer is None or layer.chunks != chunks or layer.res != res for layer in self.layers):
            return None  # every layer must hold the same tokens: one count per row for all of them
        full = [b for b in range(batch) if res[b] + 1 >= first.R + G]
        if full and first.R == 0:
            return None
        views = self.layer_views(lambda: [layer.view() for layer in self.layers])
        if views is None:
            return None
        for b in full:
            for layer in self.layers:
                layer.flush_oldest(b)
        lengths = torch.tensor(new[:batch]) + 1  # (B,)
        quantized = torch.tensor(first.chunks[:batch]) * G  # (B,)
        no_table = torch.empty(batch, 0, dtype=torch.int64)  # (B, 0): kivi views read no block table
        return DecodeBlocks(views, no_table, lengths, quantized, lambda: self._advance(batch))

    def _advance(self, batch: int) -> None:
        """The fused step wrote each row's new token to residual slot res of every layer: count it."""
        for layer in self.layers:
            for b in range(batch):
                layer.res[b] += 1

    def update_only(self, layer, k, v, pos) -> None:
        """Write the new tokens (right-padded rows) without reading anything back."""
        ql = self.layers[layer]
        for b in range(pos.shape[0]):
            sel = pos[b] >= 0
            if bool(sel.any()):
                assert int(pos[b, 0]) == ql.chunks[b] * ql.G + ql.res[b], "rows must grow by consecutive positions"
                ql.append(b, k[b][:, sel], v[b][:, sel])

    def update(self, layer, k, v, pos):
        self.update_only(layer, k, v, pos)
        return self.layers[layer].read(k.dtype)

    def attend(self, layer, q, k, v, pos, scale, window, softcap):
        """Decode (one token per row) reads the packed bytes directly when the C++ kernel builds; prefill,
        soft-capped attention and machines without a compiler take the dequantizing path of KVCache."""
        kernel = quantized_decode() if q.shape[2] == 1 and not softcap and q.device.type == "cpu" else None
        if kernel is None:
            return super().attend(layer, q, k, v, pos, scale, window, softcap)
        self.update_only(layer, k, v, pos)
        return self.layers[layer].attend_decode(q, pos, scale, window, kernel).to(q.dtype)

    def nbytes(self) -> int:
        return sum(layer.nbytes() for layer in self.layers if layer is not None)
