"""kvwall recall against hostile input (issue #38): a damaged or mismatched results cache is never printed, neither
by `kvwall recall` (it warns in one line and trains the model again) nor by the report (it warns and leaves recall
out); option values that are not plain ASCII whole numbers, or empty, are one line naming the option."""

from __future__ import annotations

import json
import shutil

import pytest

torch = pytest.importorskip("torch")

from kvwall.cli import main  # noqa: E402
from kvwall.measure import recall  # noqa: E402

PLAN = recall.Plan(seq=16, max_steps=2, eval_every=1, val=4, test=4)  # a model trains in about a second
ARCH, WIDTH, PAIRS = recall.Arch("attention"), 32, [2, 3]
# attention, width 32 (one head of 32), 16 tokens, fp32: 2 layers x (K + V) x 32 x 16 tokens x 4 B = 8,192 B
KEPT_BY_HAND = 2 * 2 * 32 * 16 * 4


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    """A model's real cached file and its rows, trained once for the module."""
    cache = tmp_path_factory.mktemp("good")
    data = recall.run([ARCH], [WIDTH], PAIRS, PLAN, cache=cache)
    (path,) = cache.glob("*.json")
    return path, data["results"]


def _rows(good) -> list[dict]:
    return json.loads(good[0].read_text())


def _other(rows, **changes) -> list[dict]:
    return [dict(r, **changes) for r in rows]


# Each damage: what the file holds instead (text) from the good rows, and a word the warning must name.
DAMAGES = {
    "nan accuracy": (lambda rows: json.dumps(_other(rows, accuracy=float("nan"))), "accuracy"),
    "750 % accuracy": (lambda rows: json.dumps(_other(rows, accuracy=7.5)), "accuracy"),
    "negative accuracy": (lambda rows: json.dumps(_other(rows, accuracy=-0.1)), "accuracy"),
    "accuracy as text": (lambda rows: json.dumps(_other(rows, accuracy="0.9")), "accuracy"),
    "accuracy as a bool": (lambda rows: json.dumps(_other(rows, accuracy=True)), "accuracy"),
    "accuracy missing": (lambda rows: json.dumps([{k: v for k, v in r.items() if k != "accuracy"} for r in rows]),
                         "accuracy"),
    "negative kept bytes": (lambda rows: json.dumps(_other(rows, kept_bytes=-8192)), "kept_bytes"),
    "kept bytes as a float": (lambda rows: json.dumps(_other(rows, kept_bytes=8192.0)), "kept_bytes"),
    "kept bytes inflated": (lambda rows: json.dumps(_other(rows, kept_bytes=10**12)), "kept_bytes"),
    "params missing": (lambda rows: json.dumps([{k: v for k, v in r.items() if k != "params"} for r in rows]),
                       "params"),
    "another architecture's rows": (lambda rows: json.dumps(_other(rows, arch="mamba", kind="mamba")), "arch"),
    "another width's rows": (lambda rows: json.dumps(_other(rows, width=64)), "width"),
    "another length's rows": (lambda rows: json.dumps(_other(rows, seq=64)), "seq"),
    "another mixture's rows": (lambda rows: json.dumps(_other(rows, trained_on=[2])), "trained_on"),
    "another rate's rows": (lambda rows: json.dumps(_other(rows, lr=3e-3)), "lr"),
    "steps past the plan": (lambda rows: json.dumps(_other(rows, steps=PLAN.max_steps + 1)), "steps"),
    "zero steps": (lambda rows: json.dumps(_other(rows, steps=0)), "steps"),
    "unknown stop": (lambda rows: json.dumps(_other(rows, stopped="bored")), "stopped"),
    "attempts past the plan": (lambda rows: json.dumps(_other(rows, attempts=3, seed=2)), "attempts"),
    "seed not the attempt's": (lambda rows: json.dumps(_other(rows, seed=5)), "seed"),
    "negative seconds": (lambda rows: json.dumps(_other(rows, train_seconds=-1)), "train_seconds"),
    "infinite seconds": (lambda rows: json.dumps(_other(rows, train_seconds=float("inf"))), "train_seconds"),
    "curve not a list": (lambda rows: json.dumps(_other(rows, curve=None)), "curve"),
    "an empty list": (lambda rows: "[]", "pairs"),
    "one pair count missing": (lambda rows: json.dumps(rows[:1]), "pairs"),
    "a pair count twice": (lambda rows: json.dumps(rows + rows[:1]), "pairs"),
    "an extra pair count": (lambda rows: json.dumps(rows + _other(rows[:1], pairs=4)), "pairs"),
    "pairs as text": (lambda rows: json.dumps(_other(rows[:1], pairs="2") + rows[1:]), "pairs"),
    "a dict, not a list": (lambda rows: json.dumps({"results": rows}), "not a list"),
    "a list of numbers": (lambda rows: "[1, 2]", "not a list"),
    "null": (lambda rows: "null", "not a list"),
    "malformed JSON": (lambda rows: json.dumps(rows)[:-7], "not valid JSON"),
    "not UTF-8": (lambda rows: b"\xff\xfe\x00[", "not valid JSON"),
    "nested too deep": (lambda rows: "[" * 200_000, "not valid JSON"),
    "empty file": (lambda rows: "", "not valid JSON"),
}


