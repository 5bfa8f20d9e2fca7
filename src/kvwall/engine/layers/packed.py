"""Weights kept quantized: PackedLinear holds a projection's (N, K) matrix as int8 / int4 codes plus a float16
scale (and, asymmetric, a float16 zero) per group of G weights along each row, and multiplies by it directly.

Symbols: N output rows, K inputs, G group length (the last group of a row may be shorter), q a code,
d a group's scale, m its zero (min). A group's weights are

    asymmetric (int8, int4, GGUF Q4_1):        w = d q + m          q in 0 .. 2^bits - 1
    symmetric  (int8:sym, int4:sym, Q4_0, Q8_0): w = d (q - 2^(bits-1))   (codes stored offset, unsigned)

Layout (what the C++ kernel reads): ``q`` (N, K bits/8) uint8: 8-bit codes one a byte; 4-bit codes two a
byte, within each group element j in the low nibble of byte j and element j + len/2 in the high nibble
(llama.cpp's Q4_0/Q4_1 block order, so GGUF blocks repack by copying their bytes). ``scale`` and ``zero``
(N, ceil(K/G)) float16. The bytes held per matrix are therefore N (K bits/8 + ceil(K/G) (2 + 2|0)), which
is the predictor's ``Format.bytes(N, K)`` for the same format string (kvwall.spec.formats).

Two paths: ``reference`` dequantizes the matrix and calls F.linear (eager, obviously correct); the fast
path is kernels/packed_linear.cpp (packed.h). Below GEMM_MIN_ROWS rows of x (decode) it dequantizes each
weight in a register, once per four rows of x, and never the whole matrix; from GEMM_MIN_ROWS rows on (a prefill)
it dequantizes a tile of rows at a time to float32, exactly dequantize()'s values, and multiplies x by it with
torch's GEMM. Without a compiler the fast path is the reference (correct, slower).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from kvwall.engine.layers.onednn import OneDnnLinear
from kvwall.errors import KvwallError
from kvwall.spec.formats import Format, packed_weights

# -- codes <-> weights (torch, the reference) ---------------------------------------------------------------

def _group_spans(K: int, G: int) -> list[tuple[int, int]]:
    return [(k0, min(G, K - k0)) for k0 in range(0, K, G)]


def pack_nibbles(codes: torch.Tensor, G: int) -> torch.Tensor:
    """(N, K) codes 0..15 -> (N, K/2) bytes, per group element j low and j + len/2 high."""
    out = []
    for k0, n in _group_spans(codes.shape[1], G):
        g = codes[:, k0:k0 + n].to(torch.uint8)  # (N, len)
        out.append(g[:, :n // 2] | (g[:, n // 2:] << 4))  # (N, len/2)
    return torch.cat(out, 1)


def unpack_codes(q: torch.Tensor, bits: int, K: int, G: int) -> torch.Tensor:
    """(N, K bits/8) bytes -> (N, K) codes as float32."""
    if bits == 8:
        return q.float()
    out = []
    for k0, n in _group_spans(K, G):
        b = q[:, k0 // 2:(k0 + n) // 2]  # (N, len/2)
        out += [b & 15, b >> 4]
    return torch.cat(out, 1).float()  # (N, K)


def _per_element(t: torch.Tensor, K: int, G: int) -> torch.Tensor:
    """(N, groups) -> (N, K): each group's value repeated over its elements."""
    return t.float().repeat_interleave(G, dim=1)[:, :K]


def dequantize(q, scale, zero, bits: int, K: int, G: int) -> torch.Tensor:
    """The float32 (N, K) matrix the codes stand for (the reference the kernel is held to)."""
    codes = unpack_codes(q, bits, K, G)  # (N, K)
    d = _per_element(scale, K, G)  # (N, K)
    c = _per_element(zero, K, G) if zero is not None else -float(1 << (bits - 1)) * d
    return d * codes + c


