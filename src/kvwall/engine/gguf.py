"""Load a GGUF file (llama.cpp's format) into the engine.

The config comes from the file's metadata (kvwall.spec.gguf_meta) and the tensors are served under
their Hugging Face names by `GGUFCheckpoint`, dequantized to float32, so the same name maps and
`load_state` that load a safetensors checkpoint load a .gguf. Two things llama.cpp's converter does
to the weights are undone here, as transformers does on load: llama's Q and K rows are permuted
(interleaved rotary pairs), and Gemma's RMSNorm weights are stored as 1 + w.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch

from kvwall.engine.model import Transformer, check_supported
from kvwall.errors import KvwallError
from kvwall.spec.formats import get_format
from kvwall.spec.gguf_meta import config_from_meta, open_reader, read_meta
from kvwall.spec.hf import spec_from_config

# GGUF tensor name (after "blk.N.") -> HF name (after "model.layers.N."), per architecture
_LAYER_COMMON = {
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_NAMES = {
    "llama": {**_LAYER_COMMON, "ffn_norm": "post_attention_layernorm"},
    "gemma3": {**_LAYER_COMMON, "post_attention_norm": "post_attention_layernorm",
               "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm"},
}
_OUTSIDE = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")


def hf_name(arch: str, gguf_name: str) -> str | None:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight` (None for a tensor kvwall ignores)."""
    m = _BLOCK.match(gguf_name)
    if m:
        hf = _LAYER_NAMES[arch].get(m.group(2))
        return None if hf is None else f"model.layers.{m.group(1)}.{hf}.{m.group(3)}"
    stem, _, kind = gguf_name.rpartition(".")
    return f"{_OUTSIDE[stem]}.{kind}" if stem in _OUTSIDE else None


def gguf_name(arch: str, hf: str) -> str:
    """hf_name's inverse, for messages: `model.layers.3.self_attn.q_proj.weight` -> `blk.3.attn_q.weight` (the HF
    name itself where the file format has none)."""
    m = re.match(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)$", hf)
    if m:
        stem = next((g for g, h in _LAYER_NAMES[arch].items() if h == m.group(2)), None)
        return hf if stem is None else f"blk.{m.group(1)}.{stem}.{m.group(3)}"
    stem, _, kind = hf.rpartition(".")
    return next((f"{g}.{kind}" for g, h in _OUTSIDE.items() if h == stem), hf)


def unpermute_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row order: HF rotates the two halves of each head, ggml rotates adjacent
    pairs, so the converter stored each head's rows (half, index) as (index, half); swap them back."""
    rows = w.shape[0]
    half = rows // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)  # (rows, cols)


class GGUFCheckpoint:
    """A .gguf's tensors by Hugging Face name, dequantized to float32 on request (engine/load.py's
    Checkpoint interface: find, get, weight_map, shapes, path)."""

    def __init__(self, path: str | Path, reader=None):
        self.path = Path(path)
        self.reader = reader if reader is not None else open_reader(path)
        self.meta = read_meta(path, self.reader)
        self.config = config_from_meta(self.meta)
        arch = self.meta.arch
        tensors = {t.name: t for t in self.reader.tensors}
        self.weight_map = {hf: tensors[g] for g in tensors if (hf := hf_name(arch, g)) is not None}
        self.shapes = {hf: _torch_shape(t) for hf, t in self.weight_map.items()}  # checked before loading

    def find(self, name: str) -> str | None:
        return name if name in self.weight_map else None

    def mismatch(self, problems: str) -> KvwallError:
        """load.check_names' error for a .gguf: its tensors against its own metadata."""
        return KvwallError(f"{self.path}: the tensors do not match the file's metadata: {problems}; the file is "
                           "damaged or converted wrongly: re-download or re-convert it")

    def shown(self, name: str) -> str:
        return gguf_name(self.meta.arch, name)

    def get(self, name: str) -> torch.Tensor:
        if name not in self.weight_map:
            raise KvwallError(f"{self.path}: tensor {name!r} is missing from the GGUF file; "
                              "is it a complete model of a supported architecture?")
        return self._fix(name, _dequantize(self.weight_map[name]))

    def packed(self, name: str):
        """(q, scale, zero, Format) of a tensor in PackedLinear's layout (repack: Q4_0 / Q4_1 / Q8_0 / Q5_0 bit for
        bit, Q4_K and Q6_K with their sub-block scales rounded to fp16) (Q/K rows put back in HF order like get's);
        None for any other type (it stays dequantized)."""
        got = repack(self.weight_map[name])
        return None if got is None else (*(self._fix(name, t) if t is not None else None for t in got[:3]), got[3])

    def _fix(self, name: str, w: torch.Tensor) -> torch.Tensor:
        arch, cfg = self.meta.arch, self.config
        if arch == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
            return unpermute_rows(w, cfg["num_attention_heads"])
        if arch == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
            return unpermute_rows(w, cfg.get("num_key_value_heads") or cfg["num_attention_heads"])
        if arch == "gemma3" and name.endswith("norm.weight"):
            return w - 1.0  # llama.cpp stored Gemma's 1 + w; the engine's rms1p norm adds the 1
        return w


