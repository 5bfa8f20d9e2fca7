"""Human units in and out.

Token counts use binary multipliers, as context lengths are quoted: 4k = 4,096,
128k = 131,072, 1M = 1,048,576. Memory sizes follow their suffix: GB is 10^9
(vendors' capacities), GiB is 2^30. Bytes are printed in IEC units (KiB ... TiB).
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Callable, Iterable

from kvwall.errors import KvwallError

MAX_COUNT = 2**40  # far above any real batch, context or width; keeps every product a finite float
MAX_BYTES = 2**60  # an exbibyte: far above any real memory

_TOKEN_MULT = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
_BYTE_MULT = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
}


def ascii_digits(text: str) -> bool:
    """Only the digits 0-9 (one or more): str.isdigit also takes '²' (which int() refuses: a traceback) and
    '٣' (which int() reads as 3). The one check of a number's digits, wherever a value is split by hand."""
    return text.isascii() and text.isdigit()


def parse_tokens(text: str | int, what: str = "token count") -> int:
    """'128k' -> 131072; '4096' -> 4096. Must be a positive whole number of tokens."""
    if isinstance(text, int):
        value = text
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgG]?)\s*", str(text), re.ASCII)
        if not m:
            raise KvwallError(f"bad {what} {text!r}: write a whole number such as 4096, 32k or 1M")
        value = float(m.group(1)) * _TOKEN_MULT[m.group(2).lower()]
        if value > MAX_COUNT:
            raise KvwallError(f"bad {what} {_short(text)!r}: it must be at most {MAX_COUNT:,}")
        if value != int(value):
            raise KvwallError(f"bad {what} {text!r}: it is not a whole number of tokens")
        value = int(value)
    if not 1 <= value <= MAX_COUNT:
        raise KvwallError(f"bad {what} {_short(str(text))!r}: it must be from 1 to {MAX_COUNT:,}")
    return value


def parse_token_list(text: str, what: str = "token count") -> list[int]:
    return [parse_tokens(part, what) for part in str(text).split(",") if part.strip()] or [parse_tokens(text, what)]


def parse_int_list(text: str, what: str) -> list[int]:
    out = []
    for part in str(text).split(","):
        part = part.strip()
        if not ascii_digits(part) or len(part.lstrip("0")) > 13 or not 1 <= int(part) <= MAX_COUNT:  # 13: 2**40's
            raise KvwallError(f"bad {what} {_short(str(text))!r}: give whole numbers from 1 to {MAX_COUNT:,} "
                              "separated by commas, e.g. 1,8,64")
        out.append(int(part))
    return out


BARE_MIN = 1 << 20  # a bare number below this many bytes is taken for a forgotten unit (`--memory 80`), an error


def parse_bytes(text: str, what: str = "memory size") -> int:
    """'80GB' -> 80e9; '24GiB' -> 24*2^30; a bare number is bytes, from 1 MiB up (below it, a missing unit)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(text), re.ASCII)
    if not m or m.group(2).lower() not in _BYTE_MULT:
        raise KvwallError(f"bad {what} {text!r}: write e.g. 80GB, 24GiB or 512MB")
    value = float(m.group(1)) * _BYTE_MULT[m.group(2).lower()]
    if value > MAX_BYTES:
        raise KvwallError(f"bad {what} {_short(str(text))!r}: more than an exbibyte; write e.g. 80GB")
    value = int(value)
    if value <= 0:
        unit = "" if m.group(2) else " (a bare number is bytes: write e.g. 80GB)"
        raise KvwallError(f"bad {what} {text!r}: it must be at least 1 byte{unit}")
    if not m.group(2) and value < BARE_MIN:
        raise KvwallError(f"bad {what} {text!r}: a bare number is bytes ({value:,} B), surely not what was meant; "
                          f"give a unit, e.g. {m.group(1)}GB or {m.group(1)}GiB")
    return value


def fmt_bytes(n: float, digits: int = 1) -> str:
    """IEC units: 131072 -> '128 KiB', 70272 -> '68.6 KiB'."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            if unit == "B":
                return f"{int(n)} B"
            text = f"{n:.{digits}f}".rstrip("0").rstrip(".")
            return f"{text} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def fmt_tokens(n: int) -> str:
    """131072 -> '128k', 1048576 -> '1M', 5000 -> '5000'."""
    for suffix, mult in (("M", 1 << 20), ("k", 1 << 10)):
        if n >= mult and n % mult == 0:
            return f"{n // mult}{suffix}"
    if n >= 1 << 20:
        return f"{n / (1 << 20):.2f}M"
    return str(n)