def quantize(w: torch.Tensor, fmt: Format) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(N, K) float -> (q, scale, zero): round to nearest against the float16 scale and zero actually stored.
    Error per weight: symmetric <= d/2; asymmetric <= d/2 + 2^-11 max|w| of its group (m rounded to fp16)."""
    N, K = w.shape
    G, bits = fmt.group, fmt.bits
    if K % 2 and bits == 4:
        raise KvwallError(f"int4 weights need an even number of inputs per row (got {K})")
    pad = -K % G
    wg = F.pad(w.float(), (0, pad)).view(N, -1, G)  # (N, groups, G), padded with zeros
    real = (torch.arange(K + pad) < K).view(-1, G)  # (groups, G): which slots hold real weights
    top = float((1 << bits) - 1)
    if fmt.zero_bytes:
        lo = wg.masked_fill(~real, float("inf")).amin(-1)  # (N, groups)
        hi = wg.masked_fill(~real, float("-inf")).amax(-1)
        d = ((hi - lo) / top).half()
        m = lo.half()
        inv = torch.where(d.float() > 0, 1 / d.float(), torch.zeros(()))
        codes = ((wg - m.float()[..., None]) * inv[..., None]).round().clamp(0, top)  # (N, groups, G)
        zero = m
    else:
        half = float(1 << (bits - 1))
        d = (wg.abs().amax(-1) / (half - 1)).half()  # (N, groups)
        inv = torch.where(d.float() > 0, 1 / d.float(), torch.zeros(()))
        codes = ((wg * inv[..., None]).round().clamp(-half, half - 1) + half)
        zero = None
    codes = codes.view(N, -1)[:, :K]  # (N, K)
    q = codes.to(torch.uint8) if bits == 8 else pack_nibbles(codes, G)
    return q.contiguous(), d.contiguous(), None if zero is None else zero.contiguous()


# -- the module ---------------------------------------------------------------------------------------------

# From how many rows of x the compiled matmul runs its GEMM path: -1, the kernel's own GEMM_MIN_ROWS (gemm_min_rows());
# 0, never (the row kernel at every M, as before the GEMM path: benchmarks/bench_prefill.py times both); n, from n.
GEMM_ROWS = -1


def round_x8(x: torch.Tensor, G: int) -> torch.Tensor:
    """x (..., K) rounded to int8 per group of G along K, as floats: per group m = max|x|, codes round(x 127/m)
    (ties to even; 0 where m = 0), values codes m/127. The int8-activation mode's x (kernels/packed.h round_x8,
    the same float operations: 127/m, x times it, m/127): llama.cpp rounds activations so for its q8_0 dot products."""
    K = x.shape[-1]
    pad = -K % G
    xp = F.pad(x, (0, pad)).reshape(*x.shape[:-1], -1, G)  # (..., groups, G): a shorter last group padded with 0
    m = xp.abs().amax(-1, keepdim=True)  # (..., groups, 1)
    # tensor by tensor: torch divides by a Python number as a multiply by its reciprocal (and 127.0 / t as
    # t.reciprocal() * 127), which misses the kernel's quotient by an ulp and flips a code at a tie
    c127 = torch.full_like(m, 127.0)
    inv = torch.where(m > 0, c127 / torch.where(m > 0, m, c127), torch.zeros_like(m))
    codes = torch.round(xp * inv)  # (..., groups, G) in -127 .. 127
    return (codes * (m / c127)).reshape(*x.shape[:-1], -1)[..., :K]  # (..., K)


def x8_tiles(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None) -> tuple:
    """The codes again, in the layout of the int8-activation kernel (kernels/packed.h run_x8): 16 packed rows
    interleaved 4 bytes at a time, q (N, QB) -> (T, QB/4, 16, 4) with T = ceil(N/16), and scale, zero (N, NG) ->
    (T, NG, 16); rows past N are 0. One 64-byte load then holds 4 bytes of 16 rows in one group."""
    N = q.shape[0]
    T = -(-N // 16)

    def tile(t: torch.Tensor, inner: int) -> torch.Tensor:  # (N, C) -> (T, C/inner, 16, inner)
        padded = torch.zeros(T * 16, t.shape[1], dtype=t.dtype)  # (16 T, C)
        padded[:N] = t
        return padded.view(T, 16, -1, inner).transpose(1, 2).contiguous()

    return (tile(q, 4), tile(scale, 1).view(T, -1, 16), None if zero is None else tile(zero, 1).view(T, -1, 16))


@functools.lru_cache(maxsize=1)
def packed_kernel():
    """The compiled matmul, or None when it cannot be built (then the reference path runs)."""
    from kvwall.engine.native import compiled

    return compiled("packed_linear", "packed_linear", "dequantize + F.linear (torch)")


def packed_module():
    """The compiled packed_linear module (its constants and x8_fits), or None without it."""
    from kvwall.engine.native import build

    built = build("packed_linear", "dequantize + F.linear (torch)") if packed_kernel() is not None else None
    return None if built is None else built[0]


def dequantize_kernel():
    """The compiled dequantize() (bit for bit its values), or None when it cannot be built."""
    from kvwall.engine.native import compiled

    return compiled("packed_linear", "packed_dequantize", "dequantize (torch)")


@functools.cache
def x8_integer_fits(bits: int, K: int, G: int) -> bool:
    """Whether the compiled matmul has the VNNI integer kernel (this CPU has AVX-512 VNNI) and it takes this shape
    (packed.h x8_fits)."""
    fits = getattr(packed_module(), "x8_fits", None)
    return fits is not None and bool(fits(bits, K, G))


def gemm_min_rows() -> int | None:
    """Rows of x from which the compiled matmul dequantizes to float32 and runs a GEMM (packed.h's GEMM_MIN_ROWS),
    or None without the kernel."""
    mod = packed_module()
    return None if mod is None else int(mod.GEMM_MIN_ROWS)


class PackedLinear(nn.Module):
    """nn.Linear's contract (y = x W^T + b) over a packed W; buffers q, scale, zero (see the module doc)."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, fmt: Format, in_features: int,
                 bias: torch.Tensor | None = None):
        super().__init__()
        self.fmt, self.bits, self.group = fmt, fmt.bits, fmt.group
        self.in_features, self.out_features = in_features, q.shape[0]
        self.register_buffer("q", q)  # (N, K bits/8) uint8
        self.register_buffer("scale", scale)  # (N, groups) float16
        self.register_buffer("zero", zero)  # (N, groups) float16, or None (symmetric)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.eager = False  # True: the reference path (Transformer.set_eager)
        self.x8_tiles = None  # (qt, st, zt): the codes in the integer kernel's layout, while x8 is on (x8_tiles)
        self.x8 = False  # True: x rounded to int8 per group first (round_x8; Transformer.set_activations)

    @property
    def x8(self) -> bool:
        return self._x8

    @x8.setter
    def x8(self, on: bool) -> None:
        """Int8 activations on or off. On, where the compiled kernel has the VNNI integer path and takes this shape,
        the codes are laid out a second time for it (x8_tiles: as many bytes again as the packed matrix, while on),
        from the codes as they are now: codes changed later need the mode set again."""
        self._x8 = bool(on)
        fits = on and self.q.device.type == "cpu" and x8_integer_fits(self.bits, self.in_features, self.group)
        self.x8_tiles = x8_tiles(self.q, self.scale, self.zero) if fits else None

    @classmethod
    def from_linear(cls, lin: nn.Linear, fmt: Format) -> PackedLinear:
        q, scale, zero = quantize(lin.weight.data, fmt)
        return cls(q, scale, zero, fmt, lin.in_features, None if lin.bias is None else lin.bias.data)

    def weight_bytes(self) -> int:
        """Bytes of the packed matrix: the predictor's Format.bytes(N, K) for self.fmt (bias not counted)."""
        return sum(t.numel() * t.element_size() for t in (self.q, self.scale, self.zero) if t is not None)

    def dequantized(self) -> torch.Tensor:
        return dequantize(self.q, self.scale, self.zero, self.bits, self.in_features, self.group)  # (N, K)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        w = self.dequantized()  # (N, K) float32
        b = None if self.bias is None else self.bias.float()
        xf = round_x8(x.float(), self.group) if self.x8 else x.float()  # (..., K)
        return F.linear(xf, w, b).to(x.dtype)  # (..., N)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernel = None if self.eager or x.device.type != "cpu" else packed_kernel()
        if kernel is None:
            return self.reference(x)
        # buffers read from the dicts nn.Module keeps them in: its __getattr__ costs ~1 us a name, and this runs
        # 121 times a SmolLM2 decode step (with the casts skipped when not needed: 12.2 -> 6.7 us a call)
        buf, bias = self._buffers, self._parameters.get("bias")
        x2 = x.reshape(-1, self.in_features)  # (M, K)
        x2 = x2 if x2.dtype == torch.float32 and x2.is_contiguous() else x2.float().contiguous()
        qt, st, zt = self.x8_tiles or (None, None, None)  # the +a8 tiles (x8_tiles), where built
        y = kernel(x2, buf["q"], buf["scale"], buf["zero"], self.bits, self.group, GEMM_ROWS, self.x8, qt, st, zt)
        if bias is not None:
            y = y + bias.float()
        y = y if y.dtype == x.dtype else y.to(x.dtype)  # (M, N)
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        x8 = ", activations=int8" if self.x8 else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, format={self.fmt.label}{x8}"


