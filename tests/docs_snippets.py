"""The fenced Python blocks of the docs and the README, as the snippet test runs them.

A page's ```` ```python ```` blocks run in order in one namespace, as a reader assumes they build
on each other; ```` ```pycon ```` blocks (``>>>`` prompts and their output) run as doctests in
the same namespace.  A block that cannot run (it needs Django, a web server, a provider's API)
is marked with an HTML comment that ends the last non-blank line before its fence (a line of its
own, or the end of the line that introduces the block, which keeps a list item whole); the
rendered site does not show it::

    <!-- fragment: needs a Django project -->
    ```python
    ...
    ```

The URLs the docs write (``postgresql://app@localhost/app`` ...) are replaced with the test's
own (see ``substitute``).  docs/testing.md describes the convention for writers.
"""

from __future__ import annotations

import dataclasses
import re
import textwrap
from collections.abc import Iterator, Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: The pages whose blocks are checked: the README and every page of the docs site.
PAGES = (ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")))

_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<ticks>`{3,}|~{3,})[ \t]*(?P<info>[^\n`]*)$")
_FRAGMENT = re.compile(r"<!--[ \t]*fragment(?:[ \t]*:[ \t]*(?P<why>.*?))?[ \t]*-->[ \t]*$")

#: The languages whose blocks run: plain Python, and interactive sessions checked by doctest.
RUN_LANGUAGES = ("python", "py", "pycon")

#: The database URLs the docs write for "your database".
DOC_DATABASE_URLS = ("postgresql://app@localhost/app", "postgresql://app@db/app")
#: The RabbitMQ URLs the docs write for "your RabbitMQ".
DOC_RABBITMQ_URLS = ("amqp://guest:guest@localhost:5672",)

#: The example app's tables, as the pages use them (``orders``, ``invoices`` ...): a reader's
#: database has them, so the page's database does too.  The docs' own schema is there as well
#: (``dramatiq-reliable migrate``, which every page asks for first).
APP_TABLES = """
CREATE TABLE orders (
    id bigint PRIMARY KEY,
    total numeric,
    total_cents bigint,
    updated_at timestamptz NOT NULL DEFAULT now()
);
CREATE TABLE invoices (order_id bigint PRIMARY KEY, amount_cents bigint);
CREATE TABLE order_totals (order_id bigint PRIMARY KEY, total numeric);
"""


@dataclasses.dataclass(frozen=True)
class Block:
    """One fenced block of a page: its language, its code (dedented), where it starts and whether it
    is marked as a fragment (and why)."""

    page: Path
    line: int  #: the line of the opening fence, 1-based
    language: str
    code: str
    fragment: str | None  #: the reason given in the marker ("" when none), None when the block runs

    @property
    def where(self) -> str:
        page = self.page.relative_to(ROOT) if self.page.is_relative_to(ROOT) else self.page
        return f"{page.as_posix()}:{self.line}"

    @property
    def runs(self) -> bool:
        return self.language in RUN_LANGUAGES and self.fragment is None


def blocks(page: Path) -> list[Block]:
    """Every fenced block of ``page`` (of any language), in order."""
    return list(_blocks(page))


def _blocks(page: Path) -> Iterator[Block]:
    lines = page.read_text(encoding="utf-8").splitlines()
    index = 0
    while index < len(lines):
        opening = _FENCE.match(lines[index])
        if opening is None:
            index += 1
            continue
        indent, ticks = opening["indent"], opening["ticks"]
        language = opening["info"].split()[0].lower() if opening["info"].strip() else ""
        previous = next((line for line in reversed(lines[:index]) if line.strip()), "")
        marker = _FRAGMENT.search(previous)
        body: list[str] = []
        end = index + 1
        # The closing fence: the same characters, at least as many, nothing after them.
        closing = re.compile(rf"^[ \t]*{re.escape(ticks[0])}{{{len(ticks)},}}[ \t]*$")
        while end < len(lines) and not closing.match(lines[end]):
            body.append(lines[end][len(indent) :] if lines[end].startswith(indent) else lines[end].lstrip())
            end += 1
        yield Block(
            page=page,
            line=index + 1,
            language=language,
            code=textwrap.dedent("\n".join(body)) + "\n",
            fragment=(marker["why"] or "") if marker else None,
        )
        index = end + 1


def python_blocks(page: Path) -> list[Block]:
    """The blocks of ``page`` that are Python (run or marked as fragments)."""
    return [block for block in blocks(page) if block.language in RUN_LANGUAGES]


def substitute(code: str, replacements: Mapping[str, str]) -> str:
    """``code`` with every URL the docs write replaced by the one the test runs against; in a string
    literal, by a literal of it (a password may hold a quote)."""
    for written, actual in replacements.items():
        for quote in ('"', "'"):
            code = code.replace(f"{quote}{written}{quote}", repr(actual))
        code = code.replace(written, actual)
    return code