def _torch_shape(tensor) -> tuple[int, ...]:
    """A GGUF tensor's shape in PyTorch's order (GGUF lists the fastest-varying dimension first)."""
    return tuple(int(x) for x in reversed(tensor.shape.tolist()))


def _dequantize(tensor) -> torch.Tensor:
    """One GGUF tensor as float32 torch, in PyTorch's (rows, cols) order."""
    from gguf.quants import dequantize

    try:
        arr = dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError:
        raise KvwallError(f"tensor {tensor.name} is stored as {tensor.tensor_type.name}, which the gguf package "
                          "cannot dequantize; upgrade gguf or use another quantization") from None
    arr = np.ascontiguousarray(arr, dtype=np.float32).reshape(_torch_shape(tensor))
    return torch.from_numpy(arr if arr.flags.writeable else arr.copy())  # F32 comes back as a view of the file


# GGUF block type -> (the predictor's format name, bytes per 32-weight block, offset of the codes in a block)
_BLOCKS = {"Q4_0": ("q4_0", 18, 2), "Q4_1": ("q4_1", 20, 4), "Q8_0": ("q8_0", 34, 2)}


def repack(tensor):
    """A Q4_0 / Q4_1 / Q8_0 tensor's blocks (ggml-common.h: fp16 d, [fp16 m,] 16 nibble bytes or 32 int8) as
    PackedLinear's (q, scale, zero, Format), bit for bit: Q4_1 w = d q + m is int4 g32 with zero m; Q4_0
    w = d (q - 8) is int4 g32 symmetric; Q8_0 w = d q (signed) is int8 g32 symmetric with codes q + 128.
    Nibble order is already PackedLinear's (low nibble element j, high nibble j + 16). Q5_0, Q4_K, Q6_K: their
    own repack_ functions. None for other types."""
    own = _REPACK.get(tensor.tensor_type.name)
    if own is not None:
        return own(tensor)
    kind = _BLOCKS.get(tensor.tensor_type.name)
    if kind is None:
        return None
    name, size, at = kind
    N, K = _torch_shape(tensor)
    raw = np.asarray(tensor.data, dtype=np.uint8).reshape(N, K // 32, size)  # (N, blocks, block bytes)
    half = lambda lo: torch.from_numpy(raw[..., lo:lo + 2].copy().view(np.float16).reshape(N, K // 32))  # noqa: E731
    codes = raw[..., at:].reshape(N, -1)  # (N, K/2) nibble pairs or (N, K) int8
    if name == "q8_0":
        codes = (codes.view(np.int8).astype(np.int16) + 128).astype(np.uint8)
    zero = half(2) if name == "q4_1" else None
    return torch.from_numpy(np.ascontiguousarray(codes)), half(0), zero, get_format(name)


def repack_q4_k(tensor):
    """A Q4_K tensor (ggml-common.h block_q4_K: 256 weights as fp16 d and dmin, 8 six-bit scales and mins in 12
    bytes, 128 nibble bytes) as Q4_1 blocks, one per 32-weight sub-block j: w = d sc_j q - dmin m_j is Q4_1's
    d' q + m' with d' = d sc_j and m' = -dmin m_j, each rounded to fp16 (the only loss: at most 2^-11 of each,
    relative; None where one leaves fp16's normal range: as_half). 5.0 bits a weight where the file holds 4.5.
    A chunk of 64 weights keeps sub-block 2c in its 32 bytes' low nibbles and 2c + 1 in their high ones; Q4_1
    wants element i of a block low and i + 16 high."""
    N, K = _torch_shape(tensor)
    raw = np.asarray(tensor.data, dtype=np.uint8).reshape(N, K // 256, 144)  # (N, blocks, block bytes)
    d, dmin = (raw[..., at:at + 2].copy().view(np.float16).astype(np.float32) for at in (0, 2))  # (N, blocks, 1)
    s = raw[..., 4:16]  # (N, blocks, 12): get_scale_min_k4's bytes
    lo_sc, lo_m = s[..., 0:4] & 63, s[..., 4:8] & 63  # sub-blocks 0..3
    hi_sc = (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)  # sub-blocks 4..7
    hi_m = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    sc = np.concatenate([lo_sc, hi_sc], -1).astype(np.float32)  # (N, blocks, 8)
    mn = np.concatenate([lo_m, hi_m], -1).astype(np.float32)
    qs = raw[..., 16:].reshape(N, K // 256, 4, 1, 32)  # (N, blocks, chunk, 1, byte)
    codes = np.concatenate([qs & 15, qs >> 4], 3).reshape(N, K // 32, 32)  # (N, sub-blocks, 32) in weight order
    q = codes[..., :16] | (codes[..., 16:] << 4)  # (N, sub-blocks, 16): Q4_1's order
    scale, zero = as_half(d * sc), as_half(-(dmin * mn))
    if scale is None or zero is None:
        return None
    return (torch.from_numpy(np.ascontiguousarray(q.reshape(N, K // 2))), torch.from_numpy(scale.reshape(N, K // 32)),
            torch.from_numpy(zero.reshape(N, K // 32)), get_format("q4_1"))


def as_half(x: np.ndarray) -> np.ndarray | None:
    """x rounded to fp16, or None where that loses more than 2^-11 of some value (a non-zero below fp16's smallest
    normal 2^-14, or past 65504): a K-quant's products of two scales can leave fp16's range, and the tensor then
    stays dequantized rather than silently off."""
    a = np.abs(x)
    if ((a > 0) & (a < 2.0 ** -14)).any() or (a > 65504).any():
        return None
    return x.astype(np.float16)


def repack_q5_0(tensor):
    """A Q5_0 tensor (ggml-common.h block_q5_0: fp16 d, 32 fifth bits in qh, 16 nibble bytes; w = d (q - 16),
    q in 0..31) as Q8_0 blocks, bit for bit: q - 16 fits a signed byte under the same d, so the codes are
    q - 16 + 128 with Q8_0's symmetric offset. 8.5 bits a weight where the file holds 5.5, read 8 bits at a time
    by the kernels' byte path (a 5-bit path would need its own unpacking in every kernel). Element j < 16 is
    qs[j]'s low nibble with bit j of qh; element j + 16 its high nibble with bit j + 16."""
    N, K = _torch_shape(tensor)
    raw = np.asarray(tensor.data, dtype=np.uint8).reshape(N, K // 32, 22)  # (N, blocks, block bytes)
    d = torch.from_numpy(raw[..., 0:2].copy().view(np.float16).reshape(N, K // 32))  # (N, blocks)
    qh = raw[..., 2:6].copy().view("<u4")  # (N, blocks, 1): the fifth bits, element j at bit j
    high = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8) << 4  # (N, blocks, 32)
    qs = raw[..., 6:]  # (N, blocks, 16)
    q = np.concatenate([qs & 15, qs >> 4], -1) | high  # (N, blocks, 32): 0..31 in weight order
    codes = (q.astype(np.int16) - 16 + 128).astype(np.uint8).reshape(N, K)  # (N, K)
    return torch.from_numpy(np.ascontiguousarray(codes)), d, None, get_format("q8_0")


def repack_q6_k(tensor):
    """A Q6_K tensor (ggml-common.h block_q6_K: 128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales,
    fp16 d; w = d sc_j (q - 32) over 16-weight sub-blocks j, q in 0..63) as symmetric int8 groups of 16: codes
    q - 32 + 128 exactly, each group's scale d sc_j rounded to fp16 (the only loss: at most 2^-11 of it,
    relative, as repack_q4_k's; None where a scale leaves fp16's normal range: as_half). 9 bits a weight where
    the file holds 6.5625. In each half block of 128 weights, element 32 i + l (i < 4, l < 32) takes
    ql[l + 32 (i & 1)]'s low (i < 2) or high nibble and bits 2 i, 2 i + 1 of qh[l]; scale j covers elements
    16 j .. 16 j + 15 of the block, in order."""
    N, K = _torch_shape(tensor)
    raw = np.asarray(tensor.data, dtype=np.uint8).reshape(N, K // 256, 210)  # (N, blocks, block bytes)
    ql = raw[..., :128].reshape(N, K // 256, 2, 2, 32)  # (N, blocks, half, i & 1, l)
    qh = raw[..., 128:192].reshape(N, K // 256, 2, 1, 32)  # (N, blocks, half, 1, l)
    sc = raw[..., 192:208].view(np.int8).astype(np.float32)  # (N, blocks, 16)
    d = raw[..., 208:210].copy().view(np.float16).astype(np.float32)  # (N, blocks, 1)
    low = np.concatenate([ql & 15, ql >> 4], 3)  # (N, blocks, half, i, l): i = 0, 1 low nibbles, 2, 3 high
    high = (qh >> (2 * np.arange(4, dtype=np.uint8)).reshape(4, 1)) & 3  # (N, blocks, half, i, l)
    q = (low | (high << 4)).reshape(N, K)  # (N, K): 0..63 in weight order
    codes = (q.astype(np.int16) - 32 + 128).astype(np.uint8)  # (N, K)
    scale = as_half(d * sc)  # (N, blocks, 16)
    if scale is None:
        return None
    return (torch.from_numpy(np.ascontiguousarray(codes)), torch.from_numpy(scale.reshape(N, K // 16)), None,
            get_format("int8:g16:sym"))


_REPACK = {"Q5_0": repack_q5_0, "Q4_K": repack_q4_k, "Q6_K": repack_q6_k}  # repack's own types


def gguf_spec(ckpt: GGUFCheckpoint):
    return spec_from_config(ckpt.config, name=ckpt.path.stem, where=str(ckpt.path))


def check_tensors(path: str | Path) -> None:
    """Every tensor of the file against the model its metadata describes, by the check loading runs
    (load.check_names), reading no weight: `kvwall show` predicts from the metadata, so it must be the file's
    model. A model the engine does not run is left to the metadata checks (gguf_meta.check_fields)."""
    from kvwall.engine.load import check_checkpoint

    ckpt = GGUFCheckpoint(path)
    spec = gguf_spec(ckpt)
    try:
        check_supported(spec)
    except KvwallError:
        return
    check_checkpoint(spec, ckpt)


def load_gguf(path: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu", weights=False) -> Transformer:
    """A .gguf file -> an engine Transformer in eval mode (weights dequantized, then cast to dtype; see load_model
    for `weights`)."""
    from kvwall.engine.load import build_loaded

    ckpt = GGUFCheckpoint(path)
    spec = gguf_spec(ckpt)
    check_supported(spec)
    return build_loaded(spec, ckpt, dtype, device, weights)
