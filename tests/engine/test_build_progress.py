"""A C++ kernel build says what it builds and how far it is (issue #40: a first `kvwall report` compiled for minutes
without a word), build_all builds the missing ones together, and the "about N s" estimates count the builds.

The compiler is a stub here (torch's load, replaced): it writes what a real build leaves (the module file and
build.ninja naming the source) into the build folder, so the cache checks see a real-looking build.
"""

from __future__ import annotations

import datetime
import os
import threading
import time
import types
import warnings

import pytest

pytest.importorskip("torch")

from kvwall.engine import native

ALL = sorted(p.stem for p in native.KERNELS.glob("*.cpp"))
N = len(ALL)


class Compiler:
    """torch.utils.cpp_extension.load's stand-in: records what it compiled and how many ran at once."""

    def __init__(self, seconds: float = 0.0, fail: set[str] = frozenset()):
        self.seconds, self.fail = seconds, set(fail)
        self.compiled: list[str] = []
        self.running = self.most = 0
        self.lock = threading.Lock()

    def __call__(self, name, sources, extra_cflags, extra_include_paths, extra_ldflags, build_directory, verbose):
        kernel = name.removeprefix("kvwall_")
        lib = native.library(kernel, native.Path(build_directory))
        if not native.up_to_date(kernel, native.Path(build_directory)):  # what ninja would compile
            with self.lock:
                self.compiled.append(kernel)
                self.running += 1
                self.most = max(self.most, self.running)
            time.sleep(self.seconds)
            with self.lock:
                self.running -= 1
            if kernel in self.fail:
                raise RuntimeError(f"{sources[0]}:1:1: error: stub compile error")
            (native.Path(build_directory) / "build.ninja").write_text(f"build x.o: compile {sources[0]}\n")
            lib.write_bytes(b"")
        return types.SimpleNamespace(kernel=kernel)


@pytest.fixture
def compiler(tmp_path, monkeypatch):
    """An empty kernel cache, a fresh process state, and the stub compiler."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    monkeypatch.delenv(native.REQUIRE, raising=False)
    monkeypatch.setattr(native, "_started", set())
    monkeypatch.setattr(native, "_loaded", {})
    stub = Compiler()
    monkeypatch.setattr("torch.utils.cpp_extension.load", stub)
    return stub


def new_process(monkeypatch):
    """What a later process sees: the disk cache, none of this one's state."""
    monkeypatch.setattr(native, "_started", set())
    monkeypatch.setattr(native, "_loaded", {})


def lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line]


def test_the_total_is_the_number_of_cpp_files():
    assert native.names() == ALL and N == len(list(native.KERNELS.glob("*.cpp"))) >= 7
    assert set(native.BUILD_S) <= set(ALL)  # measured times name real kernels (a renamed one would go stale)


def test_a_real_build_says_k_of_n_on_stderr_and_a_cached_one_nothing(compiler, capsys, monkeypatch):
    assert native.build("fused_ops", "x") is not None
    assert native.build("packed_linear", "x") is not None
    out, err = capsys.readouterr()
    assert out == ""  # stdout may be a command's JSON
    where = native._shown(native.build_root())
    assert lines(err) == [f"building C++ kernel 1 of {N}: fused_ops (first use; cached under {where})",
                          f"C++ kernel 1 of {N}: fused_ops built in 0 s",
                          f"building C++ kernel 2 of {N}: packed_linear (first use; cached under {where})",
                          f"C++ kernel 2 of {N}: packed_linear built in 0 s"]
    assert native.build("fused_ops", "x") is not None  # loaded in this process: kept
    new_process(monkeypatch)
    assert native.build("fused_ops", "x") is not None  # another process: cached on disk
    assert capsys.readouterr() == ("", "") and compiler.compiled == ["fused_ops", "packed_linear"]
    native.build("mla_decode", "x")  # k counts the kernels already built, by whichever process
    assert lines(capsys.readouterr().err)[0].startswith(f"building C++ kernel 3 of {N}: mla_decode (first use")


def test_the_cache_under_home_is_shown_short(monkeypatch, tmp_path):
    monkeypatch.setattr(native.Path, "home", lambda: tmp_path)
    assert native._shown(tmp_path / ".cache" / "torch_extensions" / "kvwall") == "~/.cache/torch_extensions/kvwall"


def test_a_build_that_fails_says_so_once(compiler, capsys):
    compiler.fail = {"paged_decode"}
    with pytest.warns(native.KernelBuildWarning, match="paged_decode did not build .*stub compile error"):
        assert native.build("paged_decode", "the torch path") is None
    assert native.build("paged_decode", "the torch path") is None  # not compiled, nor warned, again
    assert compiler.compiled == ["paged_decode", "paged_decode"]  # with OpenMP, then without
    assert lines(capsys.readouterr().err) == [
        f"building C++ kernel 1 of {N}: paged_decode (first use; cached under {native._shown(native.build_root())})",
        f"C++ kernel 1 of {N}: paged_decode did not build (0 s; the warning below says why)"]


def test_a_build_from_another_checkout_or_older_sources_is_not_cached(compiler, tmp_path):
    native.build("fused_ops", "x")
    where = next(native.build_root().glob("fused_ops-*"))
    assert native.up_to_date("fused_ops", where)
    ninja = where / "build.ninja"
    ninja.write_text(ninja.read_text().replace(str(native.KERNELS), "/elsewhere/kernels"))
    assert not native.up_to_date("fused_ops", where)  # torch rewrites build.ninja, ninja compiles again
    native.build("fused_ops", "x")
    old = native.source("fused_ops").stat().st_mtime - 60
    os.utime(native.library("fused_ops", where), (old, old))
    assert not native.up_to_date("fused_ops", where)  # sources newer than the module: ninja compiles again


