"""Terminal output: rich tables, and a plain fallback when stdout is not a terminal."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable
from typing import Any


def console():
    from rich.console import Console

    return Console(highlight=False, soft_wrap=False, width=None if sys.stdout.isatty() else 200)


def table(title: str, columns: Iterable[str], rows: Iterable[Iterable[Any]], caption: str | None = None,
          justify_first_left: bool = True):
    from rich.table import Table

    t = Table(title=title, caption=caption, title_justify="left", caption_justify="left")
    for i, col in enumerate(columns):
        t.add_column(col, justify="left" if (i == 0 and justify_first_left) else "right")
    for row in rows:
        t.add_row(*[str(x) for x in row])
    return t


def print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, default=_default) + "\n")


def _default(obj: Any) -> Any:
    if hasattr(obj, "as_dict"):
        return obj.as_dict()
    if isinstance(obj, float) and obj != obj:
        return None
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")
