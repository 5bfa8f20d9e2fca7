"""Predicted against published measurements (catalog/measurements.json), row by row, in both modes.

* ideal: the roofline at the datasheet peaks (efficiency 1.0, no fixed costs);
* expected: predict/expected.py's fitted figures, scored leave-one-out (each row predicted by a fit that did
  not see it; predict/expected_fit.py); rows never fitted are scored with the stored fit (catalog.efficiency_file);
  and scored leave-one-source-out (each row predicted by a fit that saw no row of its document).

Summaries group the errors by engine, device, source and context band (``BANDS``, on the decode context).

Each row is predicted with its weight and KV formats, tensor parallel ``tp`` and the conventions in
predict/table.py (``CONVENTIONS``, stated in every output).
"""

from __future__ import annotations

import datetime
import json
import statistics

from kvwall import catalog
from kvwall.errors import KvwallError
from kvwall.predict.expected import MODES, PARAMS, expected_roof, fitted
from kvwall.predict.roofline import Roof
from kvwall.predict.table import CONVENTIONS, TIME_METRICS, figures, prepare, skip_reason

OUTLIER = 0.35  # |leave-one-out error| above which a row is called an outlier (the target)
# Context bands of the summaries, on a row's decode context (prompt + output / 2): (upper bound or None, name).
# 4k and 16k tokens: where a Llama-3-8B-like cache (128 KiB a token) passes 0.5 and 2.1 GB, against 16 GB of weights.
BANDS = ((4096, "< 4k"), (16384, "4k-16k"), (None, ">= 16k"))
# The summaries validate() returns: name -> (the mode a row's figure comes from, its error key there).
SCORES = {"expected": ("expected", "error"), "expected_loso": ("expected", "loso_error"), "ideal": ("ideal", "error")}


def band_of(context: int) -> str:
    """The BANDS name of a decode context in tokens."""
    return next(name for top, name in BANDS if top is None or context < top)


def select(rows, engine: str | None = None, device: str | None = None) -> list[dict]:
    """The rows of one engine and/or device (case-insensitive); an unknown name is a one-line error."""
    out = list(rows)
    for key, want in (("engine", engine), ("device", device)):
        if want is None:
            continue
        known = sorted({r[key] for r in out}, key=str.lower)
        if want.lower() not in {k.lower() for k in known}:
            raise KvwallError(f"no measurements for {key} {want!r}; known: {', '.join(known) or 'none'}")
        out = [r for r in out if r[key].lower() == want.lower()]
    return out


def _base(row: dict) -> dict:
    base = {k: row[k] for k in ("id", "model", "device", "n_devices", "tp", "engine", "metric")}
    return base | {"source": row["source"]["title"], "measured": row["value"]}


def predict_row(row: dict, mode: str = "ideal", params: dict | None = None) -> dict:
    """One row's figure in one mode (expected: the full fit, not leave-one-out), or a skip with its reason."""
    reason = skip_reason(row)
    if reason is None:
        try:
            p = prepare(row)
            roof = (Roof(p.device, p.dtype) if mode == "ideal"
                    else expected_roof(p.device, p.dtype, p.fm, p.spec, row["tp"], params, row.get("host_cost")))
            return _base(row) | {"batch": row["batch"], "compute_dtype": p.dtype, "decode_context": p.context,
                                 "context_band": band_of(p.context), "mode": mode} | figures(p, roof)
        except KvwallError as exc:
            reason = str(exc)
    return _base(row) | {"skipped": reason}


def validate(rows, engine: str | None = None, device: str | None = None, mode: str = "expected") -> dict:
    """Every selected row in both modes (expected: leave-one-out and leave-one-source-out over the whole table),
    and the summaries (SCORES); `predicted` / `error` of each row are those of `mode` (expected: leave-one-out)."""
    if mode not in MODES:
        raise KvwallError(f"unknown mode {mode!r}; known: {', '.join(MODES)}")
    chosen = {r["id"] for r in select(rows, engine, device)}
    usable = [r for r in rows if skip_reason(r) is None]
    preps = [prepare(r) for r in usable]
    params = fitted()
    wanted = [i for i, p in enumerate(preps) if p.row["id"] in chosen]
    loo, loso = held_out(preps, params, wanted)
    results = []
    for r in rows:
        if r["id"] not in chosen:
            continue
        results.append(_both(r, preps, loo, loso, params, mode))
    return {"mode": mode, "conventions": CONVENTIONS, "fit": fit_info(), "rows": results,
            "summary": summarize(results),
            "summaries": {name: summarize(results, m, key) for name, (m, key) in SCORES.items()}}


_HELD_OUT: dict = {}  # (table, parameters) -> {row index: (leave-one-out, leave-one-source-out error)}


def held_out(preps: list, params: dict, wanted: list[int]) -> tuple[dict, dict]:
    """The rows `wanted`'s errors held out one at a time and by source, each computed once per process and table:
    a validate of the whole table is ~160 fits (tests and the report ask for it several times)."""
    from kvwall.predict.expected_fit import leave_one_out, leave_one_source_out  # numpy: imported when scored

    key = (json.dumps([p.row for p in preps], sort_keys=True, default=str), json.dumps(params, sort_keys=True))
    done = _HELD_OUT.setdefault(key, {})
    todo = [i for i in wanted if i not in done]
    if todo:
        pairs = zip(leave_one_out(preps, params, only=todo), leave_one_source_out(preps, only=todo))
        done.update(zip(todo, pairs))
    return {i: done[i][0] for i in wanted}, {i: done[i][1] for i in wanted}


