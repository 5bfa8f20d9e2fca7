"""Recall against memory: train small models on multi-query associative recall (MQAR) and set what each
recalls beside the bytes it keeps per sequence.

MQAR (Arora et al., "Zoology: Measuring and Improving Recall in Efficient Language Models", 2023): a
sequence opens with N key-value pairs, and later on each key comes back as a query whose answer is its value.
Attention can look the pair up; a fixed-state model must have squeezed all N pairs into its state. Zoology's
finding: attention solves MQAR at every width, fixed-state models fall as N grows unless the state grows.

    vocabulary   0 filler | keys 1..KEYS | values KEYS+1..KEYS+VALUES
    sequence     k1 v1 k2 v2 .. kN vN  then queries: every even position after the pairs holds a key drawn with
                 replacement from the N, its value at the next position
    targets      the value at each query position (the next token), IGNORE elsewhere: loss on answers only

Two choices differ from a first version that asked each key exactly once, at N random slots (measured: attention,
width 64, 4 pairs at 64 tokens, 1,000 steps). There the answer of the k-th query was also "the one value of the
pairs not yet asked", and attention learned that elimination instead of the lookup: it scored 27, 34, 52 and 99 %
on the 1st to 4th query (1/4, 1/3, 1/2, 1/1), about H(N)/N overall (51 % at 4 pairs, 14-21 % at 16). Keys asked
with replacement leave nothing to eliminate, and asking at every slot gives 7x the answers per sequence at 4 pairs:
4 pairs were then solved (99.6 %) in 600 steps. And, as in Zoology, one model trains on the mixture of the pair
counts asked (a step each, in turn) and is evaluated at each: alone, 16 pairs stayed at chance after 1,000 steps,
while the mixture of 4, 8 and 16 reached 99.8 % at all three by step 1,000 (the 4-pair steps find the lookup).

The models are kvwall's own engine (kvwall.engine.model.Transformer, the same layer modules that decode
elsewhere), built from a ModelSpec that the spec parsers make from a Hugging Face-style config; 2 blocks each:
    attention  llama: 2 x (attention + gated MLP)          sliding:W  the same, each layer a window of W tokens
    mamba      2 Mamba blocks (d_state 16, no MLP)         mamba2     2 Mamba-2 blocks (d_state 64, no MLP)
    hybrid     jamba: a Mamba block, then an attention block, each with a gated MLP
    gated_deltanet  qwen3_5_text: 2 x (Gated DeltaNet + gated MLP), its state shaped as Mamba-2's: one key head of
               64 (Mamba-2's one group of d_state 64), value heads of 32 as many as Mamba-2's heads, conv 4 taps:
               the same conv + state bytes as mamba2, so the two differ in the update rule (delta vs decayed sum)
Kept bytes are kvwall.predict.memory's cache bytes for one sequence of the evaluation length in fp32 (the
dtype the models run in): K/V of every token for attention, of the last W for sliding, the fixed conv + SSM
state for Mamba / Mamba-2, the sum for the hybrid.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import NamedTuple

from kvwall.errors import KvwallError
from kvwall.predict.memory import Formats, memory
from kvwall.spec.formats import get_format
from kvwall.spec.hf import spec_from_config
from kvwall.spec.model import ModelSpec
from kvwall.units import ascii_digits, parse_int_list

FILLER, KEYS, VALUES = 0, 128, 128
VOCAB = 1 + KEYS + VALUES
IGNORE = -100  # cross_entropy's ignore_index: no loss off the answers
HEAD_DIM = 32  # attention head width; Mamba-2 head width too


class Kind(NamedTuple):
    lr: float  # AdamW peak rate at RATE_WIDTH
    scaled: bool  # the rate scales as RATE_WIDTH / width
    cost: float  # measured training seconds at width 64 (the order of a parallel run)


# kind -> its AdamW peak learning rate. Picked by hand at width 64 on the mixture of 4, 8 and 16 pairs at 64
# tokens, 1,000 steps (accuracy at 4 / 8 / 16 pairs; guessing one of the N values is 25 / 12.5 / 6.2 %):
#   attention 1e-3: 99.9 / 99.8 / 99.8 %; 3e-3: 26 / 14 / 8 % (the lookup never formed)
#   hybrid    1e-3: 97 / 92 / 82 %;       3e-3: 100 / 100 / 100 %
#   mamba     1e-3: 24 / 12 / 6 %;        3e-3: 18 / 9 / 4 %;  1e-2: 31 / 19 / 9 % (still rising)
#   mamba2    1e-2: 98.7 / 95.5 / 92 %
# Zoology sweeps the rate per model and keeps the best; on 2 cores this is the sweep there was time for.
# `scaled`: the rate is KINDS' at RATE_WIDTH and scales as RATE_WIDTH / width elsewhere (muP's rule for Adam: a
# step moves each weight by about lr, so a hidden matrix's output moves by lr x fan-in, twice as far at twice the
# width). Measured for attention at width 128 (mixture, 1,000 steps, test accuracy at 4 / 8 / 16 pairs): at 1e-3
# both seeds stayed at guessing (26 / 14 / 9 %, the default run of 2026-12-02); at 5e-4 seed 0 reached
# 99.9 / 99.9 / 99.8 % (target at step 900) and seed 1 98.5 / 98.1 / 96.9 % (step 1,000), one attempt each. Width 64
# keeps 1e-3, so its models and cache keys are unchanged. The other kinds keep one rate at every width: sliding:8
# at width 128 scored 88 / 63 / 37 % at 1e-3 (its reach's ceiling, 87 / 61 / 36 % by hand) but 51 / 31 / 17 % at
# 5e-4 (1,000 steps, still rising: a window of 8 never forms the lookup, it learns a short copy); Mamba-2
# (95-99 %) and the hybrid (99.6-99.9 %) learned at width 128 with theirs; Mamba at 128 (45 / 27 / 14 % and
# 60 / 34 / 17 % in two default runs: its training is not deterministic) may want the rule: not measured.
# `cost`: the seconds the kind's width-64 model took in the default grid (2026-12-02, one thread, both attempts
# counted): only the order in which `run` starts models on several processes, longest first, reads it.
GDN_LR = 1e-2  # Gated DeltaNet: Mamba-2's rate, not swept (see the note in docs/guide/quality-recall.md)
KINDS = {"attention": Kind(1e-3, True, 700), "sliding": Kind(1e-3, False, 260), "mamba": Kind(1e-2, False, 1210),
         "mamba2": Kind(1e-2, False, 730), "hybrid": Kind(3e-3, False, 110),
         "gated_deltanet": Kind(GDN_LR, False, 990)}  # cost: 1.35 x Mamba-2's (777 / 577 s side by side, --quick)
RATE_WIDTH = 64
VERSION = 3  # bump when training or data change, so cached results of the old code are not reused


# -- data ------------------------------------------------------------------------------------------------

def max_pairs(seq: int) -> int:
    """The most pairs a sequence of `seq` tokens holds: 2N for the pairs and at least 2N for queries and values."""
    return min(KEYS, seq // 4)


def mqar(n: int, seq: int, pairs: int, seed: int):
    """n MQAR sequences -> tokens (n, seq) and targets (n, seq) (IGNORE except at the query positions).

    Seeded (torch.Generator): the same (n, seq, pairs, seed) gives the same batch."""
    import torch

    if not 1 <= pairs <= max_pairs(seq):
        raise KvwallError(f"{pairs} pairs do not fit {seq} tokens (at most {max_pairs(seq)}: 4 tokens a pair); "
                          "lower --pairs or raise --seq")
    g = torch.Generator().manual_seed(seed)
    keys = torch.rand(n, KEYS, generator=g).argsort(1)[:, :pairs] + 1  # (n, N) distinct keys per row
    values = torch.randint(KEYS + 1, VOCAB, (n, pairs), generator=g)  # (n, N)
    slots = (seq - 2 * pairs) // 2  # Q query slots after the pairs, every one asked
    pick = torch.randint(0, pairs, (n, slots), generator=g)  # (n, Q) which pair each query asks, with replacement
    query = torch.arange(2 * pairs, 2 * pairs + 2 * slots, 2).expand(n, slots)  # (n, Q) positions of the queries
    tokens = torch.full((n, seq), FILLER, dtype=torch.long)
    tokens[:, 0:2 * pairs:2], tokens[:, 1:2 * pairs:2] = keys, values  # (n, N) each: the pairs
    tokens.scatter_(1, query, keys.gather(1, pick))  # (n, seq) each query's key ...
    tokens.scatter_(1, query + 1, values.gather(1, pick))  # ... and its value after it, as in Zoology
    targets = torch.full((n, seq), IGNORE, dtype=torch.long).scatter_(1, query, values.gather(1, pick))  # (n, seq)
    return tokens, targets


# -- architectures ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Arch:
    kind: str
    window: int | None = None  # sliding only

    @property
    def name(self) -> str:
        return f"sliding:{self.window}" if self.window else self.kind


def parse_archs(text: str, seq: int) -> list[Arch]:
    """"attention,sliding:16,mamba" -> Archs; a one-line error for an unknown name or a window that never slides."""
    if not text.strip():
        raise KvwallError("--archs is empty: give architectures separated by commas, e.g. attention,sliding:8,mamba")
    out = []
    for part in (p.strip() for p in text.split(",")):
        kind, _, opt = part.partition(":")
        if kind not in KINDS or (kind == "sliding") != bool(opt):
            raise KvwallError(f"--archs: unknown architecture {part!r}; choose from attention, sliding:W (W a "
                              "window in tokens), mamba, mamba2, hybrid, gated_deltanet")
        window = None
        if opt:
            if not ascii_digits(opt) or len(opt.lstrip("0")) > 4 or not 1 <= int(opt) < seq:  # --seq <= 4,096
                raise KvwallError(f"--archs {part}: the window must be a whole number from 1 to {seq - 1} (below "
                                  f"--seq {seq}, else it never slides)")
            window = int(opt)
        out.append(Arch(kind, window))
    return list(dict.fromkeys(out))


def check_width(width: int) -> None:
    if width % HEAD_DIM or not HEAD_DIM <= width <= 1024:
        raise KvwallError(f"--widths: {width} is not a multiple of {HEAD_DIM} from {HEAD_DIM} to 1024 (heads are "
                          f"{HEAD_DIM} wide); e.g. --widths 64,128")


def config(arch: Arch, width: int, seq: int) -> dict:
    """The Hugging Face-style config.json of one model (2 blocks, hidden `width`), parsed like any real model's."""
    check_width(width)
    heads = width // HEAD_DIM
    base = dict(vocab_size=VOCAB, hidden_size=width, num_hidden_layers=2, tie_word_embeddings=False,
                torch_dtype="float32", max_position_embeddings=seq)
    attn = dict(num_attention_heads=heads, num_key_value_heads=heads, head_dim=HEAD_DIM, intermediate_size=2 * width,
                rms_norm_eps=1e-5, rope_theta=10000.0)
    if arch.kind == "attention":
        return dict(base, model_type="llama", **attn)
    if arch.kind == "sliding":
        return dict(base, model_type="mistral", sliding_window=arch.window, **attn)
    if arch.kind == "mamba":
        return dict(base, model_type="mamba", state_size=16, expand=2, conv_kernel=4, time_step_rank="auto")
    if arch.kind == "mamba2":
        return dict(base, model_type="mamba2", num_heads=2 * width // HEAD_DIM, head_dim=HEAD_DIM, state_size=64,
                    n_groups=1, expand=2, conv_kernel=4)
    if arch.kind == "gated_deltanet":  # Mamba-2's state shapes: (2w/32 heads x 32) x 64 and conv 2w + 2·64 wide
        return dict(base, model_type="qwen3_5_text", layer_types=["linear_attention"] * 2, **attn,
                    linear_num_key_heads=1, linear_key_head_dim=64, linear_num_value_heads=2 * width // HEAD_DIM,
                    linear_value_head_dim=HEAD_DIM, linear_conv_kernel_dim=4)
    assert arch.kind == "hybrid", arch
    return dict(base, model_type="jamba", **attn, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=3,
                expert_layer_offset=2, num_experts=1, num_experts_per_tok=1, mamba_d_state=16, mamba_expand=2,
                mamba_d_conv=4)


