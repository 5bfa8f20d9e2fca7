"""One module per mixer kind; each owns what that kind costs.

A sequence mixer module (attention, latent, mamba, mamba2) answers, for one layer's spec ``m``:

    token_bytes(m, kv, tp)     cache bytes one token of context adds, per sequence, on one GPU
    tokens_held(m, context)    tokens of context the layer keeps (a sliding window caps it; an SSM keeps none)
    fixed_bytes(m, state, tp)  bytes held per sequence whatever the length (SSM conv + SSM state)
    shard_params(m, hidden, tp)  parameters one GPU holds (its tensor-parallel sharding rule)
    ops(i, m, spec, step, fm, tp, absorbed)  the FLOPs and bytes of its ops in one step
    label(m)                   the kind of memory it has, for per-layer tables
    matrices(m, hidden)        where a checkpoint's own weight format is sized (memory.py): its stored matrices as
                               (tensor kind, module name, out, in, how many); a kind without it takes --weight-format

A channel mixer module (mlp, moe) answers shard_params(f, hidden, tp, ep) and ops(i, f, spec, step, fm, tp, ep):
with expert parallel (ep > 1) `step` is one GPU's share and a MoE splits its routed experts ep ways (a dense
MLP stays whole). memory.py, ops.py and roofline.py
iterate over layers and ask; the module is found by the spec's ``kind`` (``kind = "mamba"`` ->
``mixers/mamba.py``), so a new mixer kind is one new module here and nothing else on the predict side.
"""

from __future__ import annotations

import importlib
from functools import cache
from types import ModuleType


@cache
def _module(kind: str) -> ModuleType:
    return importlib.import_module(f"{__name__}.{kind}")


def of(m) -> ModuleType:
    """The module that owns a mixer spec's costs, by its kind."""
    return _module(m.kind)