def _damage(good, tmp_path, name):
    """A cache directory holding the good file under its own name, damaged `name`'s way."""
    path = tmp_path / "cache" / good[0].name
    path.parent.mkdir()
    content = DAMAGES[name][0](_rows(good))
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    return path


def test_the_good_file_is_used_as_it_is(good, tmp_path, capsys):
    """The undamaged file is read back without a warning and nothing trains (the damages below are all that
    differs); its kept bytes are the hand count."""
    path, rows = good
    assert [r["kept_bytes"] for r in rows] == [KEPT_BY_HAND] * 2
    shutil.copytree(path.parent, tmp_path / "cache")
    again = recall.run([ARCH], [WIDTH], PAIRS, PLAN, cache=tmp_path / "cache")
    assert again["trained"] == 0 and again["cached"] == 1 and capsys.readouterr().err == ""
    assert recall.cached([ARCH], [WIDTH], PAIRS, PLAN, cache=tmp_path / "cache") is not None


@pytest.mark.parametrize("name", list(DAMAGES))
def test_a_damaged_cache_is_never_read_back(name, good, tmp_path, capsys):
    """The report's read-only use: no result (the section then says how to make one) and one warning naming the
    file and what is wrong with it."""
    path = _damage(good, tmp_path, name)
    assert recall.cached([ARCH], [WIDTH], PAIRS, PLAN, cache=path.parent) is None
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith("kvwall: warning: "), err
    assert str(path) in err and DAMAGES[name][1] in err and "Traceback" not in err, err


@pytest.mark.slow
@pytest.mark.parametrize("name", ["750 % accuracy", "another architecture's rows", "an empty list",
                                  "malformed JSON"])
def test_a_damaged_cache_is_trained_again(name, good, tmp_path, capsys):
    """`kvwall recall`'s use: one warning, the model trains again (the same seeded rows as the good file's) and the
    repaired file replaces the damaged one."""
    path = _damage(good, tmp_path, name)
    data = recall.run([ARCH], [WIDTH], PAIRS, PLAN, cache=path.parent)
    err = capsys.readouterr().err
    assert data["trained"] == 1 and data["cached"] == 0
    assert [r["accuracy"] for r in data["results"]] == [r["accuracy"] for r in good[1]]
    assert "training it again" in err and len(err.strip().splitlines()) == 1, err
    timeless = lambda rows: [{k: v for k, v in r.items() if k != "train_seconds"} for r in rows]  # noqa: E731
    assert timeless(json.loads(path.read_text())) == timeless(_rows(good))