def model_spec(arch: Arch, width: int, seq: int) -> ModelSpec:
    return spec_from_config(config(arch, width, seq), name=f"{arch.name} w{width}", where=f"recall arch {arch.name}")


FP32 = Formats(get_format("fp32"), get_format("fp32"), get_format("fp32"))


def kept_bytes(spec: ModelSpec, seq: int) -> dict[str, int]:
    """What one sequence of `seq` tokens keeps at decode: kvwall.predict.memory's cache_bytes (batch 1, fp32),
    split into K/V (attention layers, window-bounded) and fixed state (SSM layers)."""
    report = memory(spec, batch=1, context=seq, formats=FP32)
    state = report.fixed_bytes
    return {"kept_bytes": report.cache_bytes, "kv_bytes": report.cache_bytes - state, "state_bytes": state}


# -- training -----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Plan:
    """How each model trains. Steps of `batch` fresh sequences (a new seed per step, so no sequence repeats), the
    pair counts taking turns; AdamW with a linear warm-up then cosine decay over max_steps; gradients clipped to
    norm 1 (an earlier attempt saw Mamba-2 diverge without a lower rate and clipping); every eval_every steps,
    accuracy on `val` sequences per pair count, and a stop when every count reaches `target` or the mean plateaus
    (see plateaued); finally accuracy on `test` held-out sequences per count (their own seeds)."""

    seq: int
    batch: int = 32
    max_steps: int = 1500
    warmup: int = 50
    lr: float | None = None  # None: the architecture's own rate (KINDS)
    weight_decay: float = 0.1
    eval_every: int = 50
    patience: int = 6
    min_share: float = 0.4  # no plateau stop before 40 % of max_steps: MQAR sits at chance, then the lookup forms
    margin: float = 0.05  # ... nor while the best is within 5 points of guessing one of the N values
    target: float = 0.995
    val: int = 128
    test: int = 512
    seed: int = 0
    attempts: int = 2  # a model whose mean never got past guessing trains again from the next seed (see one())