def fmt_count(n: float) -> str:
    """Parameter counts: 8030261248 -> '8.03B'."""
    for suffix, mult in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= mult:
            return f"{n / mult:.3g}{suffix}" if n / mult < 100 else f"{n / mult:.0f}{suffix}"
    return str(int(n))


# -- option types: argparse `type=` functions, so a bad number is refused before any work ------------
# Each raises argparse.ArgumentTypeError; the CLI prints it as one line naming the option, exit status 2.

def whole(lo: int, hi: int = MAX_COUNT) -> Callable[[str], int]:
    """A whole number from lo to hi (a 23-digit seed or 0 blocks is refused here, not deep in the engine)."""
    def parse(text: str) -> int:
        digits = str(text).strip()
        try:
            if not ascii_digits(digits.removeprefix("-")):  # int() would also take '٣' (as 3) and '1_000'
                raise ValueError
            value = int(digits)  # (ValueError past 4,300 digits too)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a whole number (got {_short(str(text))!r})") from None
        if not lo <= value <= hi:
            span = f"at least {lo}" if value < lo else f"at most {hi:,}"
            raise argparse.ArgumentTypeError(f"must be {span} (got {_short(text)})")
        return value
    parse.__name__ = "whole number"
    return parse


def threads_arg(text: str) -> int | str:
    """--threads: a whole number of threads, or auto (the engine's ThreadGovernor picks each decode step's count)."""
    return "auto" if str(text).strip() == "auto" else whole(1, 1 << 16)(text)


threads_arg.__name__ = "thread count"


def real(lo: float, hi: float = math.inf, *, lo_open: bool = False, hi_open: bool = False) -> Callable[[str], float]:
    """A finite number in [lo, hi] (an end excluded where *_open): never nan, never inf."""
    left, right = "(" if lo_open else "[", ")" if hi_open else "]"

    def parse(text: str) -> float:
        try:
            value = float(str(text).strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number (got {text!r})") from None
        inside = (lo < value if lo_open else lo <= value) and (value < hi if hi_open else value <= hi)
        if not math.isfinite(value) or not inside:
            above = f"{'above' if lo_open else 'at least'} {lo:g}"
            span = f"in {left}{lo:g}, {hi:g}{right}" if math.isfinite(hi) else above
            raise argparse.ArgumentTypeError(f"must be a finite number {span} (got {_short(text)})")
        return value
    parse.__name__ = "number"
    return parse


def nonempty(text: str, default: bool = True) -> str:
    """Any free-text option's value (a name, a path, a list): '' or blanks must not pass for 'not given', which
    ran the default silently (`quality --cache ''` ran all seven strategies for four minutes). `default`: the
    option has one to fall back on when left out."""
    if not str(text).strip():
        raise argparse.ArgumentTypeError("is empty; give a value" + (", or leave the option out for its default"
                                                                      if default else ""))
    return text


def one_of(names: Iterable[str]) -> Callable[[str], str]:
    """One name from a fixed list (case-insensitive); the error lists them."""
    known = list(names)

    def parse(text: str) -> str:
        key = str(text).strip().lower()
        if key not in known:
            raise argparse.ArgumentTypeError(f"must be one of {', '.join(known)} (got {text!r})")
        return key
    parse.__name__ = "name"
    return parse


def _short(text: str) -> str:
    return text if len(text) <= 24 else text[:21] + "..."


def seconds_arg(text: str) -> float:
    """A positive time option: '1s', '100ms', '250us', '0.5' (seconds) -> seconds."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?(?:e-?\d+)?)\s*(us|ms|s)?\s*", str(text), re.ASCII)
    if not m or not 0 < float(m.group(1)) < 1e9:
        raise argparse.ArgumentTypeError(f"must be a positive time such as 1s or 100ms (got {_short(str(text))!r})")
    return float(m.group(1)) / {"us": 1e6, "ms": 1e3}.get(m.group(2), 1)


def tokens_arg(text: str) -> int:
    """A token count option (--window 4k): as parse_tokens, refused by the parser."""
    try:
        return parse_tokens(text)
    except KvwallError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def ids_arg(text: str) -> str:
    """Comma-separated token ids (0 or more each, at least one); kept as text for the command to split."""
    parts = [p for p in str(text).replace(" ", "").split(",") if p]
    if not parts or not all(ascii_digits(p) and len(p) <= 12 for p in parts):
        raise argparse.ArgumentTypeError(f"must be comma-separated integers (token ids >= 0), e.g. 1,2,3 "
                                         f"(got {_short(text)!r})")
    return text
