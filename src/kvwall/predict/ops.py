"""FLOPs and bytes of every op of one forward step, per GPU.

A *step* feeds ``n`` new tokens to each of ``batch`` sequences whose cache
already holds ``past`` tokens: prefill is ``past=0, n=P``; one decode step at
context L is ``past=L-1, n=1``. For every op we count

* FLOPs: 2 per multiply-add of the matrix products, plus the attention
  scores/weighted sums and the SSM recurrence (elementwise work: stated per op);
* bytes: weights read (once per step, whatever the batch), cache read and
  written, SSM state read and written, activations in and out (16-bit).

Not counted (each well under 1 % at decode): norms, residual adds, rotary
embedding, softmax exponentials, the embedding gather's compute.

Attention over the cache reads every held K/V once per step (flash-style);
a sliding layer holds at most ``window`` tokens. MLA has two forms: *naive*
up-projects the cached latent to per-head K and V (for every held token, every
step) and attends as usual; *absorbed* folds W_UK into the query and W_UV into
the output so attention runs in latent space. Decode uses absorbed by default
(far fewer FLOPs, same bytes), prefill naive. MoE reads the weights of the
experts the step touches: for T routed tokens each picking k of E experts the
expected number of distinct experts is ``E (1 - (1 - k/E)^T)``.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvwall.predict.formats import Format
from kvwall.predict.memory import Formats, fixed_bytes, kv_heads_per_gpu, token_bytes
from kvwall.spec.model import MLP, Attention, Layer, LatentAttention, Mamba, Mamba2, ModelSpec, MoE

ACT_BYTES = 2  # activations in 16-bit


@dataclass
class Op:
    name: str
    layer: int | None
    flops: float = 0.0
    weight_bytes: float = 0.0
    cache_read: float = 0.0
    cache_write: float = 0.0
    state_bytes: float = 0.0
    act_bytes: float = 0.0
    link_bytes: float = 0.0  # bytes over the interconnect (tensor/pipeline parallel)
    kernel: str = ""  # which calibrated kernel streams this op's cache ("attention", "attention:int8", ...)

    @property
    def bytes(self) -> float:
        return self.weight_bytes + self.cache_read + self.cache_write + self.state_bytes + self.act_bytes

    @property
    def intensity(self) -> float:
        return self.flops / self.bytes if self.bytes else float("inf")

    def as_dict(self) -> dict:
        return {**self.__dict__, "bytes": self.bytes, "intensity": self.intensity}


@dataclass(frozen=True)
class Step:
    batch: int
    past: int  # tokens already in each sequence's cache
    new: int  # tokens fed per sequence this step

    @property
    def tokens(self) -> int:
        return self.batch * self.new

    def pairs(self, window: int | None) -> int:
        """Query-key pairs per sequence, causal, each query seeing at most `window` keys."""
        total = 0
        lo, hi = self.past + 1, self.past + self.new  # positions (1-based) of the new queries
        if window is None or hi <= window:
            return (lo + hi) * self.new // 2
        if lo <= window:
            total += (lo + window) * (window - lo + 1) // 2
            lo = window + 1
        return total + (hi - lo + 1) * window

    def held(self, window: int | None) -> int:
        ctx = self.past + self.new
        return min(ctx, window) if window else ctx


def expected_experts(n_experts: int, top_k: int, tokens: int) -> float:
    """Expected distinct experts touched when `tokens` tokens each route to top_k of n_experts uniformly."""
    return n_experts * (1 - (1 - top_k / n_experts) ** tokens)


def _matmul(name: str, layer: int, tokens: int, n_in: int, n_out: float, wfmt: Format) -> Op:
    return Op(name, layer, flops=2 * tokens * n_in * n_out, weight_bytes=n_in * n_out * wfmt.bytes_per_element(),
              act_bytes=tokens * (n_in + n_out) * ACT_BYTES)


def _per_head(name: str, layer: int, tokens: int, heads: int, n_in: int, n_out: int, wfmt: Format) -> Op:
    """A batched per-head matmul (MLA's absorbed projections): heads x (n_in -> n_out)."""
    return Op(name, layer, flops=2 * tokens * heads * n_in * n_out,
              weight_bytes=heads * n_in * n_out * wfmt.bytes_per_element(),
              act_bytes=tokens * heads * (n_in + n_out) * ACT_BYTES)


def attention_ops(i: int, m: Attention, spec: ModelSpec, st: Step, fm: Formats, tp: int) -> list[Op]:
    h, T = spec.hidden, st.tokens
    q_heads = m.n_q_heads // tp
    kvh = kv_heads_per_gpu(m, tp)
    tb = token_bytes(Layer(m, None), fm.kv, tp)
    qkv_out = q_heads * m.head_dim + kvh * (m.head_dim + m.v_head_dim)
    core = Op("attention", i, flops=2 * st.batch * q_heads * (m.head_dim + m.v_head_dim) * st.pairs(m.window),
              cache_read=st.batch * st.held(m.window) * tb,
              cache_write=st.batch * min(st.new, m.window or st.new) * tb,
              act_bytes=T * q_heads * (m.head_dim + m.v_head_dim) * ACT_BYTES,
              kernel="attention" if fm.kv.is_float() else f"attention:{fm.kv.name}")
    return [_matmul("qkv_proj", i, T, h, qkv_out, fm.weights), core,
            _matmul("o_proj", i, T, q_heads * m.v_head_dim, h, fm.weights)]


def latent_ops(i: int, m: LatentAttention, spec: ModelSpec, st: Step, fm: Formats, tp: int,
               absorbed: bool) -> list[Op]:
    h, T, B = spec.hidden, st.tokens, st.batch
    H = m.n_heads // tp
    ops = []
    if m.q_lora_rank:
        ops += [_matmul("q_a_proj", i, T, h, m.q_lora_rank, fm.weights),
                _matmul("q_b_proj", i, T, m.q_lora_rank, H * m.qk_head_dim, fm.weights)]
    else:
        ops.append(_matmul("q_proj", i, T, h, H * m.qk_head_dim, fm.weights))
    ops.append(_matmul("kv_a_proj", i, T, h, m.kv_lora_rank + m.qk_rope_head_dim, fm.weights))
    lat = m.kv_lora_rank + m.qk_rope_head_dim
    held, pairs = st.held(None), st.pairs(None)
    tb = fm.kv.vector_bytes(lat)
    cache = dict(cache_read=B * held * tb, cache_write=B * st.new * tb)
    up_width = H * (m.qk_nope_head_dim + m.v_head_dim)
    if absorbed:
        ops.append(_per_head("q_absorb (W_UK)", i, T, H, m.qk_nope_head_dim, m.kv_lora_rank, fm.weights))
        ops.append(Op("latent attention", i, flops=2 * B * H * pairs * (lat + m.kv_lora_rank),
                      act_bytes=T * H * (lat + m.kv_lora_rank) * ACT_BYTES, **cache))
        ops.append(_per_head("out_absorb (W_UV)", i, T, H, m.kv_lora_rank, m.v_head_dim, fm.weights))
    else:
        up = _matmul("kv_b_proj (up-project cache)", i, B * held, m.kv_lora_rank, up_width, fm.weights)
        up.act_bytes = B * held * up_width * ACT_BYTES  # the latent itself is counted as cache read
        ops.append(up)
        ops.append(Op("attention", i, flops=2 * B * H * pairs * (m.qk_head_dim + m.v_head_dim),
                      act_bytes=(T * H * (m.qk_head_dim + m.v_head_dim)) * ACT_BYTES, **cache))
    ops.append(_matmul("o_proj", i, T, H * m.v_head_dim, h, fm.weights))
    return ops


def mamba_ops(i: int, m: Mamba, spec: ModelSpec, st: Step, fm: Formats, tp: int) -> list[Op]:
    h, T = spec.hidden, st.tokens
    d = m.d_inner // tp
    state = fixed_bytes(Layer(m, None), fm.state, tp)
    # recurrence per (channel, state) element: dt*A, exp, dt*B*x, A_bar*h + B_bar*x (2), y += C*h (2): 7 FLOPs
    scan = Op("selective scan", i, flops=T * (7 * d * m.d_state + 2 * d * m.d_conv),
              state_bytes=st.batch * state * (2 if st.past else 1),
              act_bytes=T * (2 * d + 2 * m.d_state + d) * ACT_BYTES,
              weight_bytes=d * (m.d_state + m.d_conv + 2) * fm.weights.bytes_per_element())
    return [_matmul("in_proj", i, T, h, 2 * d, fm.weights),
            _matmul("x_proj", i, T, d, m.dt_rank + 2 * m.d_state, fm.weights),
            _matmul("dt_proj", i, T, m.dt_rank, d, fm.weights), scan,
            _matmul("out_proj", i, T, d, h, fm.weights)]


def mamba2_ops(i: int, m: Mamba2, spec: ModelSpec, st: Step, fm: Formats, tp: int) -> list[Op]:
    h, T = spec.hidden, st.tokens
    H = m.n_heads // tp
    groups = m.n_groups // tp if m.n_groups >= tp else 1
    d = H * m.head_dim
    conv_dim = d + 2 * groups * m.d_state
    state = fixed_bytes(Layer(m, None), fm.state, tp)
    # per (head, head_dim, state) element: dt*x*B, decay*h + that (2), y += C*h (2): 5 FLOPs (recurrent form)
    ssd = Op("ssd scan", i, flops=T * (5 * d * m.d_state + 2 * conv_dim * m.d_conv + 4 * d),
             state_bytes=st.batch * state * (2 if st.past else 1), act_bytes=T * (conv_dim + 2 * d) * ACT_BYTES,
             weight_bytes=(conv_dim * (m.d_conv + 1) + 3 * H + d) * fm.weights.bytes_per_element())
    return [_matmul("in_proj", i, T, h, 2 * d + 2 * groups * m.d_state + H, fm.weights), ssd,
            _matmul("out_proj", i, T, d, h, fm.weights)]


def mlp_ops(i: int, f: MLP, spec: ModelSpec, st: Step, fm: Formats, tp: int, name: str = "mlp") -> list[Op]:
    mats = 3 if f.gated else 2
    op = _matmul(name, i, st.tokens, spec.hidden, f.d_ff / tp, fm.weights)
    op.flops *= mats
    op.weight_bytes *= mats
    op.act_bytes = st.tokens * (2 * spec.hidden + (mats - 1) * f.d_ff / tp) * ACT_BYTES
    return [op]


def moe_ops(i: int, f: MoE, spec: ModelSpec, st: Step, fm: Formats, tp: int) -> list[Op]:
    T, h = st.tokens, spec.hidden
    router = _matmul("router", i, T, h, f.n_experts, fm.weights)
    expert = MLP(f.d_expert, f.gated)
    one = mlp_ops(i, expert, spec, Step(1, 0, 1), fm, tp)[0]
    touched = expected_experts(f.n_experts, f.top_k, T)
    experts = Op(f"experts ({touched:.1f} of {f.n_experts} touched)", i, flops=T * f.top_k * one.flops,
                 weight_bytes=touched * one.weight_bytes, act_bytes=T * f.top_k * one.act_bytes)
    ops = [router, experts]
    if f.n_shared:
        shared = MLP((f.d_shared or f.d_expert) * f.n_shared, f.gated)
        ops += mlp_ops(i, shared, spec, st, fm, tp, name="shared experts")
    return ops


def layer_ops(i: int, layer: Layer, spec: ModelSpec, st: Step, fm: Formats, tp: int, mla_absorbed: bool) -> list[Op]:
    m, f = layer.mixer, layer.ffn
    ops: list[Op] = []
    if isinstance(m, Attention):
        ops += attention_ops(i, m, spec, st, fm, tp)
    elif isinstance(m, LatentAttention):
        ops += latent_ops(i, m, spec, st, fm, tp, mla_absorbed)
    elif isinstance(m, Mamba):
        ops += mamba_ops(i, m, spec, st, fm, tp)
    elif isinstance(m, Mamba2):
        ops += mamba2_ops(i, m, spec, st, fm, tp)
    if isinstance(f, MLP):
        ops += mlp_ops(i, f, spec, st, fm, tp)
    elif isinstance(f, MoE):
        ops += moe_ops(i, f, spec, st, fm, tp)
    if tp > 1:  # one all-reduce of the block output after each of mixer and channel mixer
        blocks = (m is not None) + (f is not None)
        size = st.tokens * spec.hidden * ACT_BYTES
        ops.append(Op("all-reduce", i, link_bytes=blocks * 2 * (tp - 1) / tp * size))
    return ops


def step_ops(spec: ModelSpec, st: Step, fm: Formats, tp: int = 1, mla_absorbed: bool | None = None) -> list[Op]:
    """Every op of one step on one GPU (tensor parallel `tp`), embeddings and LM head included."""
    absorbed = (st.new == 1) if mla_absorbed is None else mla_absorbed
    w16 = fm.weights if fm.weights.bits >= 16 else Format("bf16", 16)
    ops = [Op("embedding", None, weight_bytes=st.tokens * spec.hidden * w16.bytes_per_element(),
              act_bytes=st.tokens * spec.hidden * ACT_BYTES)]
    for i, layer in enumerate(spec.layers):
        ops += layer_ops(i, layer, spec, st, fm, tp, absorbed)
    ops.append(_matmul("lm_head", None, st.batch, spec.hidden, spec.vocab / tp, w16))  # last position only
    return ops
