"""Storage formats: how many bytes n elements take, scales and zero points included.

Layout convention (the same for weights, KV cache and SSM state): elements are
grouped along the contiguous dimension of each vector (a head's head_dim for a
K or V vector, a row for a weight matrix) in groups of ``group`` elements. Each
group stores ``bits`` per element, packed (sub-byte formats round the packed
data of a vector up to whole bytes), plus one scale and, for asymmetric
formats, one zero point:

==========  ====  =====  ===========  ===========  ================================
name        bits  group  scale        zero point   bytes per element (group default)
==========  ====  =====  ===========  ===========  ================================
fp32        32    -      -            -            4
fp16/bf16   16    -      -            -            2
fp8, e4m3,  8     -      per tensor   -            1 (one fp32 scale per tensor,
e5m2                     (not counted)             a few bytes: not counted)
int8        8     128    fp16         fp16         1 + 4/128   = 1.031
int4        4     32     fp16         fp16         0.5 + 4/32  = 0.625  (KIVI-4)
int2        2     32     fp16         fp16         0.25 + 4/32 = 0.375  (KIVI-2)
nvfp4       4     16     fp8 e4m3     -            0.5 + 1/16  = 0.5625 (plus an fp32
                                                   per-tensor scale, not counted)
mxfp4       4     32     e8m0 (1 B)   -            0.5 + 1/32  = 0.53125
==========  ====  =====  ===========  ===========  ================================

Integer formats take a group size suffix: ``int4:g128`` (weights, GPTQ/AWQ
style), ``int8:g64``; ``int8:sym`` drops the zero point.

A weight format may name a second format after a slash for the embedding table
and the LM head: ``q4_1/q8_0`` is SmolLM2's GGUF (Q4_1 projections, a Q8_0
token table that is also its tied head), ``int4:g128/int8``. Without one they
stay 16-bit when the projections are quantized (``keep_16bit``), as most
checkpoints ship them; llama.cpp's quantizer does not keep them 16-bit.

llama.cpp's GGUF block formats are fixed layouts in the same terms (block structs
in ggml-common.h; a "scale" here is every per-block byte that is not a quant):

=====  ====  =====  ===================================  ==============
name   bits  block  per-block metadata                   bytes / block
=====  ====  =====  ===================================  ==============
q4_0   4     32     fp16 d                               18
q4_1   4     32     fp16 d, fp16 m                       20
q5_0   5     32     fp16 d (+ the fifth bits, counted)   22
q5_1   5     32     fp16 d, fp16 m                       24
q8_0   8     32     fp16 d                               34
q2_k   2     256    16 B sub-scales, fp16 d, dmin        84
q3_k   3     256    12 B sub-scales, fp16 d (+ hmask)    110
q4_k   4     256    12 B sub-scales, fp16 d, dmin        144
q5_k   5     256    12 B sub-scales, fp16 d, dmin        176
q6_k   6     256    16 B sub-scales, fp16 d              210
=====  ====  =====  ===================================  ==============
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvwall.errors import KvwallError
from kvwall.units import ascii_digits


@dataclass(frozen=True)
class Format:
    name: str
    bits: int
    group: int | None = None  # elements sharing one scale (None: no per-group metadata)
    scale_bytes: int = 0
    zero_bytes: int = 0
    torch_dtype: str | None = None  # the element type an engine stores (None: packed integers)
    fixed: bool = False  # a fixed block layout (nvfp4, GGUF blocks): no :gN / :sym options
    head: Format | None = None  # weights only: the embedding table's and LM head's format (None: keep_16bit)

    @property
    def label(self) -> str:
        own = self.name if self.group is None or self.fixed else (
            f"{self.name}:g{self.group}" + ("" if self.zero_bytes else ":sym"))
        return own if self.head is None else f"{own}/{self.head.label}"

    def vector_bytes(self, n: int) -> int:
        """Bytes of one vector of n elements: packed data + per-group scale/zero."""
        data = -(-n * self.bits // 8)
        if self.group is None:
            return data
        groups = -(-n // self.group)
        return data + groups * (self.scale_bytes + self.zero_bytes)

    def bytes(self, n_vectors: int, vector_len: int) -> int:
        return n_vectors * self.vector_bytes(vector_len)

    def bytes_per_element(self) -> float:
        """Average, for a long vector made of whole groups."""
        if self.group is None:
            return self.bits / 8
        return self.bits / 8 + (self.scale_bytes + self.zero_bytes) / self.group

    def is_float(self) -> bool:
        return self.torch_dtype is not None


_BASE = {
    "fp32": Format("fp32", 32, torch_dtype="float32"),
    "fp16": Format("fp16", 16, torch_dtype="float16"),
    "bf16": Format("bf16", 16, torch_dtype="bfloat16"),
    "fp8": Format("fp8", 8, torch_dtype="float8_e4m3fn"),
    "fp8_e4m3": Format("fp8_e4m3", 8, torch_dtype="float8_e4m3fn"),
    "fp8_e5m2": Format("fp8_e5m2", 8, torch_dtype="float8_e5m2"),
    "int8": Format("int8", 8, 128, 2, 2),
    "int4": Format("int4", 4, 32, 2, 2),
    "int2": Format("int2", 2, 32, 2, 2),
    "nvfp4": Format("nvfp4", 4, 16, 1, 0, fixed=True),
    "mxfp4": Format("mxfp4", 4, 32, 1, 0, fixed=True),
    # GGUF blocks (see the table above): scale_bytes + zero_bytes = the block's non-quant bytes
    "q4_0": Format("q4_0", 4, 32, 2, 0, fixed=True),
    "q4_1": Format("q4_1", 4, 32, 2, 2, fixed=True),
    "q5_0": Format("q5_0", 5, 32, 2, 0, fixed=True),
    "q5_1": Format("q5_1", 5, 32, 2, 2, fixed=True),
    "q8_0": Format("q8_0", 8, 32, 2, 0, fixed=True),
    "q2_k": Format("q2_k", 2, 256, 20, 0, fixed=True),
    "q3_k": Format("q3_k", 3, 256, 14, 0, fixed=True),
    "q4_k": Format("q4_k", 4, 256, 16, 0, fixed=True),
    "q5_k": Format("q5_k", 5, 256, 16, 0, fixed=True),
    "q6_k": Format("q6_k", 6, 256, 18, 0, fixed=True),
}
_ALIASES = {"float32": "fp32", "f32": "fp32", "float16": "fp16", "f16": "fp16", "half": "fp16", "bfloat16": "bf16",
            "e4m3": "fp8_e4m3", "e5m2": "fp8_e5m2", "float8": "fp8", "fp4": "nvfp4"}
FORMAT_NAMES = sorted(_BASE)


def get_format(text: str, head_ok: bool = False) -> Format:
    """'bf16', 'fp8', 'int4', 'int4:g128', 'int8:g64:sym' -> Format; a weight format (head_ok) may add /HEAD:
    'q4_1/q8_0' -> q4_1 with a q8_0 embedding table and LM head."""
    own, slash, head = str(text).strip().lower().partition("/")
    if slash and not head_ok:
        raise KvwallError(f"format {text!r}: only a weight format takes a /HEAD part (the embedding table's and "
                          "LM head's format); drop it")
    if slash:
        if not head or "/" in head:
            raise KvwallError(f"format {text!r}: write WEIGHTS/HEAD with one format each side, e.g. q4_1/q8_0")
        return replace(_one_format(own), head=_one_format(head))
    return _one_format(own)


def _one_format(text: str) -> Format:
    parts = text.split(":")
    base = _ALIASES.get(parts[0], parts[0])
    if base not in _BASE:
        raise KvwallError(f"unknown format {text!r}; known formats: {', '.join(FORMAT_NAMES)} "
                          "(integer formats take :gN for group size, e.g. int4:g128)")
    fmt = _BASE[base]
    for opt in parts[1:]:
        if fmt.group is None or fmt.fixed:
            raise KvwallError(f"format {text!r}: {base} has a fixed layout and takes no options")
        if opt == "sym":
            fmt = replace(fmt, zero_bytes=0)
        elif opt.startswith("g") and ascii_digits(opt[1:]) and len(opt) <= 12 and int(opt[1:]) > 0:
            fmt = replace(fmt, group=int(opt[1:]))
        else:
            raise KvwallError(f"format {text!r}: option {opt!r} not understood; use :gN (group size) or :sym")
    return fmt


NATIVE = "native"  # --weights native: a .gguf's own Q4_0 / Q4_1 / Q8_0 blocks, repacked at load
ENGINE_WEIGHTS = ("fp32, bf16, fp16, int8[:gN][:sym], int4[:gN][:sym], q4_0, q4_1, q8_0 "
                  "(each with an optional /HEAD packed format for the embedding table and LM head, e.g. int4/q8_0) "
                  "or native (a .gguf's own blocks)")


def packed_weights(fmt: Format) -> bool:
    """A weight format the engine holds packed (engine/layers/packed.py): 8- or 4-bit codes with an fp16 scale
    and optional fp16 zero per even-sized group (int8/int4 with any :gN and :sym; GGUF's q4_0, q4_1, q8_0)."""
    return (not fmt.is_float() and fmt.bits in (4, 8) and fmt.group is not None and fmt.group % 2 == 0
            and fmt.scale_bytes == 2 and fmt.zero_bytes in (0, 2))


def engine_weights(text: str) -> Format | None:
    """`--weights` value -> the Format the engine holds its projections in (None: native). The engine's bytes for
    a format equal the predictor's for the same string (`--weight-format`)."""
    if str(text).strip().lower() == NATIVE:
        return None
    try:
        fmt = get_format(text, head_ok=True)
    except KvwallError:
        fmt = None
    if fmt is None or not ((fmt.is_float() and fmt.bits >= 16) or packed_weights(fmt)):
        raise KvwallError(f"{text!r} is not a weight format the engine holds; pick one of {ENGINE_WEIGHTS}")
    if fmt.head is not None and not packed_weights(fmt.head):
        raise KvwallError(f"--weights {text}: the engine holds an embedding table / LM head format after '/' only "
                          "packed (int8, int4, q4_0, q4_1, q8_0); without '/' they stay in the model's dtype")
    return fmt


def keep_16bit(fmt: Format) -> Format:
    """Norms (and, without a /HEAD format, embeddings and the LM head) stay 16-bit when the weights are
    quantized below 16 bits."""
    return replace(fmt, head=None) if fmt.bits >= 16 else _BASE["bf16"]


def head_format(fmt: Format) -> Format:
    """The embedding table's and LM head's format under weight format `fmt`: its /HEAD part, else keep_16bit."""
    return fmt.head or keep_16bit(fmt)


def checkpoint_format(dtype: str | None) -> Format:
    """The format a checkpoint's torch_dtype names (bf16 when unknown or absent)."""
    if dtype in ("float32", "float16", "bfloat16"):
        return get_format(dtype)
    return _BASE["bf16"]