@pytest.mark.slow
def test_build_all_builds_only_what_is_missing_side_by_side(compiler, capsys, monkeypatch):
    native.build("fused_ops", "x")
    native.build("selective_scan", "x")
    new_process(monkeypatch)
    capsys.readouterr()
    compiler.seconds = 0.3
    done = native.build_all(jobs=2)
    todo = [n for n in ALL if n not in ("fused_ops", "selective_scan")]
    assert sorted(done) == todo and all(done.values())
    assert sorted(compiler.compiled) == sorted(["fused_ops", "selective_scan"] + todo)  # each once in all
    assert compiler.most == 2  # two at a time, never more
    out, err = capsys.readouterr()
    said = lines(err)
    assert out == "" and said[0].startswith(f"building {len(todo)} C++ kernels, 2 at a time (about ")
    assert said[0].endswith(", once): " + ", ".join(done))  # longest first
    starts = sorted(line.split(":")[0] for line in said if line.startswith("building C++ kernel"))
    assert starts == sorted(f"building C++ kernel {k} of {N}" for k in range(3, N + 1))
    assert sum(line.endswith(" built in 0 s") for line in said) == len(todo) and len(said) == 1 + 2 * len(todo)
    assert native.build_all() == {} and capsys.readouterr() == ("", "")  # nothing missing: not a word
    new_process(monkeypatch)
    assert native.missing() == [] and native.build_all() == {}


def test_build_all_one_at_a_time(compiler):
    order = sorted(ALL, key=lambda n: -native.BUILD_S.get(n, native.BUILD_S_ANY))  # longest first
    assert native.build_all(jobs=1) == {n: True for n in order}
    assert compiler.most == 1 and compiler.compiled == order


def test_the_estimate_counts_builds_only_when_some_are_missing(compiler, monkeypatch):
    monkeypatch.setattr(native, "usable_cores", lambda: 2)
    note = native.build_note()
    assert note.startswith(f"building {N} C++ kernels first (about ") and note.endswith(" on 2 cores, once)")
    times = [native.BUILD_S.get(n, native.BUILD_S_ANY) for n in ALL]
    assert native.build_seconds(ALL, 1) == pytest.approx(sum(times))
    assert max(times) <= native.build_seconds(ALL, 2) / native.PARALLEL_SLOWDOWN < sum(times)
    assert native.build_seconds(ALL, 64) == pytest.approx(max(times) * native.PARALLEL_SLOWDOWN)
    assert native.build_note(["fused_ops"], cores=1) == (
        f"building 1 C++ kernel first (about {native.BUILD_S['fused_ops']:.0f} s on 1 core, once)")
    native.build_all()
    assert native.build_note() == "" and native.build_note([]) == ""


def test_calibrating_first_says_what_it_builds(compiler, tmp_path, monkeypatch):
    from kvwall.measure import calibrate as cal

    monkeypatch.setattr(cal, "calibrate", lambda quick: type("C", (), {"profile": lambda self: {}})())
    monkeypatch.setattr(cal, "save_profile", lambda profile, p: p)
    said: list[str] = []
    cal.fresh_profile(tmp_path / "none.json", say=said.append)
    assert said[-1].startswith("calibrating this machine first (`kvwall calibrate --quick`, about 10 s): there is "
                               f"none; building {N} C++ kernels first (about ")
    native.build_all()
    cal.fresh_profile(tmp_path / "none.json", say=said.append)
    assert said[-1] == "calibrating this machine first (`kvwall calibrate --quick`, about 10 s): there is none"


def test_calibrate_builds_first(compiler, monkeypatch):
    """calibrate builds every missing kernel before it chooses its settings, its first step."""
    from kvwall.measure import calibrate as cal

    def choose(quick):
        assert native.missing() == []
        raise RuntimeError("stop here")

    monkeypatch.setattr(cal.Settings, "choose", choose)
    with pytest.raises(RuntimeError, match="stop here"):
        cal.calibrate(quick=True)
    assert sorted(compiler.compiled) == ALL


def test_the_report_says_the_builds_then_builds_them(compiler, capsys, monkeypatch):
    from kvwall.report import build, measured

    plan = types.SimpleNamespace(archs=[types.SimpleNamespace(name="gqa")], contexts=[1024])
    monkeypatch.setattr(measured, "plan", lambda full, say: (plan, None, 12.0))
    monkeypatch.setattr(measured, "real_model_installed", lambda: False)
    said: list[str] = []
    assert build._measured_step(False, said.append, datetime.datetime.now().astimezone()) is not None
    assert said[0].startswith("measuring gqa at 1k tokens on this machine: about 12 s (--full: every architecture "
                              f"at 1k-32k); building {N} C++ kernels first (about ")
    assert sorted(compiler.compiled) == ALL and native.missing() == []  # built up front, with their progress
    assert f"building C++ kernel {N} of {N}: " in capsys.readouterr().err
    build._measured_step(False, said.append, datetime.datetime.now().astimezone())
    assert said[1] == "measuring gqa at 1k tokens on this machine: about 12 s (--full: every architecture at 1k-32k)"


def test_progress_lines_go_to_stderr_while_warnings_stay_warnings(compiler, capsys):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning on a good build
        native.build_all(jobs=2)
    assert capsys.readouterr().out == ""
