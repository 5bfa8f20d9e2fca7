"""The model spec: one description of a model that predict, engine and measure all read.

A model is an embedding, a stack of layers and an LM head. Each layer has a
*sequence mixer* (what mixes information across tokens, and so what has to be
remembered at decode time) and a *channel mixer* (per-token MLP or MoE). Either
may be absent: a Mamba block has no channel mixer, a Nemotron-H "-" block has
no sequence mixer.

Everything here is plain frozen data. Parameter counts are methods because
they follow from the shapes; memory and time live in ``kvwall.predict``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from kvwall.errors import KvwallError
from kvwall.spec.formats import Format


@dataclass(frozen=True)
class Rope:
    """Rotary position embedding: base frequency and scaling (what the engine needs to rotate q and k).

    kind: "default" (no scaling), "linear" (positions divided by factor), "llama3"
    (low frequencies divided by factor, high ones kept, a smooth ramp between), or "yarn"
    (the same idea with the ramp set by beta_fast/beta_slow rotations, plus an attention
    factor on cos/sin: attention_factor, or mscale/mscale_all_dim as DeepSeek sets them).
    partial: fraction of head_dim that is rotated (Phi-3 style partial rotary).
    interleaved: rotate pairs (x0, x1), (x2, x3), ... (DeepSeek) instead of halves.
    """

    theta: float = 10000.0
    kind: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int | None = None
    partial: float = 1.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True
    interleaved: bool = False


@dataclass(frozen=True)
class Attention:
    """Softmax attention with n_q query heads sharing n_kv key/value heads (MHA/GQA/MQA)."""

    n_q_heads: int
    n_kv_heads: int
    head_dim: int  # query/key head dimension
    v_head_dim: int
    window: int | None = None  # sliding window: attend to (and keep) the last `window` tokens
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False  # per-head RMSNorm on q and k (Qwen3, Gemma 3)
    output_gate: bool = False  # q_proj is twice as wide: a sigmoid gate per query channel on the output (Qwen3-Next)
    # chunked local attention (Llama 4): positions 0..chunk-1, chunk..2chunk-1, ... form chunks and a query sees only
    # the earlier tokens of its own chunk. Not a sliding window: the span restarts at every chunk boundary.
    chunk: int | None = None
    sinks: bool = False  # gpt-oss: one learned logit per query head joins the softmax (n_q_heads parameters, no cache)
    # engine-only details (do not change bytes or parameter counts)
    rope: Rope | None = None  # full rotary description; None: learned or no rotary positions
    scale: float | None = None  # softmax scale; None: head_dim ** -0.5 (Gemma: query_pre_attn_scalar ** -0.5)
    softcap: float | None = None  # attention logit soft-capping (Gemma 2): cap * tanh(s / cap)
    l2_qk_norm: bool = False  # Llama 4: q and k RMS-normalised without weights (no parameters, unlike qk_norm)
    # Llama 4's NoPE layers (attn_temperature_tuning): (floor_scale, attn_scale); q at position p is multiplied by
    # 1 + attn_scale * log(1 + floor((p + 1) / floor_scale)). None: no tuning
    temperature: tuple[float, float] | None = None

    kind = "attention"
    keeps_tokens = True  # the cache grows with the context (up to the window)
    has_state = False  # a fixed-size state per sequence

    @property
    def q_width(self) -> int:
        """Output width of q_proj: the queries, and as much again for the output gate when there is one."""
        return self.n_q_heads * self.head_dim * (2 if self.output_gate else 1)

    def params(self, hidden: int) -> int:
        q = hidden * self.q_width
        k = hidden * self.n_kv_heads * self.head_dim
        v = hidden * self.n_kv_heads * self.v_head_dim
        o = self.n_q_heads * self.v_head_dim * hidden
        bias = 0
        if self.qkv_bias:
            bias += self.q_width + self.n_kv_heads * self.head_dim + self.n_kv_heads * self.v_head_dim
        if self.o_bias:
            bias += hidden
        norms = 2 * self.head_dim if self.qk_norm else 0
        sinks = self.n_q_heads if self.sinks else 0
        return q + k + v + o + bias + norms + sinks

    def cache_elems_per_token(self) -> int:
        return self.n_kv_heads * (self.head_dim + self.v_head_dim)

    def sizes(self) -> dict[str, int]:
        """Fields that must be whole numbers from 1 up, by their config names (spec/validate.py checks them)."""
        out = {"num_attention_heads": self.n_q_heads, "num_key_value_heads": self.n_kv_heads,
               "head_dim": self.head_dim, "value head dim": self.v_head_dim}
        out |= {"sliding_window": self.window} if self.window is not None else {}
        return out | ({"attention_chunk_size": self.chunk} if self.chunk is not None else {})

    def problems(self) -> list[str]:
        """Rules between fields that do not hold, in words."""
        if self.n_q_heads % self.n_kv_heads:
            return [f"num_attention_heads {self.n_q_heads} is not a multiple of num_key_value_heads "
                    f"{self.n_kv_heads}; fix one of them"]
        if self.window is not None and self.chunk is not None:
            return [f"a layer has both a sliding window ({self.window}) and an attention chunk ({self.chunk}); "
                    "keep one of them"]
        return []

    def describe(self) -> str:
        grp = "MHA" if self.n_kv_heads == self.n_q_heads else ("MQA" if self.n_kv_heads == 1 else "GQA")
        s = f"{grp} {self.n_q_heads}q/{self.n_kv_heads}kv x {self.head_dim}"
        if self.v_head_dim != self.head_dim:
            s += f" (v {self.v_head_dim})"
        if self.window:
            s += f", window {self.window}"
        if self.chunk:
            s += f", chunk {self.chunk}"
        if self.sinks:
            s += ", sinks"
        if self.output_gate:
            s += ", output gate"
        return s


@dataclass(frozen=True)
class LatentAttention:
    """Multi-head latent attention (DeepSeek-V2/V3): the cache holds one compressed
    latent c_kv (kv_lora_rank) plus one shared rotary key (qk_rope_head_dim) per token."""

    n_heads: int
    kv_lora_rank: int
    q_lora_rank: int | None
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    bias: bool = False  # attention_bias: q_a, kv_a and o projections carry biases (q_proj never does)
    # engine-only details (do not change bytes or parameter counts)
    rope: Rope | None = None  # rotary description of the qk_rope_head_dim part
    scale: float | None = None  # softmax scale; None: qk_head_dim ** -0.5 (YaRN multiplies in mscale^2)

    kind = "latent"
    keeps_tokens = True
    has_state = False

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def params(self, hidden: int) -> int:
        h, qd = self.n_heads, self.qk_head_dim
        if self.q_lora_rank:
            q = hidden * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * h * qd  # q_a, norm, q_b
        else:
            q = hidden * h * qd
        kv_a = hidden * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank  # + kv_a norm
        kv_b = self.kv_lora_rank * h * (self.qk_nope_head_dim + self.v_head_dim)
        o = h * self.v_head_dim * hidden
        bias = ((self.q_lora_rank or 0) + self.kv_lora_rank + self.qk_rope_head_dim + hidden) if self.bias else 0
        return q + kv_a + kv_b + o + bias

    def cache_elems_per_token(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    def sizes(self) -> dict[str, int]:
        return {"num_attention_heads": self.n_heads, "kv_lora_rank": self.kv_lora_rank,
                "qk_nope_head_dim": self.qk_nope_head_dim, "qk_rope_head_dim": self.qk_rope_head_dim,
                "v_head_dim": self.v_head_dim}

    def problems(self) -> list[str]:
        return []

    def describe(self) -> str:
        return f"MLA {self.n_heads} heads, latent {self.kv_lora_rank} + rope {self.qk_rope_head_dim}"


# DSA's indexer keys as DeepSeek's inference code stores them (DeepSeek-V3.2-Exp inference/model.py, Indexer:
# k_cache float8_e4m3fn [.., index_head_dim] + k_scale_cache float32 [.., index_head_dim // 128]): one byte per value
# and one fp32 scale per 128 values, 132 B for a 128-value key. transformers 5.25 keeps them in the model's dtype.
DSA_INDEXER_KEYS = Format("fp8_e4m3 + fp32 scale per 128", 8, 128, 4, 0, torch_dtype="float8_e4m3fn", fixed=True)


@dataclass(frozen=True)
class SparseLatentAttention:
    """DeepSeek Sparse Attention (DeepSeek-V3.2): MLA (``mla``) whose queries attend only to the ``index_topk``
    cached latents a lightning indexer picks. The indexer scores every cached token with its own single-head key
    (``index_head_dim``, kept per token in ``index_keys``) against ``index_n_heads`` query heads projected from MLA's
    query latent (so q_lora_rank must be set): wq_b (q_lora_rank -> heads x dim), wk (hidden -> dim), a LayerNorm
    on the key (weight and bias) and weights_proj (hidden -> heads), no biases.

    Its own kind (not "latent"), so that nothing runs it as dense MLA by mistake.
    """

    mla: LatentAttention
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    index_keys: Format = DSA_INDEXER_KEYS  # how a deployment stores the indexer's key per token

    kind = "sparse_latent"
    keeps_tokens = True
    has_state = False

    def indexer_params(self, hidden: int) -> int:
        h, d = self.index_n_heads, self.index_head_dim
        return (self.mla.q_lora_rank or 0) * h * d + hidden * d + 2 * d + hidden * h  # wq_b, wk, k_norm, weights

    def params(self, hidden: int) -> int:
        return self.mla.params(hidden) + self.indexer_params(hidden)

    def cache_elems_per_token(self) -> int:
        return self.mla.cache_elems_per_token() + self.index_head_dim

    def sizes(self) -> dict[str, int]:
        return self.mla.sizes() | {"index_n_heads": self.index_n_heads, "index_head_dim": self.index_head_dim,
                                   "index_topk": self.index_topk}

    def problems(self) -> list[str]:
        out = list(self.mla.problems())
        if not self.mla.q_lora_rank:
            out.append("DeepSeek Sparse Attention needs q_lora_rank (the indexer's queries come from the query "
                       "latent); set it in the config")
        if self.index_head_dim < self.mla.qk_rope_head_dim:
            out.append(f"index_head_dim {self.index_head_dim} is smaller than qk_rope_head_dim "
                       f"{self.mla.qk_rope_head_dim} (the indexer rotates that many of its dims); fix one of them")
        return out

    def describe(self) -> str:
        return (f"DSA: {self.mla.describe()}, indexer {self.index_n_heads} x {self.index_head_dim}, "
                f"top-{self.index_topk}")


@dataclass(frozen=True)
class Mamba:
    """Mamba (S6) selective SSM block: in_proj -> causal depthwise conv -> selective scan -> out_proj."""

    d_inner: int
    d_state: int
    d_conv: int
    dt_rank: int
    conv_bias: bool = True
    proj_bias: bool = False
    inner_norms: bool = False  # Jamba: RMSNorm (with weights) on dt, B and C
    # engine-only details (do not change bytes or parameter counts)
    weightless_norms: bool = False  # falcon_mamba: RMS norms without weights on dt, B and C
    inner_norm_eps: float = 1e-6  # eps of those inner norms (either kind)

    kind = "mamba"
    keeps_tokens = False
    has_state = True

    def params(self, hidden: int) -> int:
        d, n, r = self.d_inner, self.d_state, self.dt_rank
        in_proj = hidden * 2 * d + (2 * d if self.proj_bias else 0)
        conv = d * self.d_conv + (d if self.conv_bias else 0)
        x_proj = d * (r + 2 * n)
        dt_proj = r * d + d
        a_d = d * n + d
        out = d * hidden + (hidden if self.proj_bias else 0)
        norms = (r + 2 * n) if self.inner_norms else 0
        return in_proj + conv + x_proj + dt_proj + a_d + out + norms

    def state_elems(self) -> int:
        """conv state (d_inner x d_conv) + SSM state (d_inner x d_state), per sequence."""
        return self.d_inner * self.d_conv + self.d_inner * self.d_state

    def sizes(self) -> dict[str, int]:
        return {"the Mamba inner width (expand x hidden_size or intermediate_size)": self.d_inner,
                "state size": self.d_state, "conv kernel": self.d_conv, "dt rank": self.dt_rank}

    def problems(self) -> list[str]:
        return []

    def describe(self) -> str:
        return f"Mamba d_inner {self.d_inner}, d_state {self.d_state}, d_conv {self.d_conv}"


@dataclass(frozen=True)
class Mamba2:
    """Mamba-2 (SSD) block: scalar decay per head, n_groups shared B/C, gated RMSNorm before out_proj."""

    n_heads: int
    head_dim: int
    d_state: int
    n_groups: int
    d_conv: int
    conv_bias: bool = True
    proj_bias: bool = False
    out_bias: bool | None = None  # out_proj's bias where it differs from in_proj's (Falcon-H1 projectors_bias)
    gated_norm: bool = True  # the gated RMSNorm before out_proj (Falcon-H1: only with mamba_rms_norm)
    # engine-only details (do not change bytes or parameter counts)
    dt_limit: tuple[float, float] = (0.0, math.inf)  # the step size Δ is clamped to this range
    norm_before_gate: bool = False  # Falcon-H1 (mamba_norm_before_gate): rmsnorm(y) * silu(z), not rmsnorm(y * silu(z))
    in_scales: tuple[float, ...] | None = None  # Falcon-H1's ssm_multipliers on in_proj's z, x, B, C, Δ parts

    kind = "mamba2"
    keeps_tokens = False
    has_state = True

    @property
    def d_inner(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.d_inner + 2 * self.n_groups * self.d_state

    def params(self, hidden: int) -> int:
        proj_out = 2 * self.d_inner + 2 * self.n_groups * self.d_state + self.n_heads  # z, x, B, C, dt
        in_proj = hidden * proj_out + (proj_out if self.proj_bias else 0)
        conv = self.conv_dim * self.d_conv + (self.conv_dim if self.conv_bias else 0)
        heads = 3 * self.n_heads  # dt_bias, A_log, D
        norm = self.d_inner if self.gated_norm else 0
        out_bias = self.proj_bias if self.out_bias is None else self.out_bias
        out = self.d_inner * hidden + (hidden if out_bias else 0)
        return in_proj + conv + heads + norm + out

    def state_elems(self) -> int:
        """conv state (conv_dim x d_conv) + SSM state (n_heads x head_dim x d_state), per sequence."""
        return self.conv_dim * self.d_conv + self.n_heads * self.head_dim * self.d_state

    def sizes(self) -> dict[str, int]:
        return {"num_heads": self.n_heads, "head_dim": self.head_dim, "state size": self.d_state,
                "n_groups": self.n_groups, "conv kernel": self.d_conv}

    def problems(self) -> list[str]:
        if self.n_heads % self.n_groups:
            return [f"the {self.n_heads} Mamba-2 heads are not a multiple of n_groups {self.n_groups}; fix one of them"]
        return []

    def describe(self) -> str:
        return f"Mamba-2 {self.n_heads} heads x {self.head_dim}, d_state {self.d_state}, groups {self.n_groups}"


@dataclass(frozen=True)
class GatedDeltaNet:
    """Gated DeltaNet (Qwen3-Next, Qwen3.5 linear_attention layers): q/k/v through a short causal depthwise conv,
    then the gated delta rule on a per-head state of k_head_dim x v_head_dim; a gated RMSNorm before out_proj.

    n_k_heads query/key heads of k_head_dim, n_v_heads value heads of v_head_dim (n_v_heads a multiple of
    n_k_heads: each key head serves n_v_heads / n_k_heads value heads). No projection or conv bias.
    """

    n_k_heads: int
    n_v_heads: int
    k_head_dim: int
    v_head_dim: int
    conv_kernel: int
    # engine-only details (do not change bytes or parameter counts)
    interleaved: bool = False  # Qwen3-Next's in_proj_qkvz / in_proj_ba: rows grouped per key head, not q|k|v|z
    activation: str = "silu"  # the short convolution's activation (hidden_act)

    kind = "gated_deltanet"
    keeps_tokens = False
    has_state = True

    @property
    def key_dim(self) -> int:
        return self.n_k_heads * self.k_head_dim

    @property
    def value_dim(self) -> int:
        return self.n_v_heads * self.v_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the short convolution: q, k and v."""
        return 2 * self.key_dim + self.value_dim

    def params(self, hidden: int) -> int:
        in_proj = hidden * (2 * self.key_dim + 2 * self.value_dim) + hidden * 2 * self.n_v_heads  # q k v z, b a
        conv = self.conv_dim * self.conv_kernel
        heads = 2 * self.n_v_heads  # dt_bias, A_log
        norm = self.v_head_dim  # gated RMSNorm, shared by the heads
        out = self.value_dim * hidden
        return in_proj + conv + heads + norm + out

    def state_elems(self) -> int:
        """conv state (conv_dim x conv_kernel) + recurrent state (n_v_heads x k_head_dim x v_head_dim), per sequence."""
        return self.conv_dim * self.conv_kernel + self.n_v_heads * self.k_head_dim * self.v_head_dim

    def sizes(self) -> dict[str, int]:
        return {"linear_num_key_heads": self.n_k_heads, "linear_num_value_heads": self.n_v_heads,
                "linear_key_head_dim": self.k_head_dim, "linear_value_head_dim": self.v_head_dim,
                "linear_conv_kernel_dim": self.conv_kernel}

    def problems(self) -> list[str]:
        if self.n_v_heads % self.n_k_heads:
            return [f"linear_num_value_heads {self.n_v_heads} is not a multiple of linear_num_key_heads "
                    f"{self.n_k_heads}; fix one of them"]
        return []

    def describe(self) -> str:
        return (f"Gated DeltaNet {self.n_k_heads}k x {self.k_head_dim} / {self.n_v_heads}v x {self.v_head_dim}, "
                f"conv {self.conv_kernel}")


