"""Decode speed beside a competing process, under each OpenMP barrier spin count (issue #43: robust under a
neighbour). OpenMP threads (libgomp: torch's, and llama-cpp-python's ggml CPU backend's) spin GOMP_SPINCOUNT times at
a barrier before they sleep (default 300,000); beside another process a spinning thread burns the time slice the one
it waits for needs, while a short spin makes every barrier of a quiet step a sleep and a wake-up.

Each round runs bench_long_race.py once per spin count, in a fresh process (libgomp reads the variable when it
loads), with --neighbour both: kvwall and llama.cpp on the same GGUF, quiet and then beside fair.NEIGHBOUR, each
engine on the same threads. Rounds alternate the spin counts; each figure is the median over rounds. llama.cpp
(llama-cpp-python's ggml CPU backend links libgomp too) runs under the same spin count as kvwall in each process.

    python benchmarks/bench_neighbour_spin.py --spins 300000,300 --rounds 3 --context 2048 \
        --json benchmarks/results/neighbour_spin.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).parent


def one(spin: str, args, out: Path) -> list[dict]:
    env = dict(os.environ, GOMP_SPINCOUNT=spin)
    cmd = [sys.executable, str(HERE / "bench_long_race.py"), "--model", "smollm2", "--contexts", str(args.context),
           "--batch", "1", "--new", str(args.new), "--caches", args.caches, "--kv", args.kv,
           "--engines", "kvwall,llama.cpp", "--runs", "1", "--threads", str(args.threads), "--neighbour", "both",
           "--json", str(out)]
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())["rows"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--spins", default="300000,300", help="GOMP_SPINCOUNT values (300000: libgomp's default)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--caches", default="int4")
    ap.add_argument("--kv", default="f16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    spins = args.spins.split(",")
    runs: dict[tuple, list[float]] = {}
    start = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for spin in spins if r % 2 == 0 else spins[::-1]:
                for row in one(spin, args, Path(tmp) / "race.json"):
                    key = (spin, row["engine"], row["neighbour"] or "quiet")
                    runs.setdefault(key, []).append(row["decode_tok_s"])
                print(f"round {r + 1}, GOMP_SPINCOUNT={spin} done ({time.time() - start:.0f} s)", file=sys.stderr)
    rows = []
    for (spin, engine, when), v in runs.items():
        quiet = statistics.median(runs[(spin, engine, "quiet")])
        rows.append({"gomp_spincount": spin, "engine": engine, "neighbour": when, "decode_tok_s": statistics.median(v),
                     "runs_tok_s": v, "vs_quiet": statistics.median(v) / quiet, "threads": args.threads,
                     "context": args.context, "new": args.new})
    print("| GOMP_SPINCOUNT | engine | quiet tok/s | beside the neighbour tok/s | kept |")
    print("|---|---|---|---|---|")
    for r in rows:
        if r["neighbour"] != "quiet":
            q = next(x for x in rows if x["neighbour"] == "quiet" and x["engine"] == r["engine"]
                     and x["gomp_spincount"] == r["gomp_spincount"])
            print(f"| {r['gomp_spincount']} | {r['engine']} | {q['decode_tok_s']:.1f} | {r['decode_tok_s']:.1f} | "
                  f"{r['vs_quiet']:.2f}x |")
    if args.json:
        args.json.write_text(json.dumps({
            "command": " ".join(sys.argv), "rounds": args.rounds, "threads": args.threads,
            "neighbour": "fair.NEIGHBOUR (benchmarks/fair.py)",
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
