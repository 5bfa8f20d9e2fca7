"""Bytes: weights and the decode-time cache, per layer, per GPU.

What each layer holds per sequence:

* attention: K and V for every token it attends to: ``n_kv_heads x (head_dim + v_head_dim)``
  elements per token; a sliding layer holds at most ``window`` tokens.
* latent attention (MLA): one latent ``kv_lora_rank`` + one rope key ``qk_rope_head_dim`` per token.
* Mamba / Mamba-2: a fixed conv state + SSM state, whatever the length.

Totals scale linearly in batch. Paged allocation rounds each sequence's
tokens up to whole blocks. Tensor parallel splits heads (and SSM channels)
across GPUs; K/V heads are replicated when tp exceeds their number; MLA's
latent cannot be split by head and is replicated on every GPU. Pipeline
parallel gives each stage a contiguous run of layers.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from kvwall.errors import KvwallError
from kvwall.predict import mixers
from kvwall.spec.formats import UNREADABLE, Format, checkpoint_format, get_format, per_tensor, tensor_format
from kvwall.spec.model import Layer, ModelSpec, MoE

NEVER = 1 << 40  # a context no model reaches: a layer keeping fewer has a window; a batch fitting it never fills


@dataclass(frozen=True)
class Formats:
    """Storage formats of the three kinds of bytes."""

    weights: Format
    kv: Format
    state: Format

    @classmethod
    def for_spec(cls, spec: ModelSpec, weights: str | None = None, kv: str | None = None,
                 state: str | None = None) -> Formats:
        """Defaults: the checkpoint's 16-bit type (bf16 for fp32 or unknown) for all three; the weights in the
        checkpoint's own format where its config declares one (quantization_config), which a named one overrides."""
        base = checkpoint_format(spec.dtype)
        if base.bits > 16:
            base = get_format("bf16")
        own = spec.weight_format
        if weights is None and own is not None and own.name == UNREADABLE:  # a quantization_config not counted
            raise KvwallError(own.detail)
        w = get_format(weights, head_ok=True) if weights is not None else (own or base)  # "" is a bad name
        if w.only == "experts" and not any(isinstance(layer.ffn, MoE) for layer in spec.layers):
            raise KvwallError(f"weight format {weights!r}: {spec.name} has no routed experts for :experts to "
                              "quantize; drop :experts")
        if weights is not None and spec.weight_format is not None:  # say that it replaces the checkpoint's own
            w = replace(w, source="--weight-format")
        return cls(w, get_format(kv) if kv is not None else base, get_format(state) if state is not None else base)

    def as_dict(self) -> dict:
        return {"weights": self.weights.label, "head": tensor_format(self.weights, "head").label, "kv": self.kv.label,
                "state": self.state.label}


