"""The `kvwall` command line: argument parsing and error handling; commands live in kvwall.commands."""

from __future__ import annotations

import argparse
import re
import sys

from kvwall import __version__
from kvwall.errors import KvwallError


class _Parser(argparse.ArgumentParser):
    """A usage error is one line (the option and what is wrong), exit status 2; --help still shows usage.
    Sub-command parsers are made from this class too (argparse uses the parent's class)."""

    def error(self, message: str):
        message = re.sub(r"^argument ([^:]+): ", r"\1 ", message)  # "--batch must be ...", as our own errors read
        self.exit(2, f"kvwall: error: {message} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    from kvwall.commands import (
        bench_cmd,
        calibrate_cmd,
        engine_cmds,
        explore_cmd,
        loadtest_cmd,
        memory_cmds,
        quality_cmd,
        recall_cmd,
        report_cmd,
        serve_cmd,
        simulate_cmd,
        speed_cmds,
        validate_cmd,
    )

    p = _Parser(
        prog="kvwall",
        description="What remembering the context costs a language model at decode time: "
                    "cache and weight bytes, what fits, and how fast it decodes.",
    )
    p.add_argument("--version", action="version", version=f"kvwall {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    memory_cmds.register(sub)
    engine_cmds.register(sub)
    speed_cmds.register(sub)
    report_cmd.register(sub)
    calibrate_cmd.register(sub)
    bench_cmd.register(sub)
    validate_cmd.register(sub)
    serve_cmd.register(sub)
    loadtest_cmd.register(sub)
    simulate_cmd.register(sub)
    quality_cmd.register(sub)
    recall_cmd.register(sub)
    explore_cmd.register(sub)
    return p



def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version, or a usage error (its one line already printed)
        return int(exc.code or 0)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except KvwallError as exc:
        print(f"kvwall: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("kvwall: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
