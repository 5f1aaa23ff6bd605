"""How every command prints: one table renderer, one age format, ``--json``, counted nouns.

Command output goes to stdout; errors (through :func:`~dramatiq_reliable.cli.common.print_error`),
progress and logs go to stderr, so ``dramatiq-reliable ... --json | jq`` always reads clean JSON.
"""

from __future__ import annotations

import datetime
import json
import shutil
import sys
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

from .._util import format_age

__all__ = ["Record", "age", "ago", "count", "labelled", "print_json", "print_rows", "print_table", "table"]


class Record(Protocol):
    """A row a listing prints: the library's frozen records, each with ``asdict()`` for ``--json``."""

    def asdict(self) -> dict[str, Any]: ...


R = TypeVar("R", bound=Record)


def table(
    headers: Sequence[str],
    rows: Sequence[Sequence[str]],
    *,
    right: Sequence[int] = (),
    max_width: int | None = None,
    fit_last: bool = False,
) -> str:
    """Rows as aligned columns under ``headers``.

    ``right`` lists the columns aligned right (numbers); ``max_width`` cuts every column but the
    last to that many characters; ``fit_last`` cuts the last column to the terminal's width
    (long error messages), so each row stays one line.
    """
    columns = len(headers)
    widths = [len(header) for header in headers]
    for row in rows:
        for index, cell in enumerate(row):
            widths[index] = max(widths[index], len(cell))
    if max_width is not None:
        widths = [min(width, max_width) for width in widths[:-1]] + widths[-1:]
    if fit_last:
        terminal = shutil.get_terminal_size((160, 24)).columns
        used = sum(widths[:-1]) + 2 * (columns - 1)
        widths[-1] = min(widths[-1], max(terminal - used, 20))

    def line(cells: Sequence[str]) -> str:
        parts = []
        for index, cell in enumerate(cells):
            text = _cut(cell, widths[index])
            parts.append(text.rjust(widths[index]) if index in right else text.ljust(widths[index]))
        return "  ".join(parts).rstrip()

    return "\n".join(line(row) for row in (headers, *rows))


def print_table(headers: Sequence[str], rows: Sequence[Sequence[str]], **options: Any) -> None:
    """:func:`table` on stdout."""
    sys.stdout.write(table(headers, rows, **options) + "\n")


def print_rows(
    rows: Sequence[R],
    *,
    as_json: bool,
    empty: str,
    headers: Sequence[str],
    cells: Callable[[R], Sequence[str]],
    right: Sequence[int] = (),
) -> None:
    """A listing: every row's ``asdict()`` as JSON (``[]`` when none), else ``empty`` or a table.

    The table's last column (an error, a free text) is cut to the terminal, so a row stays one line.
    """
    if as_json:
        print_json([row.asdict() for row in rows])
    elif not rows:
        print(empty)
    else:
        print_table(headers, [cells(row) for row in rows], right=right, fit_last=True)


def labelled(lines: Sequence[tuple[str, str]]) -> str:
    """One record for people: a ``label  value`` line each, the values lined up in one column."""
    width = max(len(label) for label, _ in lines)
    return "\n".join(f"{label.ljust(width)}  {value}" for label, value in lines)


def _cut(text: str, width: int) -> str:
    return text if len(text) <= width else text[: max(width - 1, 0)] + "…"


def age(seconds: float | None) -> str:
    """A duration for people (``4.2s``, ``75s``, ``12m``, ``3.5h``, ``2.0d``; ``-`` when unknown)."""
    return format_age(seconds)


def ago(then: datetime.datetime, now: datetime.datetime | None = None) -> str:
    """How long ago ``then`` was, in :func:`age`'s format."""
    now = now or datetime.datetime.now(datetime.timezone.utc)
    return format_age(max((now - then).total_seconds(), 0.0))


def count(number: int, singular: str, plural: str | None = None) -> str:
    """``1 row``, ``2 rows``, ``1,500 messages``: a number and its noun, agreeing."""
    return f"{number:,} {singular if number == 1 else plural or singular + 's'}"


def print_json(data: Any) -> None:
    """``data`` as indented JSON on stdout (dates and other values as strings)."""
    sys.stdout.write(json.dumps(data, indent=2, default=str, ensure_ascii=False) + "\n")
