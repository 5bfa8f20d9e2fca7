"""Dense feed-forward (gated: gate, up, down; plain: up, down). Tensor parallel splits d_ff; expert parallel
leaves a dense MLP whole on every GPU (each runs it on its own tokens)."""

from __future__ import annotations

from kvwall.predict.step import ACT_BYTES, Op, Step, matmul
from kvwall.spec.formats import tensor_format
from kvwall.spec.model import MLP


def shard_params(f: MLP, hidden: int, tp: int, ep: int = 1) -> float:
    return f.params(hidden) / tp


def ops(i: int, f: MLP, spec, st: Step, fm, tp: int, ep: int = 1, name: str = "mlp", kind: str = "linear",
        module: str = "mlp") -> list[Op]:
    """`kind` and `module` pick the matrices' format under a checkpoint's own (tensor_format): a routed expert's
    ("expert", "mlp.experts") may be MXFP4 where a dense MLP's stays bf16 (gpt-oss)."""
    mats = 3 if f.gated else 2
    op = matmul(name, i, st.tokens, spec.hidden, f.d_ff / tp, tensor_format(fm.weights, kind, module))
    op.flops *= mats
    op.weight_bytes *= mats
    op.act_bytes = st.tokens * (2 * spec.hidden + (mats - 1) * f.d_ff / tp) * ACT_BYTES
    return [op]


def matrices(m, hidden: int) -> list[tuple[str, str, int, int, int]]:
    """(tensor kind, module name, out, in, how many): the matrices a checkpoint stores in its weight format."""
    return gated_matrices("linear", "mlp", m.d_ff, m.gated, hidden, 1)


def gated_matrices(kind: str, name: str, d_ff: int, gated: bool, hidden: int, n: int) -> list:
    """An MLP's (gate,) up and down projections as matrices() rows, n of each (a MoE's experts)."""
    names = ("gate_proj", "up_proj") if gated else ("up_proj",)
    return [(kind, f"{name}.{x}", d_ff, hidden, n) for x in names] + [(kind, f"{name}.down_proj", hidden, d_ff, n)]
