"""Where one decode step of a real model goes, measured per op next to the roofline's per-op prediction.

    python benchmarks/profile_step_ops.py [MODEL] [--weights native,fp32] [--batch 1,16] [--steps 16]

For each weight format and batch: load MODEL (a short name or a .gguf) as `kvwall bench --weights` does,
prefill 16 random tokens into a contiguous cache, then time `--steps` decode steps three ways, in turn: bare (the
median step, what `kvwall bench` reports: through the fused decode stack, engine/decode_stack.py, where the model
has one), bare layer by layer, and layer by layer with a timer around every projection, the cache's attention and
the embedding, summed per op group (qkv_proj, attention, o_proj, mlp, lm_head, embedding): the stack's one call
has no parts to time. What the timers do not cover (norms, rotary, activations, residual adds, Python) is
"rest". The prediction is `kvwall bench`'s
(kvwall.measure.real_bench.predict) on the `local` profile, split the same way; its fixed per-layer and per-step
costs are its "rest".
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time

import torch

GROUPS = {"wqkv": "qkv_proj", "wo": "o_proj", "w13": "mlp", "w2": "mlp", "w1": "mlp"}


class Timers:
    """Seconds per op group, summed over the calls made while `on`."""

    def __init__(self):
        self.on, self.total = False, collections.Counter()

    def wrap(self, obj, attr: str, group: str) -> None:
        inner = getattr(obj, attr)

        def timed(*a, **kw):
            if not self.on:
                return inner(*a, **kw)
            t0 = time.perf_counter()
            out = inner(*a, **kw)
            self.total[group] += time.perf_counter() - t0
            return out
        setattr(obj, attr, timed)


def instrument(model, cache) -> Timers:
    t = Timers()
    for name, mod in model.named_modules():
        group = GROUPS.get(name.rsplit(".", 1)[-1])
        if group:
            t.wrap(mod, "forward", group)
    t.wrap(model, "logits", "lm_head")  # a tied fp32 head is a plain x @ W^T there, no module call
    t.wrap(model.embed, "forward", "embedding")
    t.wrap(cache, "attend", "attention")
    return t


def measure(path: str, weights: str, batch: int, steps: int) -> tuple[float, float, dict[str, float], bool]:
    """(median bare step in the default fast path, the same layer by layer, {group: median seconds per step}
    of the layer-by-layer step with its timers, whether the model has a fused decode stack) of one model at one
    batch: the three kinds of step in turn."""
    from kvwall.engine.caches import make_cache
    from kvwall.engine.load import load_model

    model = load_model(path, weights=weights)
    cache = make_cache("contiguous", model.spec, batch, 16 + 3 * steps + 8)
    tok = torch.randint(0, 10000, (batch, 16), generator=torch.Generator().manual_seed(batch))  # (B, T)
    tok = model(tok, None, cache, last_only=True)[:, -1].argmax(-1, keepdim=True)  # (B, 1)
    timers, pos = instrument(model, cache), 16
    bare, per, fused = {"stack": [], "layers": []}, collections.defaultdict(list), False
    for i in range(3 * steps + 3):
        kind = ("stack", "layers", "timed")[i % 3]
        model.stack = None if kind == "stack" else False  # False: layer by layer (None: the stack, built again)
        timers.on, timers.total = kind == "timed", collections.Counter()
        t0 = time.perf_counter()
        tok = model(tok, torch.full((batch, 1), pos), cache)[:, -1].argmax(-1, keepdim=True)
        took, pos = time.perf_counter() - t0, pos + 1
        fused |= kind == "stack" and bool(model.stack)
        if i < 3:
            continue
        if timers.on:
            for g, s in list(timers.total.items()) + [("(step, timed)", took)]:
                per[g].append(s)
        else:
            bare[kind].append(took)
    return (statistics.median(bare["stack"]), statistics.median(bare["layers"]),
            {g: statistics.median(v) for g, v in per.items()}, fused)


def predicted(arch, weights: str, batch: int, context: int) -> tuple[float | None, dict[str, float]]:
    """The roofline's step and its op groups, or (None, {}) where the weights have no single format to predict
    with (a native file of mixed block types, Gemma 3's Q4_K_M: the measured side is still printed)."""
    from kvwall.errors import KvwallError
    from kvwall.measure.real_bench import held_format, kv_format
    from kvwall.predict.devices import local_device
    from kvwall.predict.memory import Formats
    from kvwall.predict.roofline import Roof, decode
    from kvwall.spec.formats import get_format
    from kvwall.spec.hf import spec_from_config

    spec = spec_from_config(arch.config, name=arch.name, where=arch.checkpoint).with_window(None)
    fp32 = get_format("fp32")
    try:
        fm = Formats(held_format(arch, weights), get_format(kv_format("contiguous")), fp32)
    except KvwallError:
        return None, {}
    d = decode(spec, context, batch, fm, Roof(local_device(), dtype="fp32"))
    groups = collections.Counter()
    for op in d.per_op:
        groups[op["group"]] += op["time_s"]
    groups["rest"] = d.overhead_s
    return d.time_s, dict(groups)


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default="smollm2-135m")
    ap.add_argument("--weights", default="native,fp32")
    ap.add_argument("--batch", default="1,16")
    ap.add_argument("--steps", type=int, default=16)
    a = ap.parse_args()
    from kvwall.measure.archs import gguf_arch

    arch = gguf_arch(a.model)
    for w in a.weights.split(","):
        for b in (int(x) for x in a.batch.split(",")):
            step, layers, got, fused = measure(arch.checkpoint, w, b, a.steps)
            got["rest"] = got.pop("(step, timed)") - sum(got.values())
            p_step, want = predicted(arch, w, b, 16 + 3 * a.steps // 2)
            how = "the fused decode stack" if fused else "no fused decode stack for this model"
            said = (f"predicted {p_step * 1e3:.2f} ms ({p_step / step - 1:+.0%})" if p_step is not None
                    else "not predicted: the file mixes weight types")
            print(f"\n{a.model} --weights {w}, batch {b}: measured {step * 1e3:.2f} ms/step (bare median, {how}; "
                  f"layer by layer {layers * 1e3:.2f}), {said}")
            print(f"  {'op group':<12}{'layer by layer ms':>18}{'predicted ms':>14}")
            for g in sorted(set(got) | set(want), key=lambda g: -got.get(g, 0)):
                print(f"  {g:<12}{got.get(g, 0) * 1e3:>18.2f}{want.get(g, 0) * 1e3:>14.2f}")


if __name__ == "__main__":
    main()