@dataclass(frozen=True)
class KimiDeltaAttention:
    """Kimi Delta Attention (Kimi Linear's KDA layers): Gated DeltaNet with a per-channel forget gate.

    q, k, v (n_heads x head_dim each, no bias) through one short causal depthwise conv of conv_kernel taps, then
    the delta rule on a per-head state of head_dim x head_dim whose decay is a vector over the key channels (GDN:
    one scalar per head). The forget gate and the output gate are low-rank: hidden -> head_dim -> n_heads x
    head_dim (f_a/f_b, g_a/g_b); beta from b_proj (one per head); a gated RMSNorm of head_dim before o_proj.
    """

    n_heads: int
    head_dim: int
    conv_kernel: int

    kind = "kda"
    keeps_tokens = False
    has_state = True

    @property
    def qkv_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the short convolution: q, k and v."""
        return 3 * self.qkv_dim

    def params(self, hidden: int) -> int:
        d, w = self.head_dim, self.qkv_dim
        qkv = 3 * hidden * w
        conv = self.conv_dim * self.conv_kernel
        forget = hidden * d + d * w + w + self.n_heads  # f_a, f_b, dt_bias (per channel), A_log (per head)
        beta = hidden * self.n_heads  # b_proj
        gate = hidden * d + d * w  # g_a, g_b: the output gate
        norm = d  # gated RMSNorm, shared by the heads
        return qkv + conv + forget + beta + gate + norm + w * hidden  # + o_proj

    def state_elems(self) -> int:
        """conv state (conv_dim x conv_kernel) + recurrent state (n_heads x head_dim x head_dim), per sequence."""
        return self.conv_dim * self.conv_kernel + self.n_heads * self.head_dim * self.head_dim

    def sizes(self) -> dict[str, int]:
        return {"linear_attn_config num_heads": self.n_heads, "linear_attn_config head_dim": self.head_dim,
                "linear_attn_config short_conv_kernel_size": self.conv_kernel}

    def problems(self) -> list[str]:
        return []

    def describe(self) -> str:
        return f"KDA {self.n_heads} heads x {self.head_dim}, conv {self.conv_kernel}"


@dataclass(frozen=True)
class LightningAttention:
    """Lightning attention (MiniMax-01's linear_attention layers): linear attention with a fixed exponential decay
    per head, S_t = exp(-slope_h) S_{t-1} + k_t^T v_t, o_t = q_t S_t, on a state of head_dim x head_dim per head.

    q, k, v from one qkv_proj (silu), an RMSNorm over all heads' output, a sigmoid output gate (hidden -> n_heads x
    head_dim), out_proj; no bias, no conv. The decay slopes are fixed buffers, not parameters.
    """

    n_heads: int
    head_dim: int

    kind = "lightning"
    keeps_tokens = False
    has_state = True

    @property
    def width(self) -> int:
        return self.n_heads * self.head_dim

    def params(self, hidden: int) -> int:
        w = self.width
        return 3 * hidden * w + hidden * w + w + w * hidden  # qkv_proj, output_gate, norm, out_proj

    def state_elems(self) -> int:
        """The K^T V state, n_heads x head_dim x head_dim, per sequence."""
        return self.n_heads * self.head_dim * self.head_dim

    def sizes(self) -> dict[str, int]:
        return {"num_attention_heads": self.n_heads, "head_dim": self.head_dim}

    def problems(self) -> list[str]:
        return []

    def describe(self) -> str:
        return f"lightning attention {self.n_heads} heads x {self.head_dim}"


@dataclass(frozen=True)
class ShortConv:
    """LFM2's short convolution: in_proj to 3 x width (B, C, x), y = C * conv(B * x) with a depthwise causal conv
    of l_cache taps per channel, then out_proj. No recurrence: its state is the last l_cache inputs per channel
    (transformers' cache keeps l_cache of them, not l_cache - 1). bias: in_proj, conv and out_proj (conv_bias)."""

    width: int  # conv channels (LFM2: hidden_size)
    l_cache: int  # conv taps (conv_L_cache)
    bias: bool = False

    kind = "short_conv"
    keeps_tokens = False
    has_state = True

    def params(self, hidden: int) -> int:
        w = self.width
        in_proj = hidden * 3 * w + (3 * w if self.bias else 0)
        conv = w * self.l_cache + (w if self.bias else 0)
        out = w * hidden + (hidden if self.bias else 0)
        return in_proj + conv + out

    def state_elems(self) -> int:
        """The conv state: width x l_cache, per sequence."""
        return self.width * self.l_cache

    def sizes(self) -> dict[str, int]:
        return {"the short convolution's width (hidden_size)": self.width, "conv_L_cache": self.l_cache}

    def problems(self) -> list[str]:
        return []

    def describe(self) -> str:
        return f"short conv {self.width} x {self.l_cache} taps"


@dataclass(frozen=True)
class ParallelHybrid:
    """Softmax attention and Mamba-2 side by side in one layer (Falcon-H1): both read the same normed input and
    their outputs are summed, so the layer keeps a K/V cache that grows with the context and a fixed SSM state."""

    attention: Attention
    mamba: Mamba2
    # engine-only (changes no bytes): Falcon-H1's muP multipliers on each part's input and output
    attention_in: float = 1.0
    attention_out: float = 1.0
    ssm_in: float = 1.0
    ssm_out: float = 1.0

    kind = "parallel_hybrid"
    keeps_tokens = True
    has_state = True

    @property
    def rope(self) -> Rope | None:
        return self.attention.rope

    def params(self, hidden: int) -> int:
        return self.attention.params(hidden) + self.mamba.params(hidden)

    def sizes(self) -> dict[str, int]:
        return self.attention.sizes() | {f"Mamba-2 {k}": v for k, v in self.mamba.sizes().items()}

    def problems(self) -> list[str]:
        return self.attention.problems() + self.mamba.problems()

    def describe(self) -> str:
        return f"{self.attention.describe()} || {self.mamba.describe()}"


def softmax_attention(m) -> Attention | None:
    """The (non-latent) softmax attention of a sequence mixer: itself, a parallel hybrid's attention part, or None.
    The what-ifs (--kv-heads, --window) re-shape what this returns."""
    if m is None:
        return None
    if m.kind == "attention":
        return m
    return m.attention if m.kind == "parallel_hybrid" else None


def with_attention(m, **changes):
    """`m` with its softmax attention re-shaped by `changes` (a mixer without one is returned as it is)."""
    a = softmax_attention(m)
    if a is None:
        return m
    return replace(a, **changes) if a is m else replace(m, attention=replace(a, **changes))


@dataclass(frozen=True)
class MLP:
    """Dense feed-forward: gated (SwiGLU/GeGLU: gate, up, down) or plain (up, down)."""

    d_ff: int
    gated: bool = True
    bias: bool = False
    activation: str = "silu"  # silu, gelu (exact), gelu_tanh, relu; on the gate when gated
    # engine-only (changes no bytes): Falcon-H1's mlp_multipliers, down(up x * act(gate x * m_gate)) * m_down
    multipliers: tuple[float, float] = (1.0, 1.0)

    kind = "mlp"

    def params(self, hidden: int) -> int:
        mats = 3 if self.gated else 2
        bias = ((2 if self.gated else 1) * self.d_ff + hidden) if self.bias else 0
        return mats * hidden * self.d_ff + bias

    def active_params(self, hidden: int) -> int:
        return self.params(hidden)

    def sizes(self) -> dict[str, int]:
        return {"intermediate size": self.d_ff}

    def problems(self) -> list[str]:
        return []

    def describe(self) -> str:
        return f"MLP {self.d_ff}{' gated' if self.gated else ''}"


@dataclass(frozen=True)
class Routing:
    """How a router turns its logits into top_k experts and their weights (engine-only detail).

    score: "softmax" (Mixtral, Qwen, Jamba, DeepSeek-V2) or "sigmoid" (DeepSeek-V3), per expert.
    bias: DeepSeek-V3's e_score_correction_bias, added to the scores to choose experts, not to weigh them.
    n_group, topk_group: group-limited routing: the experts form n_group groups, only the topk_group
      best groups compete; a group's score is its best expert ("max", V2) or its best two summed ("top2", V3).
    normalize: the chosen weights are divided by their sum (Mixtral; Qwen and V3 norm_topk_prob).
    scale: then multiplied by this (DeepSeek routed_scaling_factor).
    """

    score: str = "softmax"
    bias: bool = False
    n_group: int = 1
    topk_group: int = 1
    group_score: str = "max"
    normalize: bool = True
    scale: float = 1.0
    on_input: bool = False  # Llama 4: each chosen expert's weight scales the expert's input, not its output


@dataclass(frozen=True)
class MoE:
    """Mixture of experts: a router picks top_k of n_experts per token; shared experts always run."""

    n_experts: int
    top_k: int
    d_expert: int
    n_shared: int = 0
    d_shared: int = 0  # width of each shared expert (0: same as d_expert)
    gated: bool = True
    shared_gate: bool = False  # Qwen2-MoE style sigmoid gate on the shared expert
    routing: Routing = Routing()  # engine-only: how experts are chosen and weighed
    activation: str = "silu"  # engine-only: the experts' activation (Nemotron-H: relu2, non-gated)
    bias: bool = False  # gpt-oss: the router and every routed expert's projections carry biases
    # engine-only: gpt-oss's clamped SwiGLU (activation "clamped_swiglu"), (alpha, limit): swiglu_alpha, swiglu_limit
    swiglu: tuple[float, float] = (1.702, 7.0)

    kind = "moe"

    def expert_params(self, hidden: int) -> int:
        return MLP(self.d_expert, self.gated, self.bias).params(hidden)

    def shared_params(self, hidden: int) -> int:
        width = self.d_shared or self.d_expert
        return self.n_shared * MLP(width, self.gated).params(hidden) + (hidden if self.shared_gate else 0)

    def params(self, hidden: int) -> int:
        router = hidden * self.n_experts + (self.n_experts if self.bias else 0)
        return router + self.n_experts * self.expert_params(hidden) + self.shared_params(hidden)

    def active_params(self, hidden: int) -> int:
        return self.params(hidden) - (self.n_experts - self.top_k) * self.expert_params(hidden)

    def sizes(self) -> dict[str, int]:
        return {"expert count": self.n_experts, "num_experts_per_tok": self.top_k, "expert width": self.d_expert}

    def problems(self) -> list[str]:
        out = []
        if self.top_k > self.n_experts:
            out.append(f"num_experts_per_tok {self.top_k} is more than the {self.n_experts} experts; a token cannot "
                       "use more experts than there are")
        whole = all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in (self.n_shared, self.d_shared))
        if not whole:
            out.append(f"the shared experts ({self.n_shared} of width {self.d_shared}) must be whole numbers, 0 or "
                       "above; fix the config")
        r = self.routing
        if self.n_experts % r.n_group or not 1 <= r.topk_group <= r.n_group:
            out.append(f"expert groups n_group {r.n_group} / topk_group {r.topk_group} do not fit {self.n_experts} "
                       "experts (n_group must divide them, topk_group <= n_group); fix the config")
        return out

    def describe(self) -> str:
        s = f"MoE {self.n_experts} experts top-{self.top_k} x {self.d_expert}"
        if self.n_shared:
            s += f" + {self.n_shared} shared"
        return s


