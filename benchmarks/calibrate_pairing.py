"""Why calibrate pairs the 1-row matmul rate with the dispatch per block (kvwall.measure.overhead._paired_rounds).

    KVWALL_HOME=... .venv/bin/python benchmarks/calibrate_pairing.py [--rounds 8] [--model smollm2-135m]

Run after `kvwall calibrate`. Each round, within a few seconds: the model's plain decode step (fp32, one row,
a 160-token cache; its median of 24 steps, before and after the rest, averaged), the 1-row matmul rate and
cost per call, and the 2- and 10-block decode steps calibrate fits the dispatch per block on. It prints the op
model's time for the model's step three ways against the measured one:

* paired: the dispatch fitted against this round's own rate, the model timed at that rate;
* unpaired: the same dispatch with the profile's rate (measured at another moment, as calibrate did before);
* profile: the profile as calibrated.

The gap between paired and the others is what a rate read at another moment than the steps puts into the
dispatch figure (a difference of slopes over depth, which takes the rate's error whole).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from kvwall.measure import overhead as O
from kvwall.predict.devices import get_device
from kvwall.predict.memory import Formats
from kvwall.predict.roofline import Roof, decode
from kvwall.spec.formats import get_format
from kvwall.spec.resolve import load_spec

from validate_serving import PROBE_MIDDLE, Probe


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--model", default="smollm2-135m")
    args = p.parse_args()
    fp32 = get_format("fp32")
    fm = Formats(fp32, fp32, fp32)
    base, spec = get_device("local"), load_spec(args.model)
    context = PROBE_MIDDLE
    profile = decode(spec, context, 1, fm, Roof(base, "fp32")).time_s
    sets, nbytes = O.matmul_sets(128 << 20)
    specs = [O._arch_spec("gqa", n) for n in O.DEPTHS]
    toys, probe = [O._decoder(s) for s in specs], Probe(args.model)
    errors = {"paired": [], "unpaired": [], "profile": []}
    print(f"{args.model}: the profile puts its decode step at {profile * 1e3:.1f} ms")
    for r in range(args.rounds):
        before = probe.measure()
        block, rest, rate, fixed, _ = O.paired_round(base, specs, fm, sets, nbytes, toys, r * (30 + 4), 30)
        block, rest = max(block, 0.0), max(rest, 0.0)
        paired_dev = replace(O._bare(base, rate, fixed).device, layer_overhead_s=block, step_overhead_s=rest)
        paired = decode(spec, context, 1, fm, Roof(paired_dev, "fp32")).time_s
        unpaired = decode(spec, context, 1, fm, Roof(replace(base, layer_overhead_s=block, step_overhead_s=rest),
                                                     "fp32")).time_s
        measured = (before + probe.measure()) / 2
        for name, t in (("paired", paired), ("unpaired", unpaired), ("profile", profile)):
            errors[name].append(t / measured - 1)
        print(f"{time.strftime('%H:%M:%S', time.gmtime())} 1-row matmul {rate / 1e9:5.1f} GB/s + "
              f"{fixed * 1e6:3.0f} us, dispatch {block * 1e3:.2f} ms a block; step measured {measured * 1e3:5.1f} ms, "
              f"paired {paired * 1e3:5.1f} ({errors['paired'][-1]:+.0%}), unpaired {unpaired * 1e3:5.1f} "
              f"({errors['unpaired'][-1]:+.0%}), profile ({errors['profile'][-1]:+.0%})", flush=True)
    for name, e in errors.items():
        print(f"{name:>8}: median |error| {statistics.median(abs(x) for x in e):.0%}, "
              f"from {min(e):+.0%} to {max(e):+.0%}")


if __name__ == "__main__":
    main()
