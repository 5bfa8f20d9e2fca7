"""FLOPs and bytes of every op of one forward step, per GPU: the layers' mixers are asked (predict/mixers).

A *step* (predict/step.py) feeds ``n`` new tokens to each of ``batch`` sequences whose cache
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

from kvwall.predict import mixers
from kvwall.predict.memory import Formats, check_expert_parallel
from kvwall.predict.step import ACT_BYTES, CACHE, GATHER, LINK, SCAN, Op, Step, matmul
from kvwall.spec.formats import head_format
from kvwall.spec.model import Layer, ModelSpec

PER_SEQUENCE = (CACHE, SCAN)  # ops whose work follows each sequence's own context, not just its token count

def layer_ops(i: int, layer: Layer, spec: ModelSpec, st: Step, fm: Formats, tp: int, mla_absorbed: bool,
              ep: int = 1) -> list[Op]:
    """One layer's ops on one GPU, `st` being that GPU's own share of the step (with expert parallel: 1/ep)."""
    m, f = layer.mixer, layer.ffn
    ops: list[Op] = []
    if m is not None:
        ops += mixers.of(m).ops(i, m, spec, st, fm, tp, mla_absorbed)
    if f is not None:
        ops += mixers.of(f).ops(i, f, spec, st, fm, tp, ep)
    if tp > 1:  # one all-reduce of the block output after each of mixer and channel mixer
        blocks = (m is not None) + (f is not None)
        size = st.tokens * spec.hidden * ACT_BYTES
        ops.append(Op("all-reduce", i, link_bytes=blocks * 2 * (tp - 1) / tp * size, kind=LINK))
    return ops


def step_ops(spec: ModelSpec, st: Step, fm: Formats, tp: int = 1, mla_absorbed: bool | None = None,
             ep: int = 1) -> list[Op]:
    """Every op of one step on one GPU (tensor parallel `tp`; expert parallel `ep`: the busiest GPU's share of the
    batch, rounded up), embeddings and LM head included."""
    check_expert_parallel(spec, ep)
    absorbed = (st.new == 1) if mla_absorbed is None else mla_absorbed
    st = Step(-(-st.batch // ep), st.past, st.new)
    ops = [embedding(spec, st.tokens, fm)]
    for i, layer in enumerate(spec.layers):
        ops += layer_ops(i, layer, spec, st, fm, tp, absorbed, ep)
    ops.append(lm_head(spec, st.batch, fm, tp))
    return ops


def embedding(spec: ModelSpec, tokens: int, fm: Formats) -> Op:
    """The embedding lookup: one row of the table read per token."""
    table = head_format(fm.weights)
    return Op("embedding", None, weight_bytes=tokens * spec.hidden * table.bytes_per_element(),
              act_bytes=tokens * spec.hidden * ACT_BYTES, kind=GATHER)


def lm_head(spec: ModelSpec, seqs: int, fm: Formats, tp: int = 1) -> Op:
    """The LM head on each sequence's last position only."""
    return matmul("lm_head", None, seqs, spec.hidden, spec.vocab / tp, head_format(fm.weights))


def mixed_ops(spec: ModelSpec, groups: list[Step], fm: Formats, tp: int = 1, ep: int = 1) -> list[Op]:
    """One step over a mixed batch, as a continuous-batching server runs it: each group is a uniform Step
    (decode tokens at one context, or a prefill chunk), and all groups share one forward.

    Per-token ops (projections, MLPs, experts, embedding, all-reduces) run once over all the tokens; the
    per-sequence ops (attention over each cache, SSM scans) are summed over the groups, their weights read
    once; the LM head runs on each sequence's last token. One group gives exactly `step_ops` of it. With expert
    parallel the busiest GPU runs 1/ep of the tokens (rounded up) and of the per-sequence work.
    """
    if not groups or any(g.batch < 1 or g.new < 1 or g.past < 0 for g in groups):
        raise ValueError(f"a mixed step needs groups of >= 1 sequence and >= 1 new token each, got {groups}")
    absorbed = all(g.new == 1 for g in groups)  # MLA: absorbed only when every row decodes
    tokens, seqs = sum(g.tokens for g in groups), sum(g.batch for g in groups)
    base = step_ops(spec, Step(1, 0, -(-tokens // ep)), fm, tp, absorbed, ep)
    parts = [iter([o for o in step_ops(spec, g, fm, tp, absorbed) if o.kind in PER_SEQUENCE]) for g in groups]
    out = []
    for op in base[:-1]:  # each per-sequence op in base's order, summed over the groups' own
        out += [op] if op.kind not in PER_SEQUENCE else _summed([next(p) for p in parts], ep)
    return out + [lm_head(spec, -(-seqs // ep), fm, tp)]


def _summed(ops: list[Op], ep: int = 1) -> list[Op]:
    """The same op over several groups: work and traffic add up per kernel (decode groups on the decode
    kernel, prefill chunks on the prefill kernel: one op each), its weights read once, by the first; / ep over
    expert parallel's data-parallel GPUs."""
    first = ops[0]
    assert all(o.name == first.name and o.layer == first.layer for o in ops), "groups gave different op lists"
    kernels = list(dict.fromkeys(o.kernel for o in ops))
    out = []
    for n, kernel in enumerate(kernels):
        mine = [o for o in ops if o.kernel == kernel]
        total = {k: sum(getattr(o, k) for o in mine) / ep
                 for k in ("flops", "cache_read", "cache_write", "state_bytes", "act_bytes", "link_bytes", "rows")}
        weights = max(o.weight_bytes for o in ops) if n == 0 else 0
        out.append(Op(first.name, first.layer, weight_bytes=weights, kernel=kernel, kind=first.kind, **total))
    return out
