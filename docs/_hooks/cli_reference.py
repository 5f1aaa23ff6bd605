"""MkDocs hook: the command-line reference, generated from ``dramatiq_reliable.cli.build_parser()``.

``docs/cli.md`` holds a ``<!-- cli-reference -->`` marker; at build time it is replaced by every
command's ``--help``, so the page cannot drift from the parser.  The help is rendered with the
environment variables unset and a fixed width, so the page is the same on every machine.
"""

from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import Iterator
from typing import Any

MARKER = "<!-- cli-reference -->"
WIDTH = "100"


@contextlib.contextmanager
def _neutral_environment() -> Iterator[None]:
    """No DATABASE_URL/RABBITMQ_URL (the help shows the URL in effect) and a fixed width."""
    saved = {name: os.environ.get(name) for name in ("DATABASE_URL", "RABBITMQ_URL", "COLUMNS")}
    os.environ.pop("DATABASE_URL", None)
    os.environ.pop("RABBITMQ_URL", None)
    os.environ["COLUMNS"] = WIDTH
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    """Every command of ``parser``, depth first: ``(("dead-letters", "replay"), sub_parser)``."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from commands(sub, (*path, name))


def render() -> str:
    """The reference as Markdown: one section per command, its help verbatim."""
    from dramatiq_reliable.cli import build_parser

    with _neutral_environment():
        parser = build_parser()
        sections = []
        for path, sub in commands(parser):
            title = " ".join(("dramatiq-reliable", *path))
            level = "#" * min(2 + max(len(path) - 1, 0), 4)
            sections.append(f"{level} `{title}`\n\n```text\n{sub.format_help().rstrip()}\n```\n")
    return "\n".join(sections)


def on_page_markdown(markdown: str, page: Any, **kwargs: Any) -> str:
    if MARKER not in markdown:
        return markdown
    return markdown.replace(MARKER, render())