def build(spec: ModelSpec, seed: int):
    """The engine's Transformer for spec, seeded, in training mode (contiguous weights: the eager layout)."""
    import torch

    from kvwall.engine.model import Transformer

    torch.manual_seed(seed)
    model = Transformer(spec).set_eager(True)
    _init(model)
    return model.train()


def _init(model) -> None:
    """GPT-2-style small init for linear and embedding weights (nn.Linear's default is too large to train a
    2-layer model fast); SSM parameters (A_log, D, dt_proj) keep Mamba's own init."""
    import torch
    from torch import nn

    for name, m in model.named_modules():
        if isinstance(m, (nn.Linear, nn.Embedding)) and not name.endswith("dt_proj"):
            nn.init.normal_(m.weight, std=0.02)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)
    for m in model.modules():  # Mamba: A = -(1..N) per channel, dt bias so that softplus(bias) is in [1e-3, 0.1]
        if hasattr(m, "A_log") and hasattr(m, "x_proj"):
            E, N = m.A_log.shape
            with torch.no_grad():
                m.A_log.copy_(torch.log(torch.arange(1, N + 1, dtype=torch.float32)).expand(E, N))
                dt = torch.exp(torch.rand(E) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))  # (E,)
                m.dt_proj.bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus
        elif hasattr(m, "A_log") and hasattr(m, "dt_bias"):  # Mamba-2 and Gated DeltaNet: A in [1, 16], dt in
            # [1e-3, 0.1] (Gated DeltaNet's reference init, FLA's GatedDeltaNet, is Mamba-2's)
            H = m.A_log.shape[0]
            with torch.no_grad():
                m.A_log.copy_(torch.log(torch.rand(H) * 15 + 1))
                dt = torch.exp(torch.rand(H) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))  # (H,)
                m.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))


