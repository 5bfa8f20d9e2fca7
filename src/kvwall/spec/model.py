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
    # engine-only details (do not change bytes or parameter counts)
    rope: Rope | None = None  # full rotary description; None: learned or no rotary positions
    scale: float | None = None  # softmax scale; None: head_dim ** -0.5 (Gemma: query_pre_attn_scalar ** -0.5)
    softcap: float | None = None  # attention logit soft-capping (Gemma 2): cap * tanh(s / cap)

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
        return q + k + v + o + bias + norms

    def cache_elems_per_token(self) -> int:
        return self.n_kv_heads * (self.head_dim + self.v_head_dim)

    def sizes(self) -> dict[str, int]:
        """Fields that must be whole numbers from 1 up, by their config names (spec/validate.py checks them)."""
        out = {"num_attention_heads": self.n_q_heads, "num_key_value_heads": self.n_kv_heads,
               "head_dim": self.head_dim, "value head dim": self.v_head_dim}
        return out | ({"sliding_window": self.window} if self.window is not None else {})

    def problems(self) -> list[str]:
        """Rules between fields that do not hold, in words."""
        if self.n_q_heads % self.n_kv_heads:
            return [f"num_attention_heads {self.n_q_heads} is not a multiple of num_key_value_heads "
                    f"{self.n_kv_heads}; fix one of them"]
        return []

    def describe(self) -> str:
        grp = "MHA" if self.n_kv_heads == self.n_q_heads else ("MQA" if self.n_kv_heads == 1 else "GQA")
        s = f"{grp} {self.n_q_heads}q/{self.n_kv_heads}kv x {self.head_dim}"
        if self.v_head_dim != self.head_dim:
            s += f" (v {self.v_head_dim})"
        if self.window:
            s += f", window {self.window}"
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
    # engine-only details (do not change bytes or parameter counts)
    dt_limit: tuple[float, float] = (0.0, math.inf)  # the step size Δ is clamped to this range

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
        norm = self.d_inner
        out = self.d_inner * hidden + (hidden if self.proj_bias else 0)
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
class MLP:
    """Dense feed-forward: gated (SwiGLU/GeGLU: gate, up, down) or plain (up, down)."""

    d_ff: int
    gated: bool = True
    bias: bool = False
    activation: str = "silu"  # silu, gelu (exact), gelu_tanh, relu; on the gate when gated

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

    kind = "moe"

    def expert_params(self, hidden: int) -> int:
        return MLP(self.d_expert, self.gated).params(hidden)

    def shared_params(self, hidden: int) -> int:
        width = self.d_shared or self.d_expert
        return self.n_shared * MLP(width, self.gated).params(hidden) + (hidden if self.shared_gate else 0)

    def params(self, hidden: int) -> int:
        router = hidden * self.n_experts
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


SequenceMixer = Attention | LatentAttention | Mamba | Mamba2 | GatedDeltaNet
ChannelMixer = MLP | MoE


@dataclass(frozen=True)
class Layer:
    mixer: SequenceMixer | None
    ffn: ChannelMixer | None
    norm_params: int = 0  # parameters of the block's own norms (not the mixers' inner norms)

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
        if ssm and kinds - ssm:
            return "hybrid"
        if ssm:
            return "ssm"
        if kinds == {"latent"}:
            return "mla"
        windows = {m.window for m in mixers if m.kind == "attention"}
        if None not in windows:
            return "sliding"
        if len(windows) > 1:
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
        layers = []
        for layer in self.layers:
            m = layer.mixer
            if m is not None and m.kind == "attention":
                m = replace(m, n_kv_heads=n_kv)
            layers.append(replace(layer, mixer=m))
        return replace(self, layers=tuple(layers))

    def with_window(self, window: int | None) -> ModelSpec:
        """Every attention layer given the same sliding window (None: full attention everywhere)."""
        layers = []
        for layer in self.layers:
            m = layer.mixer
            if m is not None and m.kind == "attention":
                m = replace(m, window=window)
            layers.append(replace(layer, mixer=m))
        return replace(self, layers=tuple(layers))

    def with_local_window(self, window: int) -> ModelSpec:
        """A what-if window that replaces the model's own: the attention layers that have a window get `window`
        (Gemma 3's local layers; its global ones stay global); a model without any window gets it everywhere."""
        attention = [layer.mixer for layer in self.layers
                     if layer.mixer is not None and layer.mixer.kind == "attention"]
        if not any(m.window for m in attention):
            return self.with_window(window)
        layers = []
        for layer in self.layers:
            m = layer.mixer
            if m is not None and m.kind == "attention" and m.window:
                m = replace(m, window=window)
            layers.append(replace(layer, mixer=m))
        return replace(self, layers=tuple(layers))

    def attention_layers(self) -> list[int]:
        """Layers whose cache grows with the context (softmax or latent attention)."""
        return [i for i, layer in enumerate(self.layers) if layer.mixer is not None and layer.mixer.keeps_tokens]


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def dt_rank_auto(hidden: int) -> int:
    return math.ceil(hidden / 16)
