"""Softmax attention (MHA / GQA / MQA, optional sliding window or chunk): K and V for every token it keeps.

Per token and sequence: ``n_kv_heads x (head_dim + v_head_dim)`` elements; a sliding layer keeps at
most ``window`` tokens. Tensor parallel splits the query heads and the K/V heads; when tp exceeds
the K/V heads each GPU holds one (replicated) K/V head, and its K/V projection is replicated too.

A chunked layer (Llama 4, ``chunk`` = attention_chunk_size C) attends within its own chunk of C positions. What it
needs at a decode step at position q is the ((q - 1) mod C) + 1 tokens of the current chunk, which is what a step
reads here (``Step.chunk_held``). What a deployment must reserve is the worst case within a chunk, C tokens (the
last position of a chunk sees the whole chunk), and that is what ``tokens_held`` counts for memory and fit.
transformers' cache for such a layer is its sliding-window cache of C: after a prefill of P tokens it holds the last
min(P, C - 1) of them and a decode step appends the new one before attending (C at most), the same figure.
Attention sinks (gpt-oss) are one logit per query head in the softmax: parameters, no cache.
"""

from __future__ import annotations

from kvwall.errors import KvwallError
from kvwall.predict.step import ACT_BYTES, CACHE, PREFILL_ATTENTION, Op, Step, matmul
from kvwall.spec.formats import Format, tensor_format
from kvwall.spec.model import Attention


def kv_heads_per_gpu(m: Attention, tp: int) -> int:
    """K/V heads one GPU holds: split tp ways, or one (replicated) head when tp > n_kv."""
    if m.n_q_heads % tp:
        raise KvwallError(f"tp={tp} does not divide the {m.n_q_heads} query heads; pick a divisor")
    if m.n_kv_heads >= tp:
        if m.n_kv_heads % tp:
            raise KvwallError(f"tp={tp} does not divide the {m.n_kv_heads} KV heads; pick a divisor")
        return m.n_kv_heads // tp
    if tp % m.n_kv_heads:
        raise KvwallError(f"tp={tp} is not a multiple of the {m.n_kv_heads} KV heads; pick one that is")
    return 1


def token_bytes(m: Attention, kv: Format, tp: int = 1) -> int:
    return kv_heads_per_gpu(m, tp) * (kv.vector_bytes(m.head_dim) + kv.vector_bytes(m.v_head_dim))


def tokens_held(m: Attention, context: int) -> int:
    span = m.window or m.chunk  # a chunked layer: the worst case within a chunk (the module docstring)
    return min(context, span) if span else context


def fixed_bytes(m: Attention, state: Format, tp: int = 1) -> int:
    return 0


def shard_params(m: Attention, hidden: int, tp: int) -> float:
    """Q and O split tp ways; K/V split, or replicated per GPU when tp exceeds the K/V heads."""
    kv_params = hidden * m.n_kv_heads * (m.head_dim + m.v_head_dim)
    return (m.params(hidden) - kv_params) / tp + kv_params * kv_heads_per_gpu(m, tp) / m.n_kv_heads


def label(m: Attention) -> str:
    return "sliding" if m.window else ("chunked" if m.chunk else "attention")


def attention_kernel(st: Step, kv: Format) -> str:
    """The calibrated kernel an attention op runs on: decode over the cache in its own format (the packed
    kernel reads an integer cache as stored), or prefill's causal kernel over the step's fresh K/V (in the
    compute type, whatever the cache stores)."""
    if st.new > 1:
        return PREFILL_ATTENTION
    return "attention" if kv.is_float() else f"attention:{kv.name}"


def ops(i: int, m: Attention, spec, st: Step, fm, tp: int, absorbed: bool) -> list[Op]:
    h, T = spec.hidden, st.tokens
    q_heads = m.n_q_heads // tp
    kvh = kv_heads_per_gpu(m, tp)
    tb = token_bytes(m, fm.kv, tp)
    qkv_out = m.q_width // tp + kvh * (m.head_dim + m.v_head_dim)  # q_width: with the output gate, if any
    pairs = st.chunk_pairs(m.chunk) if m.chunk else st.pairs(m.window)
    held = st.chunk_held(m.chunk) if m.chunk else st.held(m.window)  # a chunked layer reads its current chunk
    core = Op("attention", i, flops=2 * st.batch * q_heads * (m.head_dim + m.v_head_dim) * pairs,
              cache_read=st.batch * held * tb,
              cache_write=st.batch * min(st.new, m.window or m.chunk or st.new) * tb,
              act_bytes=T * q_heads * (m.head_dim + m.v_head_dim) * ACT_BYTES,
              kernel=attention_kernel(st, fm.kv), kind=CACHE, rows=st.new if st.new > 1 else 0)
    # a checkpoint's own format may leave attention in its dtype (gpt-oss: MXFP4 experts only): tensor_format says
    qkv_w, o_w = (tensor_format(fm.weights, "linear", f"self_attn.{p}") for p in ("q_proj", "o_proj"))
    return [matmul("qkv_proj", i, T, h, qkv_out, qkv_w), core, matmul("o_proj", i, T, q_heads * m.v_head_dim, h, o_w)]


def kivi_quantized_tokens(held: int, group: int, residual: int) -> int:
    """Tokens a KIVI-style cache holds quantized: whole key chunks of `group` tokens, leaving the newest
    `residual` .. `residual + group - 1` tokens in full precision (all of them below `residual`)."""
    assert group > 0 and residual >= 0, (group, residual)
    return max(0, (held - residual) // group) * group


def kivi_bytes(m: Attention, held: int, kv: Format, residual: int, residual_format: Format) -> int:
    """One sequence's bytes in a KIVI-style quantized cache (the engine's QuantizedCache) for this layer.

    With g = kv.group and q = kivi_quantized_tokens(held, g, residual): keys are quantized per channel in
    chunks of g tokens (one g-element vector per channel per chunk: ``kv.vector_bytes(g)``), values per
    token along v_head_dim, and the held - q newest tokens stay in residual_format.
    """
    q = kivi_quantized_tokens(held, kv.group, residual)
    keys = m.n_kv_heads * m.head_dim * (q // kv.group) * kv.vector_bytes(kv.group)
    values = m.n_kv_heads * q * kv.vector_bytes(m.v_head_dim)
    fp = m.n_kv_heads * (held - q) * (residual_format.vector_bytes(m.head_dim)
                                      + residual_format.vector_bytes(m.v_head_dim))
    return keys + values + fp


def matrices(m, hidden: int) -> list[tuple[str, str, int, int, int]]:
    """(tensor kind, module name, out, in, how many): the matrices a checkpoint stores in its weight format."""
    return [("linear", "self_attn.q_proj", m.q_width, hidden, 1),  # with the output gate, if any
            ("linear", "self_attn.k_proj", m.n_kv_heads * m.head_dim, hidden, 1),
            ("linear", "self_attn.v_proj", m.n_kv_heads * m.v_head_dim, hidden, 1),
            ("linear", "self_attn.o_proj", hidden, m.n_q_heads * m.v_head_dim, 1)]