def accuracy(model, tokens, targets, batch: int = 128) -> float:
    """Share of answer positions where the model's top token is the value (greedy, teacher-forced)."""
    import torch

    hit = total = 0
    with torch.no_grad():
        for s in range(0, tokens.shape[0], batch):
            t, y = tokens[s:s + batch], targets[s:s + batch]
            pred = model(t).argmax(-1)  # (b, seq)
            ask = y != IGNORE
            hit += int((pred[ask] == y[ask]).sum())
            total += int(ask.sum())
    return hit / total


@dataclass
class Trained:
    accuracy: dict[int, float]  # pairs -> held-out accuracy
    steps: int
    stopped: str  # "target", "plateau" or "max steps"
    seconds: float
    curve: list[tuple[int, float]] = field(default_factory=list)  # (step, mean validation accuracy over the pairs)


def rate(arch: Arch, width: int, plan: Plan) -> float:
    """The peak learning rate arch trains at, at `width`: the plan's when it sets one, else the architecture's
    (KINDS), times RATE_WIDTH / width where it scales."""
    if plan.lr:
        return plan.lr
    lr, scaled, _ = KINDS[arch.kind]
    return lr * (RATE_WIDTH / width) if scaled else lr  # 1e-3 at width 64, 5e-4 at 128


def train(model, pairs: list[int], plan: Plan, report: Callable[[int, float], None] | None = None,
          lr: float = 1e-3, data: Callable = mqar) -> Trained:
    """Train on fresh MQAR batches, the pair counts taking turns a step each, until every count's validation
    accuracy reaches plan.target or their mean plateaus; lr is the peak rate. `data` draws every batch (training,
    validation and test) with mqar's signature, (n, seq, pairs, seed) -> tokens, targets: another task's data
    (benchmarks/recall_elimination.py's) trains through the same loop."""
    import torch
    import torch.nn.functional as F

    started = time.time()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=plan.weight_decay,
                            betas=(0.9, 0.98))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: _lr_factor(s, plan))
    val = {n: data(plan.val, plan.seq, n, seed=_seed(plan.seed, "val", n)) for n in pairs}
    curve, stopped, step = [], "max steps", 0
    for step in range(1, plan.max_steps + 1):
        n = pairs[step % len(pairs)]
        tokens, targets = data(plan.batch, plan.seq, n, seed=_seed(plan.seed, "train", n, step))
        logits = model(tokens)  # (B, seq, V)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % plan.eval_every:
            continue
        model.eval()
        accs = [accuracy(model, *val[n]) for n in pairs]
        model.train()
        curve.append((step, round(sum(accs) / len(accs), 4)))
        if report:
            report(step, curve[-1][1])
        if min(accs) >= plan.target:
            stopped = "target"
            break
        if plateaued(curve, plan, pairs):
            stopped = "plateau"
            break
    model.eval()
    test = {n: accuracy(model, *data(plan.test, plan.seq, n, seed=_seed(plan.seed, "test", n))) for n in pairs}
    return Trained(test, step, stopped, time.time() - started, curve)


