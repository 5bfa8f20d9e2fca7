"""Is this host steady enough to validate predictions on? The same decode step timed in fresh processes in turn.

    .venv/bin/python benchmarks/process_spread.py [--processes 8] [--model smollm2-135m]

Each process loads the model and times its plain decode step as validate_serving.py's probe does (fp32, one
row, a 160-token cache, the median of 24 steps after 4 warm-up ones), then exits; the next starts. Within one
process the steps agree to a few percent; this prints how far the processes stand apart. `kvwall calibrate`
measures in one process and `kvwall bench` runs each architecture in its own, so a spread of tens of percent
between processes with nothing else running is a floor under the bench's decode errors that no profile can
lift (on the 2-core Firecracker VM of 2026-12-05, quiet: SmolLM2's step took 29.8-38.5 ms in eight processes
in a row, benchmarks/results/process_spread_1205_0759.txt).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

_ONE = r"""
import json, sys
sys.path.insert(0, sys.argv[2])
from validate_serving import Probe
print(json.dumps(Probe(sys.argv[1]).measure()))
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--processes", type=int, default=8)
    p.add_argument("--model", default="smollm2-135m")
    args = p.parse_args()
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime())} UTC, {os.cpu_count()} CPUs, load average "
          f"{os.getloadavg()[0]:.2f}; {args.model} fp32 decode step, one fresh process each:")
    steps = []
    for i in range(args.processes):
        out = subprocess.run([sys.executable, "-c", _ONE, args.model, str(Path(__file__).parent)],
                             capture_output=True, text=True, timeout=600, check=True)
        steps.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(f"  process {i + 1}: {steps[-1] * 1e3:6.1f} ms")
    mid = statistics.median(steps)
    print(f"median {mid * 1e3:.1f} ms; range {min(steps) * 1e3:.1f}-{max(steps) * 1e3:.1f} ms "
          f"({min(steps) / mid - 1:+.0%} ... {max(steps) / mid - 1:+.0%} of the median); load average "
          f"{os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
