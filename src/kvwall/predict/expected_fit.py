"""Fitting expected mode's figures (predict/expected.py's PARAMS) to the published table, and scoring them
leave-one-out.

The fit: least squares on log(predicted rate / measured rate) over the rows, every parameter in log space
(so each stays positive), Levenberg-Marquardt with a numeric Jacobian. Parameters marked ``ridge`` in PARAMS
(class factors, fp8 and int4 extras) also pay RIDGE x log(value)^2: with few rows behind them they stay near
1 instead of chasing one row. Rows with an ``exclude_from_fit`` reason in the table are scored but never
fitted.

Leave-one-out: for each fitted row, refit without it (from the same start as the full fit) and predict it, so that the
error shown for a row is never of a fit that saw the row.

Leave-one-source-out: rows of one document share an engine build, a harness and its conventions, so a fit that saw
a row's neighbours has half seen the row. For each source (``source_of``: the document, its title), refit without
all of its rows and predict them: the error of a figure for a document the fit has never read.
"""

from __future__ import annotations

import math

import numpy as np

from kvwall.predict.expected import PARAMS, expected_roof
from kvwall.predict.table import Prepared, figures, rate

RIDGE = 0.3  # weight of a ridge parameter's log(value)^2 against one row's log error^2
LOG_RANGE = (-25.0, 3.0)  # clip: fractions and seconds between e^-25 and e^3
NAMES = list(PARAMS)


def in_fit(prep: Prepared) -> bool:
    return not prep.row.get("exclude_from_fit")


def log_errors(preps: list[Prepared], params: dict) -> list[float]:
    """log(predicted rate / measured rate) of each row under these parameters."""
    out = []
    for p in preps:
        predicted = figures(p, expected_roof(p.device, p.dtype, p.fm, p.spec, p.row["tp"], params,
                                           p.row.get("host_cost")))["predicted"]
        metric = p.row["metric"]
        out.append(math.log(max(rate(metric, predicted), 1e-300)) - math.log(rate(metric, p.row["value"])))
    return out


def _params(x: np.ndarray) -> dict:
    return {k: math.exp(v) for k, v in zip(NAMES, np.clip(x, *LOG_RANGE))}


def _residuals(x: np.ndarray, preps: list[Prepared]) -> np.ndarray:
    ridge = [math.sqrt(RIDGE) * v for k, v in zip(NAMES, x) if PARAMS[k][2]]
    return np.array(log_errors(preps, _params(x)) + ridge)


def fit(preps: list[Prepared], start: dict | None = None, iterations: int = 100) -> dict:
    """The parameters that minimize the rows' squared log errors (plus the ridge terms)."""
    rows = [p for p in preps if in_fit(p)]
    begin = start or {k: v[1] for k, v in PARAMS.items()}
    x = np.log(np.array([begin[k] for k in NAMES], float))
    r, damping = _residuals(x, rows), 1e-2
    for _ in range(iterations):
        jac = _jacobian(x, r, rows)
        x_new, r_new, damping = _lm_step(x, r, jac, damping, rows)
        if x_new is None or r @ r - r_new @ r_new < 1e-10 * (r @ r):
            x, r = (x, r) if x_new is None else (x_new, r_new)
            break
        x, r = x_new, r_new
    return _params(x)


def _jacobian(x: np.ndarray, r: np.ndarray, rows: list[Prepared], h: float = 1e-5) -> np.ndarray:
    jac = np.empty((len(r), len(x)))  # (rows + ridge terms, params)
    for j in range(len(x)):
        dx = np.zeros(len(x))
        dx[j] = h
        jac[:, j] = (_residuals(x + dx, rows) - r) / h
    return jac


def _lm_step(x, r, jac, damping, rows):
    """One Levenberg-Marquardt step: raise the damping until the cost falls (None if it never does)."""
    a, g = jac.T @ jac, jac.T @ r
    while damping < 1e8:
        step = np.linalg.solve(a + damping * np.diag(np.diag(a) + 1e-9), -g)
        r_new = _residuals(x + step, rows)
        if r_new @ r_new < r @ r:
            return x + step, r_new, max(damping / 3, 1e-7)
        damping *= 4
    return None, r, damping


def leave_one_out(preps: list[Prepared], full: dict, only: list[int] | None = None) -> list[float]:
    """Each row's error under a fit without it (rows never fitted: the full fit's error); `only`: these indices of
    `preps`, in that order. Each fit starts from the full one's parameters: the same optimum (within 2e-6 of a
    cold start's parameters on the 148-row table) in 0.48 s instead of 1.13 s a fit."""
    out = []
    for i in range(len(preps)) if only is None else only:
        p = preps[i]
        params = fit(preps[:i] + preps[i + 1:], start=full) if in_fit(p) else full
        out.append(math.expm1(log_errors([p], params)[0]))
    return out


def source_of(row: dict) -> str:
    """The document a measurement row comes from (its source's title): what leave-one-source-out holds out."""
    return row["source"]["title"]


def leave_one_source_out(preps: list[Prepared], only: list[int] | None = None) -> list[float]:
    """Each row's error under a fit made without every row of its source (same start as the full fit: started from
    the full fit's parameters instead, a figure no other source constrains keeps the value the held-out source
    gave it, and the median moved 11.3 -> 10.7 %), fitted rows or not; `only`: these indices of `preps`, in that
    order. One fit per source."""
    fits: dict[str, dict] = {}
    out = []
    for i in range(len(preps)) if only is None else only:
        src = source_of(preps[i].row)
        if src not in fits:
            fits[src] = fit([p for p in preps if source_of(p.row) != src])
        out.append(math.expm1(log_errors([preps[i]], fits[src])[0]))
    return out
