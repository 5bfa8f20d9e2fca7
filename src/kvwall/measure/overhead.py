"""The engine's cost on this machine that a count of bytes and FLOPs does not show, and the rates its kernels reach.

A roofline counts bytes and FLOPs; on a CPU (and on a GPU without CUDA graphs) every op also pays a
fixed dispatch cost, and the small ops around the big ones (norms, rotary, residual adds, an SSM's
elementwise state update, copies) each take tens of microseconds at real widths that no byte count
shows (Mamba's decode step here: 3.6 ms of addcmul and 2.9 ms of exp over 24 layers, on states of
98 KB). We measure what the op model leaves out, per kind of block, where it lives: decode steps of
2- and 10-block models (DEPTHS) of width 768 (the blocks `kvwall bench` compares, a 128-token vocabulary). The
slope of step time over depth less the op model's time of one block is the per-layer cost, the
intercept less the model's rest the per-step cost. Each is the median step, the figure `kvwall bench`
holds predictions against.
"""

from __future__ import annotations

import dataclasses
import time

OVERHEAD_ARCHS = {"attention": "gqa", "latent": "mla", "mamba": "mamba", "mamba2": "mamba2"}  # kind -> block
DEPTHS = (2, 10)


def _arch_spec(arch: str, layers: int):
    from kvwall.measure.archs import ARCHS
    from kvwall.spec.hf import spec_from_config

    config = dict(ARCHS[arch].config, vocab_size=128, num_hidden_layers=layers)
    return spec_from_config(config, name=f"{arch}-{layers}")


def _decoder(spec, context: int = 64, weights=None, fused: bool = True):
    """A decode step of `spec` (random weights; projections packed to Format `weights` when given) after a
    `context`-token prefill, through the fused decode stack where it takes the model (fused=False: layer by layer,
    as the engine runs a prefill chunk or a mixed step): call it with a step index."""
    import torch

    from kvwall.engine.caches import make_cache
    from kvwall.engine.layers.packed import pack_model
    from kvwall.engine.model import Transformer

    torch.manual_seed(0)
    model = Transformer(spec).eval()
    if weights is not None:
        pack_model(model, weights)
    model.prepack()  # float projections as a loaded model holds them (oneDNN's layout where it runs)
    model.stack = None if fused else False  # False: no fused decode stack (engine/decode_stack.py)
    cache = make_cache("contiguous", spec, 1, context + 1024)
    with torch.inference_mode():
        model(torch.ones(1, context, dtype=torch.long), torch.arange(context)[None], cache)

    def step(i: int) -> None:
        with torch.inference_mode():
            model(torch.ones(1, 1, dtype=torch.long), torch.tensor([[context + i]]), cache)
    return step


def _median_step(step, start: int, steps: int) -> float:
    """Median of `steps` timed steps after 4 warm-up ones, as `kvwall bench` reports (the fastest was 5-10 %
    below the median)."""
    times = []
    for i in range(start, start + steps + 4):
        t0 = time.perf_counter()
        step(i)
        if i >= start + 4:
            times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def _step_time(spec, steps: int, context: int = 64) -> float:
    """Median decode step of `spec` (random weights) after a `context`-token prefill."""
    return _median_step(_decoder(spec, context), 0, steps)


ROUNDS = 3  # depth pairs timed in turn; the median round's slope is kept