class PackedEmbedding(nn.Module):
    """nn.Embedding's contract over a packed (V, D) table; `head` is a PackedLinear over the same buffers, the
    tied LM head (the table is held once: the predictor's head_format bytes for the table)."""

    def __init__(self, head: PackedLinear, dtype: torch.dtype):
        super().__init__()
        self.head, self.dtype = head, dtype
        self.embedding_dim = head.in_features

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h, idx = self.head, tokens.flatten()
        q, scale, zero = h.q[idx], h.scale[idx], None if h.zero is None else h.zero[idx]  # only the looked-up rows
        # the compiled dequantize where there is one, the same floats: one Gemma 3 row took torch's ten ops 12 us and
        # the kernel 1 us on the dev box (2026-12-06)
        kernel = None if h.eager or q.device.type != "cpu" else dequantize_kernel()
        rows = (dequantize(q, scale, zero, h.bits, h.in_features, h.group) if kernel is None
                else kernel(q, scale, zero, h.bits, h.in_features, h.group))  # (n, D) float32
        return rows.to(self.dtype).view(*tokens.shape, h.in_features)  # (..., D)

    @property
    def weight(self) -> torch.Tensor:
        return self.head.dequantized().to(self.dtype)  # (V, D): for code that reads the table (slow, rare)


