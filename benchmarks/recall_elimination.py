"""Why kvwall recall asks keys with replacement: attention, trained on MQAR where each key is asked exactly once,
learns elimination ("the value not yet asked") instead of the lookup. Trains the same 2-block attention model
(width 64, 4 pairs, 64 tokens, 1,000 steps, one thread) on both versions of the data and prints held-out accuracy
by the query's rank among the sequence's queries: elimination scores about 1/4, 1/3, 1/2, 1/1.

    .venv/bin/python benchmarks/recall_elimination.py [--steps 1000] [--pairs 4] [--seq 64]
"""

from __future__ import annotations

import argparse

import torch

from kvwall.measure import recall


def once(n: int, seq: int, pairs: int, seed: int):
    """Version 2's data: each key asked once, at a random even slot after the pairs, its value after it."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.rand(n, recall.KEYS, generator=g).argsort(1)[:, :pairs] + 1  # (n, N)
    values = torch.randint(recall.KEYS + 1, recall.VOCAB, (n, pairs), generator=g)  # (n, N)
    where = torch.rand(n, (seq - 2 * pairs) // 2, generator=g).argsort(1)[:, :pairs]  # (n, N) slot per key
    query = 2 * pairs + 2 * where  # (n, N)
    tokens = torch.full((n, seq), recall.FILLER, dtype=torch.long)
    tokens[:, 0:2 * pairs:2], tokens[:, 1:2 * pairs:2] = keys, values
    tokens.scatter_(1, query, keys)
    tokens.scatter_(1, query + 1, values)
    return tokens, torch.full((n, seq), recall.IGNORE, dtype=torch.long).scatter_(1, query, values)


def by_rank(model, tokens, targets, ranks: int) -> list[float]:
    """Accuracy of the k-th query of each sequence, k = 1..ranks."""
    with torch.no_grad():
        pred = model(tokens).argmax(-1)  # (n, seq)
    hits, total = [0] * ranks, [0] * ranks
    for row in range(tokens.shape[0]):
        for k, p in enumerate((targets[row] != recall.IGNORE).nonzero()[:ranks, 0].tolist()):
            hits[k] += int(pred[row, p] == targets[row, p])
            total[k] += 1
    return [h / t for h, t in zip(hits, total)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--pairs", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    args = p.parse_args()
    torch.set_num_threads(1)
    plan = recall.Plan(seq=args.seq, max_steps=args.steps, min_share=1.0)  # no early stop: the same budget
    arch = recall.Arch("attention")
    for name, data in (("each key asked once (version 2)", once), ("with replacement, every slot (now)", recall.mqar)):
        model = recall.build(recall.model_spec(arch, 64, args.seq), 0)
        done = recall.train(model, [args.pairs], plan, lr=recall.rate(arch, 64, plan), data=data)
        ranks = by_rank(model, *data(512, args.seq, args.pairs, seed=123), args.pairs)
        print(f"{name}: {done.accuracy[args.pairs] * 100:.1f} % after {done.steps} steps; by the query's rank: "
              + " ".join(f"{a * 100:.0f}%" for a in ranks))


if __name__ == "__main__":
    main()