SequenceMixer = (Attention | LatentAttention | SparseLatentAttention | Mamba | Mamba2 | GatedDeltaNet
                 | ShortConv | ParallelHybrid | KimiDeltaAttention | LightningAttention)
ChannelMixer = MLP | MoE


@dataclass(frozen=True)
class Layer:
    mixer: SequenceMixer | None
    ffn: ChannelMixer | None
    norm_params: int = 0  # parameters of the block's own norms (not the mixers' inner norms)
    # engine-only: MiniMax's post-norm residual (mixer α, β, channel α, β): x = α·norm(x) + β·branch(norm(x)),
    # the normed input as the residual (transformers' MiniMaxDecoderLayer); None: x + branch(norm(x))
    alpha_beta: tuple[float, float, float, float] | None = None

    def params(self, hidden: int) -> int:
        p = self.norm_params
        if self.mixer is not None:
            p += self.mixer.params(hidden)
        if self.ffn is not None:
            p += self.ffn.params(hidden)
        return p

    def active_params(self, hidden: int) -> int:
        if self.ffn is None:
            return self.params(hidden)
        return self.params(hidden) - self.ffn.params(hidden) + self.ffn.active_params(hidden)

    def describe(self) -> str:
        parts = [m.describe() for m in (self.mixer, self.ffn) if m is not None]
        return " + ".join(parts)