def pack_head(model: nn.Module, fmt: Format | None = None, table=None, head=None) -> None:
    """The embedding table and an untied LM head into packed form, in place: quantized to `fmt`, or the
    checkpoint's own blocks table / head = (q, scale, zero, Format) (None: that one stays float)."""
    dtype = model.embed.weight.dtype
    if fmt is not None or table is not None:
        got = quantize(model.embed.weight.data, fmt) + (fmt,) if fmt is not None else table
        model.embed = PackedEmbedding(PackedLinear(*got, model.spec.hidden), dtype)
    if model.lm_head is not None and (fmt is not None or head is not None):
        got = quantize(model.lm_head.weight.data, fmt) + (fmt,) if fmt is not None else head
        model.lm_head = PackedLinear(*got, model.spec.hidden)
    model.forget_stack()  # its fused decode step held the float matrices


def pack_model(model: nn.Module, fmt: Format | None = None, source=None) -> nn.Module:
    """Replace every projection (attention qkv/o, MLP and expert MLP matrices: engine.model.projections; the LM
    head and embedding table follow fmt.head, pack_head) by a PackedLinear, in place: quantized to `fmt`, or
    taken from source(name, linear) -> (q, scale, zero, Format) | None (a .gguf's own blocks; None: float)."""
    from kvwall.engine.model import projections

    if fmt is not None and not packed_weights(fmt):
        raise KvwallError(f"weight format {fmt.label} is not one the engine packs (int8 / int4 with :gN, q4_0, q4_1, "
                          "q8_0)")
    targets = {id(lin) for lin in projections(model)} - {id(getattr(model, "lm_head", None))}
    for prefix, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            if id(child) not in targets:
                continue
            child = child.linear() if isinstance(child, OneDnnLinear) else child  # a prepacked model's projection
            if fmt is not None:
                setattr(parent, name, PackedLinear.from_linear(child, fmt))
            elif (got := source(f"{prefix}.{name}" if prefix else name, child)) is not None:
                bias = None if child.bias is None else child.bias.data
                setattr(parent, name, PackedLinear(*got, child.in_features, bias))
    if fmt is not None and fmt.head is not None:
        pack_head(model, fmt.head)
    model.forget_stack()  # its fused decode step held the float matrices
    return model


def weight_bytes(model: nn.Module) -> int:
    """Every weight the model holds: packed matrices at their packed bytes (a packed table and its tied head
    once), every other parameter at its dtype (a tied LM head once). Loaded in bf16 with packed projections
    this is the predictor's total_weight_bytes. A float matrix in oneDNN's layout (OneDnnLinear) counts its
    float bytes, and a tied head's oneDNN copy (Transformer.head_copy) counts too: it is held besides the table."""
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    return params + sum(m.weight_bytes() for m in model.modules() if isinstance(m, (PackedLinear, OneDnnLinear)))