def _rounds(step_lo, step_hi, steps: int) -> tuple[float, float]:
    """(2-block, 10-block) median steps of the median round by slope, of ROUNDS rounds timed in turn, each step
    after 4 warm-up ones."""
    rounds = [(_median_step(step_lo, r * (steps + 4), steps), _median_step(step_hi, r * (steps + 4), steps))
              for r in range(ROUNDS)]
    return sorted(rounds, key=lambda t: t[1] - t[0])[ROUNDS // 2]


PAIRED_ROUNDS = 5  # rounds of (1-row matmul rate, 2- and 10-block decode steps) timed back to back


def _bare(rates, rate: float | None = None, fixed: float | None = None):
    """The op model on `rates` without its overheads (what the steps' time is held against), with the 1-row
    matmul rate and cost per call replaced where given."""
    from kvwall.predict.roofline import Roof
    from kvwall.predict.step import MATMUL

    rows, per_call = dict(rates.matmul_rows), dict(rates.op_fixed_s)
    if rate is not None:
        rows[1], per_call[MATMUL] = rate, fixed
    return Roof(dataclasses.replace(rates, layer_overhead_s=0.0, mixer_overhead_s={}, step_overhead_s=0.0,
                                    packed_overhead_s={}, matmul_rows=rows, op_fixed_s=per_call), dtype="fp32")


def paired_round(rates, specs, fm, sets, nbytes: list[int], toys, start: int, steps: int) -> tuple:
    """One round: the 1-row matmul rate and cost per call over `sets` (cold copies of MATMUL_SHAPES, `nbytes`
    each), then the decode steps of the 2- and 10-block `specs` (`toys`: their step functions, from index
    `start`); -> (per-block cost, per-step rest, rate, cost per call, the 10- less the 2-block step), the costs
    being the steps less the op model at this round's own rate."""
    import torch

    from kvwall.predict.roofline import decode

    lo, hi = DEPTHS
    with torch.inference_mode():
        rows, fixed = _rates_and_fixed(sets, nbytes, (1,), 3)
    p_lo, p_hi = (decode(s, 64 + 1, 1, fm, _bare(rates, rows[1], fixed)).time_s for s in specs)
    t_lo, t_hi = (_median_step(f, start, steps) for f in toys)
    per_block = ((t_hi - t_lo) - (p_hi - p_lo)) / (hi - lo)
    return per_block, t_lo - p_lo - lo * max(per_block, 0.0), rows[1], fixed, t_hi - t_lo


def _paired_rounds(rates, specs, fm, steps: int, total_bytes: int) -> tuple[float, float, float, float, float]:
    """paired_round's figures of the median of PAIRED_ROUNDS rounds by per-block cost. The per-block cost is a
    difference of slopes, so a rate read at another moment than the steps lands in it whole: measured a minute
    apart, a fast 1-row reading (28.5 GB/s) beside slow steps gave 0.93 ms per block, and the profile put SmolLM2's
    decode step 19-43 % slow for the next 20 minutes, where rounds that pair the two, on the same host in the same
    minutes, read 0-0.35 ms and came within -14 ... +9 % of its measured step (2026-12-04 18:29-18:50;
    benchmarks/calibrate_pairing.py)."""
    sets, nbytes = matmul_sets(total_bytes)
    toys = [_decoder(s) for s in specs]
    rounds = [paired_round(rates, specs, fm, sets, nbytes, toys, r * (steps + 4), steps) for r in range(PAIRED_ROUNDS)]
    return sorted(rounds)[PAIRED_ROUNDS // 2]


def engine_overheads(rates, steps: int = 30, total_bytes: int = 128 << 20) -> tuple[dict[str, float], dict]:
    """Per-layer cost by kind of block beyond the op model on device `rates` (this machine's measured op
    rates, its overheads ignored), and the per-step rest ("step", from the attention models); and the 1-row
    matmul rate and cost per call the attention blocks' cost was paired with ({"rate", "fixed"}: the profile keeps
    them, _paired_rounds says why). The other kinds' two depths are timed in turn, ROUNDS times: one pair's slope
    moved 0.57-1.0 ms per layer between runs a minute apart (2 cores, 30 steps of 4-11 ms); the median round's is
    kept. Attention blocks run through the fused decode stack, as a decode step of such a model does; "unfused" is
    what an attention block costs more layer by layer (a prefill chunk, a mixed step: 0.13 ms on SmolLM2's fp32
    blocks side by side, 2026-12-03)."""
    from kvwall.predict.memory import Formats
    from kvwall.predict.roofline import decode
    from kvwall.spec.formats import get_format

    fp32 = get_format("fp32")
    fm = Formats(fp32, fp32, fp32)
    (lo, hi), out = DEPTHS, {}
    specs = [_arch_spec(OVERHEAD_ARCHS["attention"], n) for n in DEPTHS]
    block, rest, rate, fixed, slope = _paired_rounds(rates, specs, fm, steps, total_bytes)
    out["attention"], out["step"] = max(block, 0.0), max(rest, 0.0)
    u_lo, u_hi = _rounds(*(_decoder(s, fused=False) for s in specs), steps)
    out["unfused"] = max(((u_hi - u_lo) - slope) / (hi - lo), 0.0)
    bare = _bare(rates, rate, fixed)
    for kind, arch in OVERHEAD_ARCHS.items():
        if kind == "attention":
            continue
        specs = [_arch_spec(arch, n) for n in DEPTHS]
        p_lo, p_hi = (decode(s, 64 + 1, 1, fm, bare).time_s for s in specs)
        t_lo, t_hi = _rounds(*(_decoder(s) for s in specs), steps)
        out[kind] = max(((t_hi - t_lo) - (p_hi - p_lo)) / (hi - lo), 0.0)
    return out, {"rate": rate, "fixed": fixed}


# -- achievable bandwidth of the two kinds of traffic a decode step makes --------------------------
#
# A decode step streams weights through matrix-vector products and the KV cache through attention.
# On a CPU neither reaches the plain streaming-read figure (small per-op work, thread sync, the
# attention kernel's own arithmetic), so `--device local` times each kind of op at the bandwidth the
# engine's own kernels reach on cold data, measured here. Both use buffers far larger than the caches.

def _fastest_time(fn, runs: int) -> float:
    """The fastest of `runs` timed runs after one warm-up: what the kernels can reach (another process on
    the machine only ever slows a run down, never speeds it up)."""
    times = []
    for i in range(runs + 1):
        t0 = time.perf_counter()
        fn()
        if i:
            times.append(time.perf_counter() - t0)
    return min(times)


ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # matmul row counts measured: decode batches up to prefill chunks


MATMUL_SHAPES = ((3072, 768), (768, 768))  # (out, in): two sizes, for a rate (the slope) and a cost per call


def matmul_rows_bandwidth(total_bytes: int = 512 << 20, runs: int = 3) -> tuple[dict[int, float], float]:
    """({rows: weight bytes/s}, fixed seconds per call) of the engine's fp32 projection as a loaded model holds it
    (engine.model.fast_projection: oneDNN's layout where it runs, else F.linear over a column-major weight) at
    each row count in ROWS, over distinct cold matrices of two MATMUL_SHAPES: time = fixed + bytes / rate, the
    fixed cost from 1 row. Not one bandwidth and one FLOP rate: torch's F.linear here read weights at 21 GB/s
    for 1 row, 13 at 2 and 6.6-7.8 from 4 to 16 rows (the same FLOPs per byte as numpy's OpenBLAS, which kept
    11-34); oneDNN's layout reads them 1.3-3.8x faster at 16 rows (benchmarks/bench_packed_linear.py). Not one
    rate at one shape either: SmolLM2's batch-1 projections took 82 / 107 / 147 / 253 / 3,440 us for 1.3 / 2.2
    / 3.5 / 7.1 / 113 MB (benchmarks/profile_serve_step.py), 42 us + bytes / 33.6 GB/s within 2 % each, where
    the 3072 x 768 rate alone (29 GB/s) put its four 576-wide projections 17 % fast."""
    import torch

    with torch.inference_mode():
        return _rates_and_fixed(*matmul_sets(total_bytes), ROWS, runs)


SWEEPS = 2  # passes over the row counts; each point keeps its fastest


def _rates_and_fixed(sets: list[list], nbytes: list[int], rows: tuple[int, ...], runs: int) -> tuple[dict, float]:
    """({rows: bytes/s}, fixed seconds per call) of time = fixed + bytes / rate through the two matrix sizes (`sets`
    of cold copies, `nbytes` each) at each row count, the fixed cost from the first; the larger size's own rate
    (and no fixed cost) where two points give no line. Each point is the fastest of SWEEPS passes over all the
    row counts: one row count's timing lasts tens of ms, so a busy spell can cover all its runs (beside another
    process, 2026-12-04, 1 row read 1.2 GB/s and 2 rows 20), and a pass seconds later rarely meets the same one."""
    best: dict[tuple[int, int], float] = {}
    for _ in range(SWEEPS):
        for m in rows:
            for i, (mats, b) in enumerate(zip(sets, nbytes)):
                best[m, i] = min(best.get((m, i), float("inf")), _call_time(mats, m, runs, b)[1])
    rates, fixed = {}, 0.0
    for m in rows:
        points = [(b, best[m, i]) for i, b in enumerate(nbytes)]  # (bytes, seconds) per size
        fit = line_fit(points)
        big_bytes, big_s = max(points)
        rates[m] = fit[0] if fit else big_bytes / big_s
        if m == rows[0]:
            fixed = fit[1] if fit else 0.0
    return rates, fixed


def matmul_sets(total_bytes: int) -> tuple[list[list], list[int]]:
    """(per MATMUL_SHAPES shape: cold fp32 copies together about `total_bytes`, and one copy's weight bytes)."""
    return ([_float_copies(shape, total_bytes) for shape in MATMUL_SHAPES],
            [out * n_in * 4 for out, n_in in MATMUL_SHAPES])


def _float_copies(shape: tuple[int, int], total_bytes: int) -> list:
    """Distinct fp32 projections of `shape` (out, in) as the engine holds them, together about `total_bytes`."""
    import torch
    from torch import nn

    from kvwall.engine.model import fast_projection

    w0, mats = torch.randn(*shape), []  # (out, in)
    for _ in range(max(2, total_bytes // (shape[0] * shape[1] * 4))):
        lin = nn.Linear(shape[1], shape[0], bias=False, device="meta")
        lin.weight = nn.Parameter(w0.clone(), requires_grad=False)  # distinct memory, cold when called in turn
        mats.append(fast_projection(lin, onednn=True))
    return mats


def _call_time(mats: list, rows: int, runs: int, nbytes: int) -> tuple[int, float]:
    """(bytes per matrix, seconds per call) of `rows` rows through each of `mats` in turn, the fastest sweep."""
    import torch

    x = torch.randn(1, rows, mats[0].in_features)  # (B, T, in)
    return nbytes, _fastest_time(lambda: [lin(x) for lin in mats], runs) / len(mats)  # (1, rows, out) each


PACKED_ROWS = (1, 16)  # the decode batches kvwall bench and bench_real_decode time
PACKED_FORMATS = ("int4", "int8:g32")  # one format timed per packed kernel (kvwall.predict.step.matmul_kernel)
PACKED_SHAPES = MATMUL_SHAPES  # the packed kernels' rate and cost per call, fitted as the fp32 one's


def _packed_copies(fmt, shape: tuple[int, int], total_bytes: int) -> list:
    """Distinct PackedLinear matrices of `shape` in `fmt`, together about `total_bytes` (cold when called in turn)."""
    import torch

    from kvwall.engine.layers.packed import PackedLinear

    one = PackedLinear.from_linear(torch.nn.Linear(shape[1], shape[0], bias=False), fmt)
    n = max(2, total_bytes // one.weight_bytes())
    return [one] + [PackedLinear(one.q.clone(), one.scale.clone(), None if one.zero is None else one.zero.clone(),
                                 fmt, shape[1]) for _ in range(n - 1)]


class StackCall:
    """A projection called as the fused decode step calls it: its kernel's Proj, from C++ (engine/decode_stack.py)."""

    def __init__(self, proj, in_features: int):
        self.proj, self.in_features = proj, in_features

    def __call__(self, x):  # (B, T, K) -> (B T, N)
        return self.proj(x.reshape(-1, self.in_features))


def stack_call(lin):
    """`lin` as the fused decode step calls it (StackCall), or `lin` itself when the stack's kernel does not build."""
    from kvwall.engine.decode_stack import kernel_module, proj

    mod = kernel_module()
    return lin if mod is None else StackCall(proj(mod, lin), lin.in_features)


LINE_RATE_MAX = 10.0  # the most a line's rate may exceed the larger point's own bytes / seconds (see line_fit)


def line_fit(points: list[tuple[float, float]]) -> tuple[float, float] | None:
    """(bytes/s, fixed seconds) of time = fixed + bytes / rate through two (bytes, seconds) points; None when they
    give no positive slope and intercept (a busy spell timed the small one slow), or a rate over LINE_RATE_MAX
    times the larger point's own: two times a hair apart make a near-flat line (under load on 2026-12-07 a README
    `kvwall report` fitted 2.3e14 B/s at 64 rows and then refused its own profile; an honest line's rate was
    1.2-2.1x its points' own in the measurements overhead.py cites)."""
    (b0, t0), (b1, t1) = sorted(points)
    if t1 <= t0:
        return None
    rate = (b1 - b0) / (t1 - t0)
    fixed = t0 - b0 / rate
    return (rate, fixed) if fixed >= 0 and rate <= LINE_RATE_MAX * b1 / t1 else None


def packed_rates(total_bytes: int = 128 << 20, runs: int = 3) -> tuple[dict, dict]:
    """Per packed kernel ("matmul:int4", "matmul:int8"): ({rows: packed weight bytes/s}, fixed seconds per call) of
    the engine's PackedLinear (engine/layers/packed.py) over distinct cold matrices of two PACKED_SHAPES: time =
    fixed + bytes / rate at each of PACKED_ROWS rows, the fixed cost from 1 row (the kernel's setup, whatever
    the rows). One rate at 3072 x 768 alone folded that cost into the rate: SmolLM2's 576-wide projections at
    batch 1 took 21 us + bytes / 9.3 GB/s each (benchmarks/profile_step_ops.py), 43 us for o_proj's 207 KB.
    Each matrix is called as a decode step calls it: from C++ inside the fused decode stack (stack_call) where
    that builds, since the layers of every model it takes run there; PackedLinear's Python wrapper, which a
    layer-by-layer step also pays, cost 17 us a call more (2026-12-03), 2 ms of SmolLM2's 12 ms int4 step.
    Without the kernel: ({}, {}) (the reference path dequantizes the whole matrix)."""
    import torch

    from kvwall.engine.layers.packed import packed_kernel
    from kvwall.predict.step import matmul_kernel
    from kvwall.spec.formats import get_format

    if packed_kernel() is None:
        return {}, {}
    rates, fixed = {}, {}
    with torch.inference_mode():
        for name in PACKED_FORMATS:
            fmt = get_format(name)
            sets = [_packed_copies(fmt, shape, total_bytes) for shape in PACKED_SHAPES]
            calls = [[stack_call(lin) for lin in mats] for mats in sets]
            kernel = matmul_kernel(fmt)
            rates[kernel], fixed[kernel] = _rates_and_fixed(calls, [m[0].weight_bytes() for m in sets], PACKED_ROWS,
                                                            runs)
    return rates, fixed


def packed_layer_overheads(rates, steps: int = 30) -> dict[str, float]:
    """Per packed kernel ("matmul:int4", "matmul:int8"): the per-layer cost beyond the op model of a GQA block
    whose projections are packed (one PACKED_FORMATS format each), fitted as engine_overheads fits the fp32
    block (two depths timed in turn ROUNDS times, the median round's slope less the op model's), on device
    `rates` carrying the packed kernels' rates and fixed costs. The fp32 block's cost does not carry over:
    fitted on fp32 it was 1.0 ms per block, where SmolLM2's packed blocks spent 0.23 ms per block outside
    their projections and attention (benchmarks/profile_step_ops.py) and were predicted 62 % too slow."""
    from kvwall.predict.memory import Formats
    from kvwall.predict.roofline import decode
    from kvwall.predict.step import matmul_kernel
    from kvwall.spec.formats import get_format

    bare = _bare(rates)
    fp32, (lo, hi), out = get_format("fp32"), DEPTHS, {}
    specs = [_arch_spec(OVERHEAD_ARCHS["attention"], n) for n in DEPTHS]
    for name in PACKED_FORMATS:
        fmt = get_format(name)
        if matmul_kernel(fmt) not in rates.packed_rows:
            continue  # no kernel: the reference path runs, at no packed rate
        p_lo, p_hi = (decode(s, 64 + 1, 1, Formats(dataclasses.replace(fmt, head=fp32), fp32, fp32), bare).time_s
                      for s in specs)
        step_lo, step_hi = (_decoder(s, weights=fmt) for s in specs)
        t_lo, t_hi = _rounds(step_lo, step_hi, steps)
        out[matmul_kernel(fmt)] = max(((t_hi - t_lo) - (p_hi - p_lo)) / (hi - lo), 0.0)
    return out


DECODE_SHAPE = (4, 3, 64, 8192)  # KV heads, query heads per KV head, head dim, cached tokens: the bench's GQA layer


def _attention_time(hkv: int, total_bytes: int, runs: int) -> tuple[float, float, float]:
    """(seconds, cache bytes, FLOPs) of one decode attention call of 12 query heads of 64 over `hkv` KV heads
    of DECODE_SHAPE's context, through kvwall.engine.layers.attention.attend, over distinct cold caches."""
    import torch

    from kvwall.engine.layers.attention import attend

    _, _, d, s = DECODE_SHAPE
    heads = 12
    per = 2 * hkv * s * d * 4
    k0, v0 = torch.randn(1, hkv, s, d), torch.randn(1, hkv, s, d)  # (B, Hkv, S, D)
    # distinct memory, cold when swept in turn; copies, not fresh randn: 512 MiB of randn took 1.9 s here under
    # load 6, a clone of it 0.9 s (the same values do not change an fp32 kernel's time)
    caches = [(k0, v0)] + [(k0.clone(), v0.clone()) for _ in range(max(2, total_bytes // per) - 1)]
    q = torch.randn(1, heads, 1, d)  # (B, Hq, T, D)
    mask = torch.ones(1, 1, 1, s, dtype=torch.bool)

    def sweep():
        for k, v in caches:
            attend(q, k, v, mask, d ** -0.5, None)  # (B, Hq, 1, D)

    with torch.inference_mode():
        t = _fastest_time(sweep, runs) / len(caches)
    return t, per, 2 * heads * s * 2 * d  # the predictor's count: q.k and p.v per query head and key


def attention_rates(total_bytes: int = 512 << 20, runs: int = 5) -> tuple[float, float | None]:
    """(bytes/s, FLOP/s) of the engine's decode attention, from two calls with the same FLOPs and 12x apart
    in bytes: 12 KV heads (MHA) and 1 (MQA). time = bytes / B + FLOPs / F solved for B and F. (None for F,
    and the GQA call's plain bytes/s, when the two do not give positive rates: a busy machine.)"""
    t_mha, b_mha, flops = _attention_time(12, total_bytes, runs)
    t_mqa, b_mqa, _ = _attention_time(1, total_bytes, runs)
    if t_mha > t_mqa:
        bw = (b_mha - b_mqa) / (t_mha - t_mqa)
        compute = t_mqa - b_mqa / bw
        if compute > 0:
            return bw, flops / compute
    t3, b3, _ = _attention_time(4, total_bytes, runs)
    return b3 / t3, None


PREFILL_SHAPE = (4, 3, 64)  # KV heads, query heads per KV head, head dim: the bench's GQA layer
PREFILL_TOKENS = (128, 512, 2048)  # prompt lengths (query rows per sequence) its rate is measured at


def prefill_attention_rates(runs: int = 3) -> dict[int, float]:
    """{prompt tokens T: FLOP/s} of the engine's prefill attention (SDPA's causal kernel through attend_causal:
    T queries over the same T keys, the masked half skipped) at PREFILL_SHAPE and each of PREFILL_TOKENS,
    counted as the predictor counts it (q.k and p.v per query head per causal pair). Prefill attention is a
    blocked GEMM, far faster per FLOP than decode's matrix-vector attention: charged at the decode rate, 4k
    prefill was predicted 1.1-1.6x too slow. Not one rate either: here it reached 33-36 GFLOP/s at 128 tokens,
    41 at 512 and 75 at 2,048 (2026-12-04), so SmolLM2's 128-token prefill attention took 13 ms against 6.5
    predicted at the 2,048-token rate; nor a fixed cost per call plus one rate (a line through 256 and 2,048
    tokens put 128 tokens 2.5x too slow)."""
    import torch

    from kvwall.engine.layers.attention import attend_causal

    hkv, group, d = PREFILL_SHAPE
    out = {}
    for t in PREFILL_TOKENS:
        q = torch.randn(1, hkv * group, t, d)  # (B, Hq, T, D)
        k, v = torch.randn(1, hkv, t, d), torch.randn(1, hkv, t, d)  # (B, Hkv, T, D)
        with torch.inference_mode():
            s = _fastest_time(lambda q=q, k=k, v=v: attend_causal(q, k, v, d ** -0.5), runs)
        out[t] = 2 * hkv * group * 2 * d * (t * (t + 1) // 2) / s
    return out


LATENT_SHAPE = (12, 256, 32, 8192)  # heads, latent width, rope width, cached tokens: the bench's MLA layer


def latent_rate(bandwidth: float, total_bytes: int = 512 << 20, runs: int = 5) -> float | None:
    """FLOP/s of MLA's absorbed decode attention kernel (kernels/mla_decode.cpp) beyond streaming its latent
    cache at `bandwidth`: its 12 heads do 2 x 12 x (288 + 256) FLOPs per 1,152-byte cached token, so unlike
    attention it is compute-bound here. None when the kernel does not build (the torch path then runs)."""
    import torch

    from kvwall.engine.layers.latent_kernel import mla_decode

    kernel = mla_decode()
    if kernel is None:
        return None
    h, r, dr, s = LATENT_SHAPE
    per = s * (r + dr) * 4
    c0, pe0 = torch.randn(1, s, r), torch.randn(1, s, dr)  # (B, S, latent), (B, S, rope)
    caches = [(c0, pe0)] + [(c0.clone(), pe0.clone()) for _ in range(max(2, total_bytes // per) - 1)]
    q, k_pos, pos = torch.randn(1, h, r + dr), torch.arange(s)[None], torch.tensor([s - 1])
    with torch.inference_mode():
        t = _fastest_time(lambda: [kernel(q, c, pe, k_pos, pos, 0.1) for c, pe in caches], runs) / len(caches)
    compute = t - per / bandwidth
    return 2 * h * s * (r + dr + r) / compute if compute > 0 else None


QUANT_BUDGET_S = 6.0  # seconds one format's measurement may take


def _quantized_call(fmt: str, s: int, total_bytes: int, runs: int) -> tuple[float, float]:
    """(seconds, packed bytes incl. scales) of one decode step through a KIVI cache of this format (int8,
    int4, int2) holding `s` tokens in DECODE_SHAPE's heads: each sweep appends one token to every cache and
    attends over it as QuantizedCache does at decode (the C++ kernel where it builds)."""
    import torch

    from kvwall.engine.caches.quantized import QuantizedCache
    from kvwall.spec.formats import get_format
    from kvwall.spec.model import MLP, Attention, Layer, ModelSpec

    hkv, rep, d, _ = DECODE_SHAPE
    spec = ModelSpec("calibration", "llama", hkv * rep * d, 2, (Layer(Attention(hkv * rep, hkv, d, d), MLP(d)),))
    g = torch.Generator().manual_seed(0)
    keys, values = torch.randn(1, hkv, s, d, generator=g), torch.randn(1, hkv, s, d, generator=g)

    def filled():
        cache = QuantizedCache(spec, 1, s + runs + 2, get_format(fmt))
        cache.update(0, keys, values, torch.arange(s)[None])
        return cache

    q, k1, v1 = torch.randn(1, hkv * rep, 1, d), torch.randn(1, hkv, 1, d), torch.randn(1, hkv, 1, d)
    t0 = time.perf_counter()
    first = filled()
    with torch.inference_mode():
        first.attend(0, q, k1, v1, torch.tensor([[s]]), d ** -0.5, None, None)
    one_s = time.perf_counter() - t0  # filling one cache and one step over it
    # as many caches as fill the byte target, or as fit the time budget where the kernel is slow
    # (no AVX2: int2 ran at 0.2 GB/s and 512 MiB of caches took 178 s, measured)
    count = max(2, min(total_bytes // first.nbytes(), int(QUANT_BUDGET_S / ((runs + 2) * one_s))))
    caches = [filled() for _ in range(count)]
    step = {"pos": s}

    def sweep():
        pos = torch.tensor([[step["pos"]]])
        for cache in caches:
            cache.attend(0, q, k1, v1, pos, d ** -0.5, None, None)  # (1, Hq, 1, D)
        step["pos"] += 1

    with torch.inference_mode():
        return _fastest_time(sweep, runs) / count, first.nbytes()


def quantized_attention_rates(fmt: str, total_bytes: int = 512 << 20, runs: int = 5) -> tuple[float, float]:
    """(bytes/s, fixed seconds per call) of decode attention through a KIVI cache of this format: the slope
    and intercept of two contexts (2k and 8k tokens). One bytes/s at 8k alone folded the kernel's fixed
    cost per call into its bandwidth: int8 came out at 2.9 GB/s where the bench's decode steps, from 1k to
    32k, grew at 5.9 GB/s of cache (measured). A busy machine that gives no positive slope: 8k's plain rate."""
    t_lo, b_lo = _quantized_call(fmt, DECODE_SHAPE[3] // 4, total_bytes, runs)
    t_hi, b_hi = _quantized_call(fmt, DECODE_SHAPE[3], total_bytes, runs)
    if t_hi > t_lo and t_lo * b_hi > t_hi * b_lo:  # a slope and a positive intercept
        bw = (b_hi - b_lo) / (t_hi - t_lo)
        return bw, t_lo - b_lo / bw
    return b_hi / t_hi, 0.0


# -- the serving pool's own cost -------------------------------------------------------------------
#
# kvwall serve keeps K/V in a paged pool (serve.runner.ScheduledPages): every attention layer of every
# forward scatters the new tokens into their blocks and gathers each row's blocks into a (B, H, S, D)
# tensor for attention (aten::index, then a copy). The per-layer cost above is timed on a contiguous
# cache, which returns a slice, so it never sees this: SmolLM2's served batch-1 step took 72.4 ms
# over the pool against 55.5 over a contiguous cache, 0.56 ms per layer (benchmarks/profile_serve_step.py).

POOL_LAYERS = 8  # attention layers per timed forward: the per-forward block table and mask shared by them
POOL_BLOCK = 16  # tokens per block, kvwall serve's default
# (rows, tokens each) decode steps timed: 0.2-20 MB gathered per layer, SmolLM2's serving range (64 rows
# of 160 tokens: 16 MB); contexts off the block edge, so the runner's mask over padded slots is paid too
POOL_POINTS = ((1, 100), (1, 1000), (8, 300), (32, 300))


def _pool_pass(spec, rows: int, tokens: int, paged: bool):
    """One decode forward's cache work over every attention layer of `spec`: `rows` rows each holding `tokens`
    tokens once its new one is written, through the serving pool (or a contiguous cache)."""
    import torch

    from kvwall.engine.caches import make_cache
    from kvwall.serve.runner import make_pool

    a = spec.layers[0].mixer
    q = torch.randn(rows, a.n_q_heads, 1, a.head_dim)  # (B, Hq, 1, D)
    k, v = torch.randn(rows, a.n_kv_heads, 1, a.head_dim), torch.randn(rows, a.n_kv_heads, 1, a.v_head_dim)
    width = -(-tokens // POOL_BLOCK)
    if paged:
        cache = make_pool(spec, POOL_BLOCK, rows * width, torch.float32, "cpu")
        tables = [list(range(r * width, (r + 1) * width)) for r in range(rows)]
    else:
        cache = make_cache("contiguous", spec, rows, tokens + 1)

    def run() -> None:
        pos = torch.full((rows, 1), tokens - 1)  # (B, 1): a new object per pass, as a forward makes
        if paged:
            cache.plan(tables, [tokens] * rows)
        cache.step(pos)
        for layer in range(spec.n_layers):
            cache.attend(layer, q, k, v, pos, a.head_dim ** -0.5, None, None)  # (B, Hq, 1, Dv)
    return run


def paged_pool_cost(runs: int = 7) -> dict[str, float]:
    """{"fixed_s", "s_per_byte"}: what one attention layer pays per forward for the serving pool beyond a
    contiguous cache (the scatter, the gather of each row's blocks padded to the longest row, the mask),
    as fixed + bytes gathered x s/byte, fitted by least squares over the decode steps of POOL_POINTS
    (fastest of `runs` each; about 2 s in all). Bytes gathered = rows x the longest row's blocks x block
    tokens x one token's K and V in the layer. Measured here under the bench lock: 0.24 ms a layer beyond
    the contiguous cache at 0.2 MB gathered, 0.38 at 2 MB, 2.3 at 5 MB (8 rows), 5.0 at 20 MB (32 rows);
    73 ms at 67 MB (64 rows of 512, out of the last-level cache). A busy machine doubled single points."""
    import numpy as np
    import torch

    spec = _arch_spec("gqa", POOL_LAYERS)
    a = spec.layers[0].mixer
    per_token = a.n_kv_heads * (a.head_dim + a.v_head_dim) * 4  # fp32 K and V of one token in one layer
    x, y = [], []
    with torch.inference_mode():
        for rows, tokens in POOL_POINTS:
            paged, flat = (_fastest_time(_pool_pass(spec, rows, tokens, p), runs) for p in (True, False))
            x.append(rows * -(-tokens // POOL_BLOCK) * POOL_BLOCK * per_token)
            y.append((paged - flat) / spec.n_layers)
    slope, fixed = np.polyfit(x, y, 1)
    slope = max(float(slope), 0.0)
    fixed = max(float(np.mean(np.array(y) - slope * np.array(x))), 0.0) if fixed < 0 else float(fixed)
    return {"fixed_s": fixed, "s_per_byte": slope}


RUNNER_ROWS = (1, 32)  # decode rows a step of the runner is timed at (its cost grows with the rows: per-row Python)
RUNNER_DEPTHS = (2, 12)  # layers of the two GQA models (width 768): a ~5 ms and a ~25 ms forward at one row
RUNNER_REPEATS = 5


def _runner_decoding(model, rows: int):
    """A serving runner (fp32 pool) whose `rows` requests have prefilled and now decode, for many more steps."""
    from kvwall.serve.runner import Runner
    from kvwall.serve.scheduler import Request

    runner = Runner(model, n_blocks=rows * 32 + 8, chunk=512, max_batch=max(RUNNER_ROWS), kv_dtype="fp32")
    for i in range(rows):
        runner.add(Request(i, [1 + i % 7] * 16, 400))
    runner.step()  # the prefills
    runner.step()
    return runner


def _runner_model(layers: int):
    """A GQA model of width 768 and `layers` layers, random weights, loaded as `kvwall serve` loads one."""
    import torch

    from kvwall.engine.model import Transformer

    torch.manual_seed(0)
    return Transformer(_arch_spec("gqa", layers)).eval().prepack()


def _runner_extra(model, rows: int, runs: int) -> tuple[float, float]:
    """(forward seconds, what serving adds to it): runner.forward() of `rows` decoding rows (fastest of `runs`), and
    the median gap between streamed tokens of `rows` clients less that forward (runner.step() less it without
    starlette and uvicorn)."""
    from kvwall.serve.scheduler import Chunk

    runner = _runner_decoding(model, rows)
    chunks = [Chunk(r, r.computed - 1, 1) for r in runner.sched.running]  # rewrites each row's last slot
    forward = _fastest_time(lambda: runner.forward(chunks), runs)
    served = _served_token_gap(model, rows)
    return forward, (served if served is not None else _fastest_time(runner.step, runs)) - forward


def runner_step_cost(runs: int = 7) -> dict[str, float]:
    """{"fixed_s", "per_row_s", "slowdown"}: what kvwall serve adds to a step beyond its forwards over the pool:
    fixed + per row + `slowdown` x the forwards' own time. Timed on GQA models of width 768 (random weights):
    the 2-layer one at RUNNER_ROWS rows gives fixed + per row through the two points; the 12-layer one at one
    row, whose forward takes ~5x longer, gives the slowdown: the slope of the added time against the forward's.

    Measured as a client sees it: the median gap between streamed tokens of that many clients (a client process,
    as `kvwall loadtest` is) through the real server (uvicorn and the engine thread in one process, as
    `kvwall serve` runs them), less runner.forward() of as many decoding rows (fastest of `runs`). The runner
    alone (scheduling, tables, sampling: runner.step() less runner.forward()) missed most of it: SmolLM2 served
    to one streaming client took 32.8-35.5 ms a token against 30.9 ms for runner.step and 30.1 for the forward
    (benchmarks/profile_serve_step.py and loadtest, 2026-12-03). And the cost grows with the forward: the same
    decode step took 30.3-30.7 ms from the main thread and 32.9-33.8 in the server's engine thread while a client
    streamed, its 128-token prefill 221-229 against 240-257 ms (+9 % both), where the 2-layer model alone read
    0.7 ms. Without starlette and uvicorn, the runner alone."""
    import numpy as np
    import torch

    shallow, deep = (_runner_model(n) for n in RUNNER_DEPTHS)
    with torch.inference_mode():
        # one row at both depths, interleaved and the median of RUNNER_REPEATS: one reading of a 25 ms step's
        # added time moved from 1.7 to 6.3 ms on this host, busy that day (2026-12-03 18:05)
        ones = np.median([[_runner_extra(m, RUNNER_ROWS[0], runs) for m in (shallow, deep)]
                          for _ in range(RUNNER_REPEATS)], axis=0)  # (depth, (forward, extra))
        (t1, e1), (t_deep, e_deep) = ones
        t32, e32 = _runner_extra(shallow, RUNNER_ROWS[1], runs)
    slowdown = max((e_deep - e1) / (t_deep - t1), 0.0) if t_deep > t1 else 0.0
    (lo, hi), c_lo, c_hi = RUNNER_ROWS, e1 - slowdown * t1, e32 - slowdown * t32
    per_row = max((c_hi - c_lo) / (hi - lo), 0.0)
    return {"fixed_s": max(float(c_lo) - lo * per_row, 0.0), "per_row_s": float(per_row), "slowdown": float(slowdown)}


SERVED_TOKENS = 48  # tokens each client streams: the gaps after the first few are steady decode steps
_CLIENT = r"""
import http.client, json, sys, threading, time
port, clients, tokens = map(int, sys.argv[1:4])
gaps = []
def one(i):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    c.request("POST", "/v1/completions", json.dumps({"model": "calibrate", "prompt": [1 + i % 7] * 16,
              "max_tokens": tokens, "stream": True, "ignore_eos": True}), {"Content-Type": "application/json"})
    last = None
    for line in c.getresponse():
        if line.startswith(b"data: {"):
            now = time.perf_counter()
            if last is not None:
                gaps.append(now - last)
            last = now
threads = [threading.Thread(target=one, args=(i,)) for i in range(clients)]
for t in threads: t.start()
for t in threads: t.join()
gaps.sort()
print(json.dumps(gaps[len(gaps) // 2] if gaps else None))
"""


def _served_token_gap(model, rows: int) -> float | None:
    """Median seconds between streamed tokens when `rows` clients stream SERVED_TOKENS tokens each at once from
    kvwall serve's stack over `model` (None without starlette and uvicorn)."""
    import json
    import subprocess
    import sys

    try:
        import uvicorn  # noqa: F401  (serving_in_thread's)

        from kvwall.serve import serving_in_thread
        from kvwall.serve.runner import Runner
        from kvwall.serve.server import Api
        from kvwall.serve.worker import Worker
    except ImportError:
        return None
    runner = Runner(model, n_blocks=rows * 8 + 8, chunk=512, max_batch=max(RUNNER_ROWS), kv_dtype="fp32")
    with serving_in_thread(Api(Worker(runner), None, "calibrate").app()) as url:
        port = url.rsplit(":", 1)[1]
        out = subprocess.run([sys.executable, "-c", _CLIENT, port, str(rows), str(SERVED_TOKENS)],
                             capture_output=True, text=True, timeout=300)
    if out.returncode:
        raise RuntimeError(f"the serving client failed: {out.stderr.strip()[-300:]}")
    return json.loads(out.stdout)