@pytest.mark.slow
def test_the_command_never_prints_a_damaged_cache(good, tmp_path, monkeypatch, capsys):
    """End to end: 750 % in the cached file; `kvwall recall` warns, trains, and prints the trained accuracy."""
    monkeypatch.setenv("KVWALL_HOME", str(tmp_path))
    rc = main(["recall", "--archs", "attention", "--widths", "32", "--pairs", "2,3", "--seq", "16", "--steps", "2"])
    out = capsys.readouterr().out
    assert rc == 0 and "1 models trained" in out
    (path,) = (tmp_path / "recall").glob("*.json")
    path.write_text(json.dumps(_other(json.loads(path.read_text()), accuracy=7.5)))
    rc = main(["recall", "--archs", "attention", "--widths", "32", "--pairs", "2,3", "--seq", "16", "--steps", "2"])
    captured = capsys.readouterr()
    assert rc == 0 and "750" not in captured.out and "1 models trained" in captured.out, captured.out
    assert "kvwall: warning: ignoring the cached recall result" in captured.err


def test_the_report_leaves_a_damaged_grid_out(tmp_path, monkeypatch, capsys):
    """The report's section over the default grid's cache, every model's file written with complete rows but one
    of them at 750 %: one warning, and the section is the line naming `kvwall recall`, no table."""
    pytest.importorskip("matplotlib")
    from kvwall.report import recall as report_recall

    monkeypatch.setenv("KVWALL_HOME", str(tmp_path / "home"))
    archs, widths, pairs, plan = recall.request(recall.DEFAULTS)
    cache = recall.cache_dir()
    cache.mkdir(parents=True)
    for m, (a, w) in enumerate(recall.models(archs, widths)):
        spec = recall.model_spec(a, w, plan.seq)
        rows = [{"arch": a.name, "kind": a.kind, "window": a.window, "width": w, "pairs": n, "seq": plan.seq,
                 "accuracy": 7.5 if m == 3 else 0.5, "params": spec.params(), "lr": recall.rate(a, w, plan),
                 **recall.kept_bytes(spec, plan.seq), "trained_on": pairs, "seed": 0, "attempts": 1, "steps": 10,
                 "stopped": "target", "train_seconds": 1.0, "curve": [], "layers": []} for n in pairs]
        (cache / f"{recall._key(a, w, pairs, plan)}.json").write_text(json.dumps(rows))
    section = report_recall.section(tmp_path)
    err = capsys.readouterr().err
    assert not section.tables and not section.figures and "`kvwall recall`" in section.paragraphs[0]
    assert len(err.strip().splitlines()) == 1 and "accuracy 7.5" in err, err


@pytest.mark.parametrize("argv,names", [
    (["--widths", "\u00b2"], ["--widths"]),  # "²".isdigit() is True, int("²") fails
    (["--widths", "\u0664"], ["--widths"]),  # Arabic-Indic four: int() takes it, no option should
    (["--pairs", "\u00b2"], ["--pairs"]),
    (["--archs", "sliding:\u00b2"], ["--archs", "sliding"]),
    (["--archs", "sliding:\u0664"], ["--archs", "sliding"]),
    (["--widths", ""], ["--widths"]),  # empty: was the default, silently
    (["--widths", " "], ["--widths"]),
    (["--pairs", ""], ["--pairs"]),
    (["--archs", ""], ["--archs"]),
    (["--archs", ","], ["--archs"]),
    (["--archs", "attention,,mamba"], ["--archs"]),
    (["--quick", "--archs", ""], ["--archs"]),
])
def test_option_values_get_one_line(argv, names, capsys, monkeypatch):
    monkeypatch.setattr(recall, "run", lambda *a, **k: pytest.fail(f"{argv} was accepted: it would train"))
    rc = main(["recall", *argv])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    for n in names:
        assert n in err, (n, err)
