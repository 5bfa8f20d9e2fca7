"""The README's and the docs' example outputs are what the CLI prints today.

Every fenced block in README.md and docs/**/*.md that starts with `$ kvwall <cmd>` for a predictor command
(pure Python, well under a second each; simulate a few seconds) is run at the width it was captured at, and
each line the page shows must equal the line the command prints now (a block may stop early: the page shows
a prefix of the output). An example that drifts from the code fails here instead of misleading a reader.

`python tests/test_readme_examples.py --update` rewrites the blocks with today's output.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PREDICTOR = {"memory", "roofline", "speed", "compare", "fit", "simulate", "speculate"}
COLUMNS = 200  # the width the examples' tables were captured at
BLOCK = re.compile(r"```(?:text)?\n(\$ kvwall .*?)```", re.S)


def documents() -> list[Path]:
    """The pages whose examples are checked: the README, then every docs page."""
    return [README, *sorted((ROOT / "docs").rglob("*.md"))]


def examples(text: str) -> list[tuple[str, list[str], list[str]]]:
    """(the block's text, the argv it runs, the output lines it shows) for each predictor example."""
    found = []
    for m in BLOCK.finditer(text):
        lines = m.group(1).rstrip("\n").split("\n")
        cmd, i = lines[0][2:], 1
        while cmd.endswith("\\"):  # a command continued on the next line
            cmd, i = cmd[:-1] + " " + lines[i].strip(), i + 1
        argv = shlex.split(cmd)
        if argv[1] not in PREDICTOR:
            continue
        if "--plot" in argv:  # the figure is committed beside the pages; the text is what is checked
            k = argv.index("--plot")
            del argv[k:k + 2]
        found.append((m.group(1), argv, [line.rstrip() for line in lines[i:]]))
    return found


def run(argv: list[str]) -> list[str]:
    env = {**os.environ, "COLUMNS": str(COLUMNS), "KVWALL_HOME": os.environ.get("KVWALL_HOME", "/nonexistent-kvwall")}
    out = subprocess.run([sys.executable, "-m", "kvwall", *argv[1:]], capture_output=True, text=True, env=env,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return [line.rstrip() for line in out.stdout.rstrip("\n").split("\n")]


EXAMPLES = [(doc, *e) for doc in documents() for e in examples(doc.read_text(encoding="utf-8"))]


def test_the_readme_and_the_docs_have_examples():
    in_readme = [e[2][1] for e in EXAMPLES if e[0] == README]
    assert {"memory", "fit", "speed"} <= set(in_readme), in_readme
    assert len(EXAMPLES) >= 8, [(e[0].name, e[2][:2]) for e in EXAMPLES]  # the guides show more of them


@pytest.mark.parametrize("doc,block,argv,shown", EXAMPLES,
                         ids=[f"{e[0].relative_to(ROOT).as_posix()}: {' '.join(e[2][1:3])}" for e in EXAMPLES])
def test_example_output_is_current(doc, block, argv, shown):
    printed = run(argv)
    assert len(shown) <= len(printed), f"{doc.name} shows more lines than the command prints"
    drift = [(n, want, got) for n, (want, got) in enumerate(zip(shown, printed)) if want != got]
    assert not drift, f"{doc.name} example drifted (python tests/test_readme_examples.py --update):\n" + "\n".join(
        f"line {n}:\n  page: {want}\n  now:  {got}" for n, want, got in drift[:5])


def update() -> None:
    for doc in documents():
        text = doc.read_text(encoding="utf-8")
        new = text
        for block, argv, shown in examples(text):
            lines = block.rstrip("\n").split("\n")
            head = lines[: len(lines) - len(shown)]  # the command's lines
            new = new.replace(block, "\n".join(head + run(argv)) + "\n", 1)
        if new != text:
            doc.write_text(new, encoding="utf-8")


if __name__ == "__main__" and sys.argv[1:] == ["--update"]:
    update()