def plateaued(curve: list[tuple[int, float]], plan: Plan, pairs: list[int]) -> bool:
    """True when training should stop early: the last `patience` evaluations gained under 1 point over the best
    before them, at least min_share of max_steps has run, and the best is past guessing (past_guessing). The rule
    before this one (patience alone) stopped Mamba and Mamba-2 at step 300 while still at chance."""
    if len(curve) <= plan.patience or curve[-1][0] < plan.min_share * plan.max_steps:
        return False
    before = max(a for _, a in curve[:-plan.patience])
    best = max(before, *(a for _, a in curve[-plan.patience:]))
    return best < before + 0.01 and past_guessing(best, pairs, plan)


def past_guessing(accuracy: float, pairs: list[int], plan: Plan) -> bool:
    """Whether a mean accuracy over `pairs` is plan.margin above guessing one of the N values in the sequence (1/N,
    averaged): models sit at that level before the lookup forms."""
    return accuracy >= sum(1 / n for n in pairs) / len(pairs) + plan.margin


def _lr_factor(step: int, plan: Plan) -> float:
    if step < plan.warmup:
        return (step + 1) / plan.warmup
    span = max(1, plan.max_steps - plan.warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, (step - plan.warmup) / span)))


def _seed(base: int, what: str, *parts: int) -> int:
    """A seed per (base, what, parts): train, val and test never share sequences."""
    text = ":".join([str(base), what, *map(str, parts)])
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:7], "big")


# -- the grid, cached -----------------------------------------------------------------------------------------

def cache_dir() -> Path:
    """kvwall's home (kvwall.files.home: ~/.cache/kvwall) / recall: one JSON file per trained configuration."""
    from kvwall.files import home

    return home() / "recall"


