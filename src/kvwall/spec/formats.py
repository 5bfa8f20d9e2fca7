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

A checkpoint's own format (config.json's ``quantization_config``, read as transformers 5.25 does:
native_format) is counted per matrix as stored (Format.matrix_bytes) and chosen per tensor by tensor_format:
block-wise FP8 (e4m3 values, one fp32 ``weight_scale_inv`` per 128 x 128 block, ceil on each side), MXFP4 on
the MoE experts only (e2m1 values, one E8M0 exponent per 32), GPTQ (packed values, fp16 scales per group, 4-bit
qzeros, sym or not, and an int32 g_idx per input feature), AWQ (GPTQ without g_idx; no zeros without
zero_point), compressed-tensors int groups/channels and fp8 channels/blocks. Norms, routers, embeddings, the
LM head and modules_to_not_convert / ignore stay in the model's dtype.

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
    # a checkpoint's own format (quantization_config: native_format); get_format sets only `only` (:experts)
    block: tuple[int, int] | None = None  # one scale_bytes scale per (out x in) block of a matrix (block-wise FP8)
    zero_bits: int = 0  # a packed zero point of this many bits per group (GPTQ/AWQ qzeros), counted per matrix
    index_bytes: int = 0  # per input feature of each matrix (GPTQ's int32 g_idx)
    only: str | None = None  # "experts": only the routed experts' matrices are in this format
    skip: tuple[str, ...] = ()  # modules left unquantized (modules_to_not_convert, ignore): last name parts
    quantized: tuple[str, ...] = ()  # if any: the only modules quantized (GPTQ modules_in_block_to_quantize)
    source: str | None = None  # where this format came from: "quantization_config", "--weight-format"
    detail: str = ""  # what the label adds, e.g. "block 128x128"

    @property
    def label(self) -> str:
        if self.source is not None:  # a checkpoint's own format names its layout; an override its own label
            own = self.name if per_tensor(self) and self.source != "--weight-format" else (
                replace(self, source=None, detail="").label)  # a named :experts keeps its name
            inside = ", ".join(x for x in (self.detail, f"from {self.source}") if x)
            return f"{own} ({inside})"
        own = self.name if self.group is None or self.fixed else (
            f"{self.name}:g{self.group}" + ("" if self.zero_bytes else ":sym"))
        own += ":experts" if self.only == "experts" else ""
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

    def matrix_bytes(self, rows: int, cols: int) -> int:
        """Bytes of one (rows = out) x (cols = in) weight matrix as a checkpoint stores it: the values, packed along
        each row, plus per-group scales (and zeros), per-block scales, packed zeros and g_idx."""
        if self.block is not None:
            br, bc = self.block
            return -(-rows * cols * self.bits // 8) + (-(-rows // br)) * (-(-cols // bc)) * self.scale_bytes
        total = rows * self.vector_bytes(cols) + self.index_bytes * cols
        if self.zero_bits and self.group is not None:
            total += -(-rows * (-(-cols // self.group)) * self.zero_bits // 8)
        return total

    def bytes_per_element(self) -> float:
        """Average, for a long vector made of whole groups."""
        if self.block is not None:
            return self.bits / 8 + self.scale_bytes / (self.block[0] * self.block[1])
        if self.group is None:
            return self.bits / 8
        return self.bits / 8 + (self.scale_bytes + self.zero_bytes + self.zero_bits / 8) / self.group

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
    'q4_1/q8_0' -> q4_1 with a q8_0 embedding table and LM head, and :experts: 'mxfp4:experts/q8_0' -> the routed
    experts in mxfp4, every other tensor (attention, router, norms, embedding, LM head) in q8_0."""
    own, slash, head = str(text).strip().lower().partition("/")
    if "experts" in head.split(":") or ("experts" in own.split(":") and not head_ok):
        raise KvwallError(f"format {text!r}: only a weight format's own part takes :experts (the routed experts' "
                          "format; the rest take /HEAD's), e.g. mxfp4:experts/q8_0")
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
        if opt == "experts":  # only the routed experts in this format, every other tensor in /HEAD's (else bf16)
            fmt = replace(fmt, only="experts")  # e.g. llama.cpp's gpt-oss GGUF: mxfp4:experts/q8_0
            continue
        if fmt.group is None or fmt.fixed:
            raise KvwallError(f"format {text!r}: {base} has a fixed layout and takes no options")
        if opt == "sym":
            fmt = replace(fmt, zero_bytes=0)
        elif opt.startswith("g") and ascii_digits(opt[1:]) and len(opt) <= 12 and int(opt[1:]) > 0:
            fmt = replace(fmt, group=int(opt[1:]))
        else:
            raise KvwallError(f"format {text!r}: option {opt!r} not understood; use :gN (group size), :sym or "
                              ":experts (only the routed experts in it)")
    return fmt


NATIVE = "native"  # --weights native: a .gguf's own Q4_0 / Q4_1 / Q8_0 blocks, repacked at load
A8 = "+a8"  # --weights ...+a8: packed projections round their input to int8 per group (Transformer.set_activations)
ENGINE_WEIGHTS = ("fp32, bf16, fp16, int8[:gN][:sym], int4[:gN][:sym], q4_0, q4_1, q8_0 "
                  "(each with an optional /HEAD packed format for the embedding table and LM head, e.g. int4/q8_0) "
                  "or native (a .gguf's own blocks); a packed one may end in +a8 (activations rounded to int8 per "
                  "group, as llama.cpp does: approximate, faster)")


def split_activations(text: str) -> tuple[str, str]:
    """`--weights` text -> (the weight format's text, the activations: "int8" with a +a8 suffix, else "fp32")."""
    t = str(text).strip()
    return (t[:-len(A8)], "int8") if t.lower().endswith(A8) else (t, "fp32")


def packed_weights(fmt: Format) -> bool:
    """A weight format the engine holds packed (engine/layers/packed.py): 8- or 4-bit codes with an fp16 scale
    and optional fp16 zero per even-sized group (int8/int4 with any :gN and :sym; GGUF's q4_0, q4_1, q8_0)."""
    return (not fmt.is_float() and fmt.bits in (4, 8) and fmt.group is not None and fmt.group % 2 == 0
            and fmt.scale_bytes == 2 and fmt.zero_bytes in (0, 2))


def engine_weights(text: str) -> Format | None:
    """`--weights` value -> the Format the engine holds its projections in (None: native). The engine's bytes for
    a format equal the predictor's for the same string (`--weight-format`); a +a8 suffix (split_activations) is
    the activations', not the weights'."""
    text, activations = split_activations(text)
    if text.lower() == NATIVE:
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
    if activations == "int8" and fmt.is_float():
        raise KvwallError(f"{text}{A8}: +a8 rounds the inputs of packed projections, and {text} packs none; "
                          f"use a packed format (e.g. q8_0{A8}) or native{A8}")
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


# -- a checkpoint's own format (config.json's quantization_config, as transformers 5.25 reads it) --------------

TENSOR_KINDS = ("linear", "expert", "router", "norm", "embed", "head")
QUANT_METHODS = ("fp8", "mxfp4", "gptq", "awq", "compressed-tensors")
_WHOLE_ROW = 1 << 40  # group_size -1 / strategy "channel": one group per row


def per_tensor(fmt: Format) -> bool:
    """A checkpoint's format that picks tensors (some quantized, some in the model's dtype), counted per matrix."""
    return bool(fmt.block or fmt.only or fmt.zero_bits or fmt.index_bytes or fmt.skip or fmt.quantized)


def _skipped(name: str, skip: tuple[str, ...]) -> bool:
    parts = name.split(".")
    return any(s in parts for s in skip)


def tensor_format(fmt: Format, kind: str, name: str = "") -> Format:
    """THE rule for one tensor's format under weight format `fmt`. kind: linear (attention and MLP projections,
    shared experts), expert (routed experts' matrices), router, norm, embed (token table), head (LM head); name:
    its module path inside a layer ("self_attn.q_proj", "mlp.experts"), matched against `fmt.skip`.
    A format the user names: norms 16-bit (keep_16bit), embed/head in head_format, the rest in it.
    A checkpoint's own format: norms, routers (not nn.Linear in DeepSeek-V3 / gpt-oss), embeddings, the LM head
    and skipped modules in the model's dtype (fmt.head); with only="experts" the routed experts alone quantized."""
    assert kind in TENSOR_KINDS, kind
    if not per_tensor(fmt):
        if kind == "norm":
            return keep_16bit(fmt)
        return head_format(fmt) if kind in ("embed", "head") else fmt
    dense = fmt.head or _BASE["bf16"]
    if kind in ("norm", "router", "embed", "head") or _skipped(name, fmt.skip):
        return dense
    if fmt.quantized and name.split(".")[-1] not in fmt.quantized:
        return dense
    if fmt.only == "experts" and kind != "expert":
        return dense
    return replace(fmt, head=None, source=None, detail="", skip=(), only=None, quantized=())


def _names(value, what: str) -> tuple[str, ...]:
    """modules_to_not_convert / ignore -> last name parts ("model.layers.*.self_attn" -> "self_attn";
    compressed-tensors' "re:.*mlp.gate$" -> "gate")."""
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise KvwallError(f"quantization_config: {what} should be a list of module names (got {value!r})")
    out = []
    for v in value:
        v = v[3:] if v.startswith("re:") else v
        last = v.replace("$", "").replace("\\", "").rstrip(".*").split(".")[-1]
        if last:
            out.append(last)
    return tuple(out)


def _int(qc: dict, key: str, default: int | None = None) -> int:
    v = qc.get(key, default)
    if not isinstance(v, int) or isinstance(v, bool):
        raise KvwallError(f"quantization_config: {key} should be an integer (got {v!r})")
    return v


def checkpoint_weights(qc, dtype: str | None) -> Format | None:
    """native_format, its error kept for later (UNREADABLE, bits 0, the message in detail): a --weight-format
    overrides a quantization_config kvwall cannot count, and Formats.for_spec raises it only without one."""
    try:
        return native_format(qc, dtype)
    except KvwallError as exc:
        return Format(UNREADABLE, 0, source="quantization_config", detail=str(exc))


UNREADABLE = "unreadable"


def native_format(qc, dtype: str | None) -> Format | None:
    """config.json's quantization_config -> the Format its checkpoint stores weights in (None: no such config).
    Unknown methods and layouts raise one line that names them and the --weight-format override."""
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise KvwallError(f"quantization_config should be an object (got {type(qc).__name__})")
    dense = checkpoint_format(dtype)
    dense = dense if dense.bits <= 16 else _BASE["bf16"]
    method = str(qc.get("quant_method", "")).lower().replace("_", "-")
    common = {"head": dense, "source": "quantization_config"}
    if method == "fp8":  # FineGrainedFP8Config: e4m3 values, one fp32 weight_scale_inv per block
        block = qc.get("weight_block_size", [128, 128])
        if block is None:  # per-tensor scaling: one fp32 scale for the whole matrix
            return Format("fp8", 8, None, 4, torch_dtype="float8_e4m3fn", block=(_WHOLE_ROW, _WHOLE_ROW),
                          skip=_names(qc.get("modules_to_not_convert"), "modules_to_not_convert"),
                          detail="per tensor", **common)
        if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
            raise KvwallError(f"quantization_config: weight_block_size should be two positive integers "
                              f"(got {block!r}); --weight-format overrides the checkpoint's format")
        return Format("fp8", 8, None, 4, torch_dtype="float8_e4m3fn", block=(block[0], block[1]),
                      skip=_names(qc.get("modules_to_not_convert"), "modules_to_not_convert"),
                      detail=f"block {block[0]}x{block[1]}", **common)
    if method == "mxfp4":  # Mxfp4Config: e2m1 values, one e8m0 exponent per 32, on the MoE experts only
        return replace(_BASE["mxfp4"], only="experts", detail="experts only",
                       skip=_names(qc.get("modules_to_not_convert"), "modules_to_not_convert"), **common)
    if method in ("gptq", "awq"):
        bits, group = _int(qc, "bits", 4), _int(qc, "group_size", 128)
        if bits not in (2, 3, 4, 8) or (group <= 0 and group != -1):
            raise KvwallError(f"quantization_config: {method} bits={bits} group_size={group} is not a layout "
                              "kvwall counts; --weight-format overrides the checkpoint's format")
        gptq = method == "gptq"  # GPTQ stores qzeros even when sym, and an int32 g_idx per input feature
        zeros = bits if gptq or qc.get("zero_point", True) else 0
        skip = _names(qc.get("modules_to_not_convert"), "modules_to_not_convert")
        blocks = qc.get("modules_in_block_to_quantize") if gptq else None
        if blocks is not None and not (isinstance(blocks, list) and all(isinstance(b, list) for b in blocks)):
            raise KvwallError(f"quantization_config: modules_in_block_to_quantize should be a list of lists of "
                              f"module names (got {blocks!r}); --weight-format overrides the checkpoint's format")
        only = _names([n for b in blocks for n in b], "modules_in_block_to_quantize") if blocks else ()
        return Format(f"int{bits}", bits, _WHOLE_ROW if group == -1 else group, 2, 0, zero_bits=zeros,
                      index_bytes=4 if gptq else 0, skip=skip or ("lm_head",), quantized=only,
                      detail=f"{method} g{group}" + ("" if zeros else " sym"), **common)
    if method == "compressed-tensors":
        groups = qc.get("config_groups")
        weights = [g.get("weights") for g in groups.values() if isinstance(g, dict)] if isinstance(groups, dict) \
            else []
        w = weights[0] if weights and isinstance(weights[0], dict) else None
        if w is None or any(x != w for x in weights):
            raise KvwallError("quantization_config: compressed-tensors without one weights scheme in config_groups "
                              "is not counted; --weight-format overrides the checkpoint's format")
        bits, kind, strategy = _int(w, "num_bits"), w.get("type", "int"), w.get("strategy", "tensor")
        skip = _names(qc.get("ignore"), "ignore")
        if kind == "int" and strategy in ("group", "channel"):
            group = _int(w, "group_size") if strategy == "group" else _WHOLE_ROW
            zeros = 0 if w.get("symmetric", True) else bits
            return Format(f"int{bits}", bits, group, dense.bits // 8, 0, zero_bits=zeros, skip=skip or ("lm_head",),
                          detail=f"compressed-tensors {strategy}" + (f" {group}" if strategy == "group" else "")
                          + ("" if zeros else " sym"), **common)
        if kind == "float" and bits == 8 and strategy in ("channel", "block"):
            block = w.get("block_structure") if strategy == "block" else [1, _WHOLE_ROW]
            if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
                raise KvwallError(f"quantization_config: block_structure should be two positive integers (got "
                                  f"{block!r}); --weight-format overrides the checkpoint's format")
            return Format("fp8", 8, None, dense.bits // 8, torch_dtype="float8_e4m3fn", block=(block[0], block[1]),
                          skip=skip or ("lm_head",),
                          detail=f"compressed-tensors {strategy}", **common)
        raise KvwallError(f"quantization_config: compressed-tensors weights {kind} {bits}-bit strategy {strategy!r} "
                          "is not counted; --weight-format overrides the checkpoint's format")
    raise KvwallError(f"quantization_config: quant_method {qc.get('quant_method')!r} is not one kvwall counts "
                      f"(known: {', '.join(QUANT_METHODS)}); --weight-format FORMAT overrides the checkpoint's format")
