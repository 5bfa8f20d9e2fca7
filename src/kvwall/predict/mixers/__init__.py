"""One module per mixer kind; each owns what that kind costs.

A sequence mixer module (attention, latent, mamba, mamba2) answers, for one layer's spec ``m``:

    token_bytes(m, kv, tp)     cache bytes one token of context adds, per sequence, on one GPU
    tokens_held(m, context)    tokens of context the layer keeps (a sliding window caps it; an SSM keeps none)
    fixed_bytes(m, state, tp)  bytes held per sequence whatever the length (SSM conv + SSM state)
    shard_params(m, hidden, tp)  parameters one GPU holds (its tensor-parallel sharding rule)
    ops(i, m, spec, step, fm, tp, absorbed)  the FLOPs and bytes of its ops in one step
    label(m)                   the kind of memory it has, for per-layer tables

A channel mixer module (mlp, moe) answers shard_params and ops. memory.py, ops.py and roofline.py
iterate over layers and ask; a new mixer kind is one module here plus one line in ``SEQUENCE``/``CHANNEL``.
"""

from __future__ import annotations

from types import ModuleType

from kvwall.predict.mixers import attention, latent, mamba, mamba2, mlp, moe

SEQUENCE: dict[str, ModuleType] = {"attention": attention, "latent": latent, "mamba": mamba, "mamba2": mamba2}
CHANNEL: dict[str, ModuleType] = {"mlp": mlp, "moe": moe}


def of(m) -> ModuleType:
    """The module that owns a mixer spec's costs, by its kind."""
    return SEQUENCE.get(m.kind) or CHANNEL[m.kind]