@dataclass(frozen=True)
class Parallel:
    """How a model is spread over GPUs: tp splits every layer's matrices; pp runs contiguous runs of layers
    one after another; ep > 1 (expert parallel, DeepSeek-V3's deployment): each of ep GPUs per stage holds
    every non-expert weight and serves its own 1/ep of the batch (data-parallel attention), and the routed
    experts are split whole over the ep GPUs, tokens sent to them and back by all-to-all."""

    tp: int = 1
    pp: int = 1
    ep: int = 1

    def __post_init__(self):
        if self.tp < 1 or self.pp < 1 or self.ep < 1:
            raise KvwallError(f"parallel sizes must be at least 1 (got tp={self.tp}, pp={self.pp}, ep={self.ep})")
        if self.ep > 1 and self.tp > 1:
            raise KvwallError(f"--ep {self.ep} runs attention data-parallel, whole on each GPU; tensor parallel inside "
                              "it is not modelled: use --tp or --ep, not both")

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.ep

    @property
    def group(self) -> int:
        """GPUs per stage that take part in each collective: the tp all-reduce's or the ep all-to-all's."""
        return self.tp * self.ep

    def local(self, seqs: int) -> int:
        """Sequences (or tokens) on the busiest of the ep data-parallel GPUs when `seqs` split evenly."""
        return -(-seqs // self.ep)

    def as_dict(self) -> dict:
        return {"tp": self.tp, "pp": self.pp, "ep": self.ep, "gpus": self.gpus}

    def label(self) -> str:
        """"tp=2 pp=4", "ep=8": the sizes above 1 (tp=1 alone)."""
        sizes = [f"{k}={v}" for k, v in (("tp", self.tp), ("pp", self.pp), ("ep", self.ep)) if v > 1]
        return " ".join(sizes) or "tp=1"


# -- per layer, per sequence (each mixer kind owns its rule: predict/mixers) ------

def token_bytes(layer: Layer, kv: Format, tp: int = 1) -> int:
    """Bytes one token of context costs this layer, per sequence, on one GPU."""
    return 0 if layer.mixer is None else mixers.of(layer.mixer).token_bytes(layer.mixer, kv, tp)


def fixed_bytes(layer: Layer, state: Format, tp: int = 1) -> int:
    """Bytes of state this layer holds per sequence regardless of length (SSM conv + SSM state)."""
    return 0 if layer.mixer is None else mixers.of(layer.mixer).fixed_bytes(layer.mixer, state, tp)


def tokens_held(layer: Layer, context: int) -> int:
    return 0 if layer.mixer is None else mixers.of(layer.mixer).tokens_held(layer.mixer, context)


def round_to_blocks(tokens: int, block: int | None) -> int:
    return tokens if not block or tokens == 0 else -(-tokens // block) * block


# -- weights -------------------------------------------------------------------

def _param_bytes(params: float, fmt: Format) -> int:
    return int(-(-params * fmt.bytes_per_element() // 1))


def layer_weight_bytes(layer: Layer, spec: ModelSpec, fmt: Format, tp: int = 1, ep: int = 1) -> int:
    """One GPU's share of a layer's weights: each mixer's sharding rule for its matrices (a channel mixer's for
    expert parallel too), norms replicated."""
    mats = mixers.of(layer.mixer).shard_params(layer.mixer, spec.hidden, tp) if layer.mixer is not None else 0
    mats += mixers.of(layer.ffn).shard_params(layer.ffn, spec.hidden, tp, ep) if layer.ffn is not None else 0
    if per_tensor(fmt):
        return _native_layer_bytes(layer, spec, fmt, mats)
    return _param_bytes(mats, fmt) + _param_bytes(layer.norm_params, tensor_format(fmt, "norm"))


# (tensor kind, module name, out, in, how many): the matrices a checkpoint quantizes, each mixer module's matrices()
def _matrices(m, hidden: int) -> list[tuple[str, str, int, int, int]]:
    mod = mixers.of(m)
    if not hasattr(mod, "matrices"):
        raise KvwallError(f"a checkpoint's own weight format (quantization_config) is counted for attention, MLA, "
                          f"DSA, Gated DeltaNet, KDA, lightning, MLP and MoE layers, not {m.kind}; pass "
                          "--weight-format to size it")
    return mod.matrices(m, hidden)


def _native_layer_bytes(layer: Layer, spec: ModelSpec, fmt: Format, shard: float) -> int:
    """A layer in a checkpoint's own format: every matrix as stored (tensor_format decides each one's format),
    the rest of its parameters (norms, biases) in the model's dtype. One GPU's share: the whole layer's bytes
    times shard / params (each matrix's scales split with it)."""
    whole = layer.params(spec.hidden)
    total, counted = 0, 0
    for part in (layer.mixer, layer.ffn):
        for kind, name, rows, cols, n in (_matrices(part, spec.hidden) if part is not None else []):
            total += n * tensor_format(fmt, kind, name).matrix_bytes(rows, cols)
            counted += n * rows * cols
    total += _param_bytes(whole - counted, tensor_format(fmt, "norm"))
    if shard + layer.norm_params >= whole:
        return total
    return int(-(-total * (shard + layer.norm_params) // whole))


def embedding_bytes(spec: ModelSpec, fmt: Format, tp: int = 1) -> tuple[int, int]:
    """(input embedding, LM head + final norm) bytes on one GPU; vocab split tp ways. The token table and the
    head are in head_format(fmt); the final norm and extra parameters stay 16-bit."""
    f16, table = tensor_format(fmt, "norm"), tensor_format(fmt, "embed")
    tokens = spec.vocab * spec.hidden  # the token table; learned positions and extras stay 16-bit
    emb = _param_bytes(tokens / tp, table) + _param_bytes((spec.embedding_params() - tokens) / tp + spec.extra_params,
                                                          f16)
    head = _param_bytes(spec.lm_head_params() / tp, tensor_format(fmt, "head")) + _param_bytes(spec.final_norm_params,
                                                                                             f16)
    return emb, head


# -- reports -------------------------------------------------------------------

@dataclass
class LayerMemory:
    index: int
    kind: str
    weight_bytes: int
    token_bytes: int  # per token of context, per sequence
    tokens_held: int  # per sequence, after the window
    cache_bytes: int  # for the busiest GPU's share of the batch (all of it but with --ep; paged: allocated)
    fixed_bytes: int  # per sequence

    def as_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class MemoryReport:
    spec: ModelSpec
    batch: int
    context: int
    formats: Formats
    parallel: Parallel
    block_size: int | None
    layers: list[LayerMemory]
    embedding_bytes: int
    head_bytes: int
    stages: list[list[int]] = field(default_factory=list)  # layer indices per pipeline stage

    @property
    def weight_bytes(self) -> int:
        """All weights of the model (one copy, unsharded)."""
        return total_weight_bytes(self.spec, self.formats.weights)

    @property
    def cache_bytes(self) -> int:
        """The whole batch's cache, all GPUs together (replicated copies counted once per GPU; with expert parallel
        each of the batch's sequences once, where the layers hold the busiest GPU's share)."""
        per_gpu = sum(layer.cache_bytes for layer in self.layers)
        return per_gpu * self.parallel.tp * self.batch // self.parallel.local(self.batch)

    @property
    def cache_used_bytes(self) -> int:
        """Cache bytes actually holding tokens (paged allocation rounds up to blocks)."""
        return self.parallel.tp * sum(
            self.batch * (layer.token_bytes * min(layer.tokens_held, self.context) + layer.fixed_bytes)
            for layer in self.layers)

    @property
    def token_bytes(self) -> int:
        """Per-token bytes of one sequence on the busiest GPU: its stage's layers, its tensor-parallel shard."""
        return sum(self.layers[i].token_bytes for i in self.stages[self.busiest_stage()])

    @property
    def fixed_bytes(self) -> int:
        return sum(layer.fixed_bytes for layer in self.layers)

    def stage_bytes(self, stage: int) -> tuple[int, int]:
        """(weights, cache) on one GPU of a pipeline stage."""
        idx = self.stages[stage]
        w = sum(self.layers[i].weight_bytes for i in idx)
        if stage == 0:
            w += self.embedding_bytes
        if stage == len(self.stages) - 1:
            w += self.head_bytes
        return w, sum(self.layers[i].cache_bytes for i in idx)

    def busiest_stage(self) -> int:
        """The pipeline stage whose GPUs hold the most weights and cache (the first of equals)."""
        return max(range(len(self.stages)), key=lambda s: sum(self.stage_bytes(s)))

    def per_gpu(self) -> tuple[int, int]:
        """(weights, cache) of the busiest GPU."""
        return self.stage_bytes(self.busiest_stage())

    def as_dict(self) -> dict:
        w, c = self.per_gpu()
        return {
            "model": self.spec.name, "batch": self.batch, "context": self.context,
            "formats": self.formats.as_dict(), **self.parallel.as_dict(), "block_size": self.block_size,
            "params": self.spec.params(), "active_params": self.spec.active_params(),
            "weight_bytes": self.weight_bytes, "cache_bytes": self.cache_bytes,
            "cache_used_bytes": self.cache_used_bytes, "cache_waste_bytes": self.cache_bytes - self.cache_used_bytes,
            "cache_bytes_per_token": cache_bytes_per_token(self.spec, self.formats.kv),
            "cache_bytes_per_token_per_gpu": self.token_bytes,
            "fixed_bytes_per_sequence": self.fixed_bytes,
            "per_gpu": {"weight_bytes": w, "cache_bytes": c, "total_bytes": w + c},
            "layers": [layer.as_dict() for layer in self.layers],
        }


def total_weight_bytes(spec: ModelSpec, fmt: Format) -> int:
    emb, head = embedding_bytes(spec, fmt)
    return emb + head + sum(layer_weight_bytes(layer, spec, fmt) for layer in spec.layers)


def pipeline_stages(n_layers: int, pp: int) -> list[list[int]]:
    if pp > n_layers:
        raise KvwallError(f"pp={pp} is more pipeline stages than the model's {n_layers} layers")
    base, extra = divmod(n_layers, pp)
    stages, start = [], 0
    for s in range(pp):
        size = base + (1 if s < extra else 0)
        stages.append(list(range(start, start + size)))
        start += size
    return stages


def check_expert_parallel(spec: ModelSpec, ep: int) -> None:
    """Expert parallel splits routed experts: on a model without them it would be data parallel under another
    name (and expected mode's collective costs for a group that never talks)."""
    if ep > 1 and not spec.has("moe"):
        raise KvwallError(f"--ep {ep}: {spec.name} has no routed experts to split; expert parallel needs an MoE "
                          "model (use --tp, or --pp, for a dense one)")


def memory(spec: ModelSpec, *, batch: int = 1, context: int = 4096, formats: Formats | None = None,
           parallel: Parallel | None = None, block_size: int | None = None) -> MemoryReport:
    """Weights and cache for `batch` sequences of `context` tokens each."""
    if batch <= 0 or context <= 0:
        raise KvwallError(f"batch and context must be positive (got batch={batch}, context={context})")
    if block_size is not None and block_size <= 0:
        raise KvwallError(f"block size must be positive (got {block_size})")
    formats = formats or Formats.for_spec(spec)
    par = parallel or Parallel()
    check_expert_parallel(spec, par.ep)
    layers = []
    for i, layer in enumerate(spec.layers):
        tb = token_bytes(layer, formats.kv, par.tp)
        held = tokens_held(layer, context)
        fb = fixed_bytes(layer, formats.state, par.tp)
        cache = par.local(batch) * (tb * round_to_blocks(held, block_size) + fb)  # on the busiest GPU
        kind = mixers.of(layer.mixer).label(layer.mixer) if layer.mixer is not None else (
            layer.ffn.kind if layer.ffn else "identity")
        layers.append(LayerMemory(i, kind, layer_weight_bytes(layer, spec, formats.weights, par.tp, par.ep), tb, held,
                                  cache, fb))
    emb, head = embedding_bytes(spec, formats.weights, par.tp)
    _check_sizes(layers, emb, head)
    return MemoryReport(spec, batch, context, formats, par, block_size, layers, emb, head,
                        pipeline_stages(spec.n_layers, par.pp))


def _check_sizes(layers: list[LayerMemory], emb: int, head: int) -> None:
    """The last guard before a size is printed: never negative (a spec that escaped validation)."""
    for lm in layers:
        for label, n in (("weights", lm.weight_bytes), ("cache", lm.cache_bytes), ("state", lm.fixed_bytes)):
            if n < 0:
                raise KvwallError(f"layer {lm.index} ({lm.kind}): {label} come to {n:,} bytes, below 0; the model's "
                                  "config has a negative size: fix it")
    if emb < 0 or head < 0:
        raise KvwallError(f"the embeddings come to {emb + head:,} bytes, below 0; fix the model's vocab or hidden size")


def cache_bytes_per_token(spec: ModelSpec, kv: Format) -> int:
    """Per-token cache bytes of one sequence with every attention layer still below its window."""
    return sum(token_bytes(layer, kv) for layer in spec.layers)


def growth_bytes_per_token(spec: ModelSpec, kv: Format) -> int:
    """Per-token cache bytes once every sliding layer holds its full window (full-attention layers only)."""
    return sum(token_bytes(layer, kv) for layer in spec.layers if tokens_held(layer, NEVER) == NEVER)


def state_bytes(spec: ModelSpec, state: Format) -> int:
    """Fixed per-sequence state bytes (SSM layers)."""
    return sum(fixed_bytes(layer, state) for layer in spec.layers)


# -- KIVI-style quantized cache ------------------------------------------------

def kivi_cache_bytes(spec: ModelSpec, *, batch: int, context: int, kv: Format, residual: int,
                     residual_format: Format) -> int:
    """Bytes of a KIVI-style quantized KV cache (the engine's QuantizedCache) for `batch` sequences of `context`.

    Per attention layer and sequence: ``mixers.attention.kivi_bytes`` (keys quantized per channel in chunks
    of kv.group tokens, values per token, the newest tokens in residual_format). Unlike ``token_bytes`` the
    key groups run along the token axis, so this differs from memory() with kv=int* by the residual and by
    the key grouping. Other mixers hold nothing here (the engine's quantized cache takes attention only).
    """
    assert kv.group is not None and not kv.is_float(), kv
    total = 0
    for layer in spec.layers:
        rules = mixers.of(layer.mixer) if layer.mixer is not None else None
        if hasattr(rules, "kivi_bytes"):
            total += rules.kivi_bytes(layer.mixer, tokens_held(layer, context), kv, residual, residual_format)
    return batch * total