def _key(arch: Arch, width: int, pairs: list[int], plan: Plan) -> str:
    """The configuration a model belongs to: architecture, width, the pairs it trains on, its learning rate, the
    whole plan and VERSION."""
    text = json.dumps([VERSION, arch.name, width, sorted(pairs), rate(arch, width, plan), asdict(plan)],
                      sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def models(archs: list[Arch], widths: list[int]) -> list[tuple[Arch, int]]:
    """The models a grid trains: one per architecture and width, on the mixture of its pair counts."""
    return [(a, w) for a in archs for w in widths]


def check(archs: list[Arch], widths: list[int], pairs: list[int], plan: Plan) -> None:
    """Every problem before any training: widths, pairs that fit the sequence, windows below it."""
    for w in widths:
        check_width(w)
    for n in pairs:
        if not 1 <= n <= max_pairs(plan.seq):
            raise KvwallError(f"--pairs {n} does not fit --seq {plan.seq} (at most {max_pairs(plan.seq)}: each pair "
                              "takes 4 tokens, itself and its query); lower --pairs or raise --seq")
    for a in archs:
        if a.window is not None and a.window >= plan.seq:
            raise KvwallError(f"--archs {a.name}: the window is not below --seq {plan.seq}, so it never slides; "
                              "pick a smaller window")


def one(arch: Arch, width: int, pairs: list[int], plan: Plan,
        report: Callable[[int, float], None] | None = None) -> list[dict]:
    """Train one model on the mixture of `pairs` and evaluate it at each: a row per pair count with its accuracy,
    and the parameters, kept bytes and how training went (the same in every row).

    Whether attention's lookup forms within the budget depends on the seed: width 64, 2,000 steps, seeds 1 and 2
    learned it at steps 700 and 900 (99.7-99.9 %), seed 0 stayed at guessing (and did in six more tries with
    other rates, batch, warm-up, weight decay or head width). So a model whose mean validation accuracy never got
    `margin` past guessing one of the N values trains again from the next seed, up to plan.attempts in all; the
    row says which seed it kept and the seconds of every attempt."""
    import torch

    spec = model_spec(arch, width, plan.seq)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: at width 64, 128 tokens, a step took 1.49 s on 2 threads and
    try:  # 0.086 s on 1 (2 cores shared, load 5: threads that wait on each other); results are the same
        seconds = 0.0
        for attempt in range(plan.attempts):
            tried = replace(plan, seed=plan.seed + attempt)
            model = build(spec, tried.seed)
            with torch.random.fork_rng():
                done = train(model, pairs, tried, report, rate(arch, width, plan))
            seconds += done.seconds
            if past_guessing(max(a for _, a in done.curve or [(0, 0.0)]), pairs, plan):
                break
    finally:
        torch.set_num_threads(threads)
    n_params = sum(p.numel() for p in model.parameters())
    assert n_params == spec.params(), (n_params, spec.params())  # the spec describes the model that trained
    return [{"arch": arch.name, "kind": arch.kind, "window": arch.window, "width": width, "pairs": n,
             "seq": plan.seq, "accuracy": round(done.accuracy[n], 4), "params": n_params, "lr": rate(arch, width, plan),
             **kept_bytes(spec, plan.seq), "trained_on": sorted(pairs), "seed": tried.seed, "attempts": attempt + 1,
             "steps": done.steps, "stopped": done.stopped, "train_seconds": round(seconds, 1), "curve": done.curve,
             "layers": [layer.describe() for layer in spec.layers]} for n in pairs]


def run(archs: list[Arch], widths: list[int], pairs: list[int], plan: Plan, *, cache: Path | None = None,
        retrain: bool = False, jobs: int = 1, on_start: Callable[[str, int], None] | None = None,
        on_eval: Callable[[str, int, float], None] | None = None,
        on_done: Callable[[str, list[dict]], None] | None = None) -> dict:
    """Every (arch, width): its cached rows when this exact configuration (pairs included) has run before, else
    trained now (and cached), on `jobs` processes at once (each trains on one thread, so its rows equal a run on
    one process). Callbacks drive the command's progress bar: on_start(label, index), on_eval(label, step, mean
    validation accuracy), on_done(label, rows)."""
    check(archs, widths, pairs, plan)
    cache = cache or cache_dir()
    started, got, todo = time.time(), {}, []
    for i, (arch, width) in enumerate(models(archs, widths)):
        label, path = f"{arch.name} w{width}", cache / f"{_key(arch, width, pairs, plan)}.json"
        rows = None if retrain else _load(path, arch, width, pairs, plan, "training it again")
        if rows is None:
            todo.append((i, arch, width, label, path))
            continue
        got[i] = [dict(r, cached=True) for r in rows]
        if on_done:
            on_done(label, rows)

    def finished(i, label, path, rows):
        _write(path, rows)
        got[i] = [dict(r, cached=False) for r in rows]
        if on_done:
            on_done(label, rows)

    if jobs > 1 and len(todo) > 1:
        _run_parallel(todo, pairs, plan, min(jobs, len(todo)), on_start, on_eval, finished)
    else:
        for i, arch, width, label, path in todo:
            if on_start:
                on_start(label, i)
            report = (lambda s, a, label=label: on_eval(label, s, a)) if on_eval else None
            finished(i, label, path, one(arch, width, pairs, plan, report))
    rows = [r for i in sorted(got) for r in got[i]]
    return dict(_result(plan, rows, len(todo), time.time() - started, cache), jobs=min(jobs, max(len(todo), 1)))


def _run_parallel(todo: list, pairs: list[int], plan: Plan, jobs: int, on_start, on_eval, finished) -> None:
    """Train `todo`'s models on `jobs` worker processes (spawned: a forked torch may hang on its thread pool),
    longest first by KINDS' cost so that the last to start are short; training progress comes back through a
    queue. A worker's error, or Ctrl-C, stops every worker at once (Pool.terminate); finished models stay cached."""
    import multiprocessing as mp
    import queue as queues

    ctx = mp.get_context("spawn")
    events = ctx.Queue()
    order = sorted(todo, key=lambda t: -KINDS[t[1].kind].cost * t[2] / RATE_WIDTH)
    pool = ctx.Pool(jobs, initializer=_worker_init, initargs=(events,))
    try:
        running = {pool.apply_async(_worker_train, (i, arch, width, pairs, plan, label)): (i, label, path)
                   for i, arch, width, label, path in order}
        while running:
            try:
                kind, label, *rest = events.get(timeout=0.2)
                if kind == "start" and on_start:
                    on_start(label, rest[0])
                elif kind == "eval" and on_eval:
                    on_eval(label, *rest)
            except queues.Empty:
                pass
            for res in [r for r in running if r.ready()]:
                i, label, path = running.pop(res)
                finished(i, label, path, res.get())  # a worker's exception re-raises here
        pool.close()
    finally:
        pool.terminate()
        pool.join()


_EVENTS = None  # a worker process's queue back to run()


def _worker_init(events) -> None:
    import signal

    global _EVENTS
    _EVENTS = events
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle: it terminates the pool


def _worker_train(i: int, arch: Arch, width: int, pairs: list[int], plan: Plan, label: str) -> list[dict]:
    _EVENTS.put(("start", label, i))
    return one(arch, width, pairs, plan, lambda step, acc: _EVENTS.put(("eval", label, step, acc)))


def cached(archs: list[Arch], widths: list[int], pairs: list[int], plan: Plan,
           cache: Path | None = None) -> dict | None:
    """run()'s result from the cache alone, training nothing (kvwall report); None when any model of the grid has
    no cached result, or a damaged one (a warning names it: _load)."""
    cache = cache or cache_dir()
    then = "the report leaves recall out until `kvwall recall` trains it again"
    got = [_load(cache / f"{_key(a, w, pairs, plan)}.json", a, w, pairs, plan, then) for a, w in models(archs, widths)]
    if any(g is None for g in got):
        return None
    return _result(plan, [dict(r, cached=True) for g in got for r in g], 0, 0.0, cache)


def _result(plan: Plan, rows: list[dict], trained: int, seconds: float, cache: Path) -> dict:
    """Rows ordered by pairs, then architecture and width (the table's and plot's order); `trained` and `cached`
    count models."""
    rows = sorted(rows, key=lambda r: r["pairs"])  # stable: models keep their order within a pair count
    models_ = len({(r["arch"], r["width"]) for r in rows})
    return {"task": task_dict(plan), "plan": asdict(plan), "results": rows, "trained": trained,
            "cached": models_ - trained, "seconds": round(seconds, 1), "cache": str(cache)}


def task_dict(plan: Plan) -> dict:
    return {"name": "MQAR (Zoology, Arora et al. 2023)", "seq": plan.seq, "keys": KEYS, "values": VALUES,
            "vocab": VOCAB, "chance": 1 / VALUES, "kept_bytes_format": "fp32"}


STOPS = ("target", "plateau", "max steps")  # Trained.stopped's values


def _load(path: Path, arch: Arch, width: int, pairs: list[int], plan: Plan, then: str) -> list[dict] | None:
    """The cached rows of (arch, width, pairs, plan)'s model, or None: not trained yet (no file), or a file that
    cannot stand for that model (unreadable, not JSON, or _problem's), said in one warning line ending in `then`,
    what happens instead. A damaged cache is never printed (issue #38: 750 % accuracy, another model's rows)."""
    try:
        rows = json.loads(path.read_bytes())
    except FileNotFoundError:
        return None
    except OSError as exc:
        problem = f"unreadable ({exc.strerror})"
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError; RecursionError: nesting too deep
        problem = "not valid JSON"
    else:
        problem = _problem(rows, arch, width, pairs, plan)
    if problem is None:
        return rows
    _warn(f"ignoring the cached recall result {path} for {arch.name} w{width}: {problem}; {then}")
    return None


def _problem(rows, arch: Arch, width: int, pairs: list[int], plan: Plan) -> str | None:
    """Why cached rows cannot be (arch, width, pairs, plan)'s, or None when they can. Wanted: one row per pair count;
    in each, what one() writes for this configuration (name, width, tokens, mixture, rate, and the parameters and
    kept bytes its spec gives now), and results of the right type and range (accuracy a finite number in [0, 1],
    steps and attempts within the plan's, the seed of that attempt, seconds >= 0)."""
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        return "not a list of rows"
    got = [r.get("pairs") for r in rows]
    if not all(type(n) is int for n in got) or sorted(got) != sorted(pairs):
        return f"rows for pairs {_shown(got)}, expected one row each for {sorted(pairs)}"
    spec = model_spec(arch, width, plan.seq)
    same = {"arch": arch.name, "kind": arch.kind, "window": arch.window, "width": width, "seq": plan.seq,
            "trained_on": sorted(pairs), "lr": rate(arch, width, plan), "params": spec.params(),
            **kept_bytes(spec, plan.seq)}
    for r in rows:
        for name, want in same.items():  # compared as JSON: 4.0 is not 4, true is not 1
            if json.dumps(r.get(name)) != json.dumps(want):
                return f"{name} {_shown(r.get(name))}, expected {want!r} for this model"
        if not _real(r.get("accuracy")) or not 0 <= r["accuracy"] <= 1:
            return f"accuracy {_shown(r.get('accuracy'))} is not a number from 0 to 1"
        if type(r.get("steps")) is not int or not 1 <= r["steps"] <= plan.max_steps:
            return f"steps {_shown(r.get('steps'))} is not a whole number from 1 to {plan.max_steps}"
        if r.get("stopped") not in STOPS:
            return f"stopped {_shown(r.get('stopped'))} is not one of {', '.join(STOPS)}"
        if type(r.get("attempts")) is not int or not 1 <= r["attempts"] <= plan.attempts:
            return f"attempts {_shown(r.get('attempts'))} is not a whole number from 1 to {plan.attempts}"
        if json.dumps(r.get("seed")) != json.dumps(plan.seed + r["attempts"] - 1):
            return f"seed {_shown(r.get('seed'))} is not the seed of attempt {r['attempts']}"
        if not _real(r.get("train_seconds")) or r["train_seconds"] < 0:
            return f"train_seconds {_shown(r.get('train_seconds'))} is not a number of seconds"
        if not isinstance(r.get("curve"), list) or not isinstance(r.get("layers"), list):
            return "a row without its training curve or layers"
    return None


def _real(x) -> bool:
    """A finite JSON number (not a bool: True is an int to Python)."""
    return type(x) in (int, float) and math.isfinite(x)


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _warn(text: str) -> None:
    import sys

    print(f"kvwall: warning: {text}", file=sys.stderr)


def _write(path: Path, rows: list[dict]) -> None:
    from kvwall.files import write_text

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text(path, json.dumps(rows, indent=1))
    except OSError as exc:  # a read-only home: the result still prints, it is just not kept
        _warn(f"could not cache a recall result in {path.parent} ({exc.strerror})")


# -- the grid `kvwall recall` trains by default (its options' defaults) --------------------------------------

# Defaults sized for 2 shared CPU cores (30 minutes for the grid): 12 models, one per architecture and width,
# each on the mixture of 4, 8 and 16 pairs. A training step (batch 32, width 64, one thread, 2 busy cores) at
# 128 / 256 tokens: attention 0.082 / 0.208 s, Mamba 0.099 / 0.220 s (0.83 s at 128 before its C++ training scan),
# hybrid 0.101 / 0.218 s, Mamba-2 0.253 / 0.479 s; the 256 tokens would leave a few hundred steps per
# model, and attention's lookup formed only after about 700 steps at 64 tokens. A window of 8 sees the last 3
# queries and their values: the pairs only from the first few queries.
DEFAULTS = dict(archs="attention,sliding:8,mamba,mamba2,hybrid,gated_deltanet", widths="64,128", pairs="4,8,16", seq=64,
                steps=1000)
# --quick: the grid's ordering in a few minutes. The first quick mode (16 tokens, 500 steps) left attention and
# sliding:4 at guessing (26 %) below Mamba while the hybrid reached 99 % (issue #39): 4 pairs leave 4 queries in 16
# tokens, and attention's lookup formed only by step 800-950 (width 64, seeds 0 and 1, 1,000-1,500-step plans; a
# 700-step plan's decay left it at 44 %; peak 2e-3 and 3e-3 never formed it). At 32 tokens a sequence asks 12
# queries and the lookup formed by step 350-450: 98.7-99.6 % after 600 steps for seeds 0-3. The quick grid
# (2026-12-05, 2 cores under load 3-4): attention 98.8 %, sliding:4 40.1 %, Mamba 9.0 %, Mamba-2 96.3 %, hybrid
# 99.7 %; 223 s wall and 123 s CPU on one process (--jobs 1), against 92 s and 79 s for the first quick mode run
# just after it; 145 s wall on the default 2 processes. Mamba (two attempts) and Mamba-2 take 2/3 of it.
QUICK = dict(archs="attention,sliding:4,mamba,mamba2,hybrid,gated_deltanet", widths="64", pairs="4", seq=32, steps=600)


def request(c: dict, seed: int = 0):
    """Choices (DEFAULTS' keys) -> the archs, widths, pairs and training plan of the grid, checked (one-line errors).
    `kvwall recall` and the report (the default grid's cached results) both read the grid through this."""
    archs = parse_archs(c["archs"], c["seq"])
    widths = parse_int_list(c["widths"], "--widths")
    pairs = sorted(set(parse_int_list(c["pairs"], "--pairs")))  # one model trains on them all: order them once
    plan = Plan(seq=c["seq"], max_steps=c["steps"], seed=seed)
    check(archs, widths, pairs, plan)
    return archs, widths, pairs, plan
