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
from kvwall.spec.formats import keep_16bit
from kvwall.predict.memory import Formats
from kvwall.predict.step import ACT_BYTES, GATHER, LINK, Op, Step, matmul
from kvwall.spec.model import Layer, ModelSpec

def layer_ops(i: int, layer: Layer, spec: ModelSpec, st: Step, fm: Formats, tp: int, mla_absorbed: bool) -> list[Op]:
    m, f = layer.mixer, layer.ffn
    ops: list[Op] = []
    if m is not None:
        ops += mixers.of(m).ops(i, m, spec, st, fm, tp, mla_absorbed)
    if f is not None:
        ops += mixers.of(f).ops(i, f, spec, st, fm, tp)
    if tp > 1:  # one all-reduce of the block output after each of mixer and channel mixer
        blocks = (m is not None) + (f is not None)
        size = st.tokens * spec.hidden * ACT_BYTES
        ops.append(Op("all-reduce", i, link_bytes=blocks * 2 * (tp - 1) / tp * size, kind=LINK))
    return ops


def step_ops(spec: ModelSpec, st: Step, fm: Formats, tp: int = 1, mla_absorbed: bool | None = None) -> list[Op]:
    """Every op of one step on one GPU (tensor parallel `tp`), embeddings and LM head included."""
    absorbed = (st.new == 1) if mla_absorbed is None else mla_absorbed
    w16 = keep_16bit(fm.weights)
    ops = [Op("embedding", None, weight_bytes=st.tokens * spec.hidden * w16.bytes_per_element(),
              act_bytes=st.tokens * spec.hidden * ACT_BYTES, kind=GATHER)]
    for i, layer in enumerate(spec.layers):
        ops += layer_ops(i, layer, spec, st, fm, tp, absorbed)
    ops.append(matmul("lm_head", None, st.batch, spec.hidden, spec.vocab / tp, w16))  # last position only
    return ops