@dataclass(frozen=True)
class ModelSpec:
    name: str
    model_type: str
    hidden: int
    vocab: int
    layers: tuple[Layer, ...]
    tied_embeddings: bool = False
    position_embeddings: int = 0  # learned absolute positions (GPT-2); 0 for rotary / none
    final_norm_params: int = 0
    max_context: int | None = None
    dtype: str | None = None  # the checkpoint's torch_dtype
    extra_params: int = 0  # parameters outside the decoder stack that a deployment loads (e.g. a vision tower)
    notes: tuple[str, ...] = field(default_factory=tuple)
    # engine-only details (do not change bytes or parameter counts)
    norm: str = "rms"  # rms (x * w), rms1p (Gemma: x * (1 + w)), layer (LayerNorm with bias)
    norm_eps: float = 1e-6
    sandwich_norms: bool = False  # Gemma 2/3: extra norms on the attention and MLP outputs
    embed_scale: float = 1.0  # Gemma: embeddings multiplied by sqrt(hidden)
    final_softcap: float | None = None  # final logit soft-capping: cap * tanh(logits / cap)
    residual_scale: float = 1.0  # Granite's residual_multiplier: x + scale * mixer(...) and x + scale * ffn(...)
    logit_scale: float = 1.0  # logits times this (Granite: 1 / logits_scaling; Falcon-H1: lm_head_multiplier)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    weight_format: Format | None = None  # the checkpoint's own format (quantization_config), None: its dtype

    # -- parameter counts -------------------------------------------------
    def embedding_params(self) -> int:
        return self.vocab * self.hidden + self.position_embeddings * self.hidden

    def lm_head_params(self) -> int:
        return 0 if self.tied_embeddings else self.vocab * self.hidden

    def params(self) -> int:
        return (
            self.embedding_params()
            + self.lm_head_params()
            + sum(layer.params(self.hidden) for layer in self.layers)
            + self.final_norm_params
            + self.extra_params
        )

    def active_params(self) -> int:
        """Parameters one token's forward pass uses (MoE: routed top_k + shared experts only)."""
        inactive = sum(layer.params(self.hidden) - layer.active_params(self.hidden) for layer in self.layers)
        return self.params() - inactive

    # -- structure ---------------------------------------------------------
    @property
    def context_limit(self) -> int | None:
        """The most tokens a sequence may hold: its learned positions (GPT-2) or its config's maximum context."""
        return self.position_embeddings or self.max_context

    def check_context(self, length: int, fix: str = "shorten the prompt or --max-new-tokens") -> None:
        """A one-line error for a sequence of `length` tokens past context_limit (none where it is unknown)."""
        limit = self.context_limit
        if limit and length > limit:
            raise KvwallError(f"{length:,} tokens is past {self.name}'s maximum context of {limit:,}; {fix}")

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    def has(self, kind: str) -> bool:
        return any(
            (layer.mixer is not None and layer.mixer.kind == kind) or (layer.ffn is not None and layer.ffn.kind == kind)
            for layer in self.layers
        )

    def family(self) -> str:
        """A short label of the model's memory kind: attention, MLA, SSM or hybrid."""
        mixers = [layer.mixer for layer in self.layers if layer.mixer is not None]
        kinds = {m.kind for m in mixers}
        ssm = {m.kind for m in mixers if m.has_state}  # a fixed state instead of a growing cache
        if ssm and (kinds - ssm or any(m.keeps_tokens for m in mixers)):  # Falcon-H1: both in one layer
            return "hybrid"
        if ssm:
            return "ssm"
        if kinds <= {"latent", "sparse_latent"}:  # DSA keeps the MLA latent too
            return "mla"
        spans = {m.window or m.chunk for m in mixers if m.kind == "attention"}  # a local layer's span, else None
        if None not in spans:
            return "chunked" if any(m.chunk for m in mixers if m.kind == "attention") else "sliding"
        if len(spans) > 1:
            return "local/global"
        return "attention"

    def layer_groups(self) -> list[tuple[str, list[int]]]:
        """Consecutive-or-not groups of identical layers: [(description, [indices])] in first-seen order."""
        groups: dict[str, list[int]] = {}
        for i, layer in enumerate(self.layers):
            groups.setdefault(layer.describe() or "(identity)", []).append(i)
        return list(groups.items())

    # -- what-if reshaping -------------------------------------------------
    def with_kv_heads(self, n_kv: int) -> ModelSpec:
        """Every attention layer re-shaped to n_kv key/value heads (n_q stays)."""
        return replace(self, layers=tuple(replace(layer, mixer=with_attention(layer.mixer, n_kv_heads=n_kv))
                                          for layer in self.layers))

    def with_window(self, window: int | None) -> ModelSpec:
        """Every attention layer given the same sliding window (None: full attention everywhere); a chunked layer's
        chunk goes too (it then keeps the window, or every token, like the others)."""
        return replace(self, layers=tuple(replace(layer, mixer=with_attention(layer.mixer, window=window, chunk=None))
                                          for layer in self.layers))

    def with_local_window(self, window: int) -> ModelSpec:
        """A what-if window that replaces the model's own: the attention layers that have a window, or a chunk (Llama
        4's local layers), get `window` (Gemma 3's local layers; its global ones stay global); a model without any
        local layer gets it everywhere."""
        attention = [a for a in map(softmax_attention, (layer.mixer for layer in self.layers)) if a is not None]
        if not any(m.window or m.chunk for m in attention):
            return self.with_window(window)
        layers = []
        for layer in self.layers:
            a = softmax_attention(layer.mixer)
            local = a is not None and (a.window or a.chunk)
            m = with_attention(layer.mixer, window=window, chunk=None) if local else layer.mixer
            layers.append(replace(layer, mixer=m))
        return replace(self, layers=tuple(layers))

    def attention_layers(self) -> list[int]:
        """Layers whose cache grows with the context (softmax or latent attention)."""
        return [i for i, layer in enumerate(self.layers) if layer.mixer is not None and layer.mixer.keeps_tokens]


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def dt_rank_auto(hidden: int) -> int:
    return math.ceil(hidden / 16)