def _both(row: dict, preps: list, loo: dict, loso: dict, params: dict, mode: str) -> dict:
    from kvwall.predict.expected_fit import in_fit

    ideal = predict_row(row, "ideal")
    if "skipped" in ideal:
        return ideal
    i = next(k for k, p in enumerate(preps) if p.row["id"] == row["id"])
    full = predict_row(row, "expected", params)
    exp = {k: full[k] for k in ("predicted", "tpot_s", "ttft_s") if k in full}
    exp["predicted"] = _from_error(row, loo[i])
    exp |= {"error": loo[i], "loso_error": loso[i], "fitted_error": full["error"], "in_fit": in_fit(preps[i])}
    pick = ideal if mode == "ideal" else exp
    out = {k: v for k, v in ideal.items() if k not in ("predicted", "error", "tpot_s", "ttft_s", "mode")}
    out |= {"predicted": pick["predicted"], "error": pick["error"],
            "ideal": {k: ideal[k] for k in ("predicted", "error", "tpot_s", "ttft_s") if k in ideal},
            "expected": exp}
    for key in ("tpot_s", "ttft_s"):
        if key in pick:
            out[key] = pick[key]
    return out | _notes(row, loo[i])


def _from_error(row: dict, error: float) -> float:
    """The figure, in the metric's unit, that has this error against the row's measurement."""
    value = row["value"]
    return value / (1 + error) if row["metric"] in TIME_METRICS else value * (1 + error)


def _notes(row: dict, error: float) -> dict:
    out = {}
    if row.get("exclude_from_fit"):
        out["exclude_from_fit"] = row["exclude_from_fit"]
    if abs(error) > OUTLIER:
        out["outlier"] = (row.get("outlier") or row.get("exclude_from_fit")
                          or "no explanation recorded in measurements.json")
    return out


def summarize(results: list[dict], mode: str | None = None, key: str = "error") -> dict:
    """Counts, and median / max |error| overall, per engine, device, source and context band (skipped rows only
    counted); `mode` picks that mode's `key` error from each row (default: the row's own `error`). Rows without a
    source or band (hand-made tables) are grouped only where they have the key."""
    done = [dict(r, error=r[mode][key]) if mode else r for r in results if "error" in r]
    return {"checked": len(done), "skipped": len(results) - len(done), "all": _stats(done),
            "engines": _grouped(done, "engine"), "devices": _grouped(done, "device"),
            "sources": _grouped(done, "source"), "bands": _banded(done)}


def _banded(done: list[dict]) -> dict:
    """Stats per context band, in BANDS order, the bands with rows only."""
    rows = [r for r in done if "context_band" in r]
    return {name: _stats(part) for _, name in BANDS if (part := [r for r in rows if r["context_band"] == name])}


def _grouped(done: list[dict], key: str) -> dict:
    names = sorted({r[key] for r in done if key in r}, key=str.lower)
    return {n: _stats([r for r in done if r.get(key) == n]) for n in names}


def _stats(done: list[dict]) -> dict:
    if not done:
        return {"n": 0, "median_abs_error": None, "median_error": None, "max_abs_error": None, "worst": None}
    worst = max(done, key=lambda r: abs(r["error"]))
    return {"n": len(done), "median_abs_error": statistics.median(abs(r["error"]) for r in done),
            "median_error": statistics.median(r["error"] for r in done),
            "max_abs_error": abs(worst["error"]), "worst": worst["id"]}


def fit_info() -> dict:
    """What the stored fit is: its date, the table version it was fitted to, and whether that is this table."""
    data = catalog.efficiency()
    version = catalog.measurements_version()
    return {"file": str(catalog.efficiency_file()), "source": catalog.efficiency_source(),  # the user's, or packaged
            "date": data.get("date"), "table_version": data.get("table_version"),
            "current_table_version": version, "stale": data.get("table_version") != version,
            "params": data.get("params"), "excluded": data.get("excluded", [])}


def refit(rows) -> dict:
    """Fit the whole table and return efficiency.json's content (parameters, their meaning, date, version)."""
    from kvwall.predict.expected_fit import fit, in_fit

    usable = [r for r in rows if skip_reason(r) is None]
    preps = [prepare(r) for r in usable]
    params = fit(preps)
    return {"_about": "expected mode's fitted figures (kvwall.predict.expected, PARAMS); written by "
                      "`kvwall validate --fit` from catalog/measurements.json, not edited by hand",
            "date": datetime.date.today().isoformat(), "table_version": catalog.measurements_version(),
            "rows_fitted": sum(in_fit(p) for p in preps),
            "excluded": [p.row["id"] for p in preps if not in_fit(p)],
            "params": {k: float(f"{v:.6g}") for k, v in params.items()},
            "meaning": {k: v[0] for k, v in PARAMS.items()}}


def dumps(data: dict) -> str:
    return json.dumps(data, indent=1) + "\n"
