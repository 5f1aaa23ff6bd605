"""Every fenced Python block of the docs and the README runs, against the real services.

A page's blocks run in order in one namespace (a reader assumes they build on each other), on a
database of the page's own: the docs use the default schema (``dramatiq_reliable``) and plain
table names (``orders``), so only a fresh database isolates a page without rewriting what the
reader reads.  The URLs the docs write are replaced with that database's and ``RABBITMQ_URL``;
``DATABASE_URL`` and ``RABBITMQ_URL`` in the environment point at them too, for pages that read
them.  After the page, failed or not, its brokers are closed, Dramatiq's global broker, the
declared schedules and the event listeners are put back, the database is dropped and every queue
the page declared is deleted (the ``queues`` fixture).  Blocks marked ``<!-- fragment ... -->``
are not run (tests/docs_snippets.py; docs/testing.md).
"""

from __future__ import annotations

import contextlib
import doctest
import traceback
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dramatiq
import dramatiq.broker
import psycopg
import pytest
from docs_snippets import (
    APP_TABLES,
    DOC_DATABASE_URLS,
    DOC_RABBITMQ_URLS,
    PAGES,
    ROOT,
    Block,
    python_blocks,
    substitute,
)

from dramatiq_reliable import events, schema
from dramatiq_reliable.scheduler import default_registry

RUNNABLE = [page for page in PAGES if any(block.runs for block in python_blocks(page))]


@pytest.fixture
def page_database(database_url: str) -> Iterator[str]:
    """A database of the page's own on the test server, as a reader's is when they read the page:
    migrated, with the example app's tables; dropped afterwards (its connections too)."""
    name = f"docs_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(database_url, autocommit=True) as admin:
        admin.execute(psycopg.sql.SQL("CREATE DATABASE {}").format(psycopg.sql.Identifier(name)))
    try:
        url = psycopg.conninfo.make_conninfo(database_url, dbname=name)
        schema.migrate(url)
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(APP_TABLES)
        yield url
    finally:
        with psycopg.connect(database_url, autocommit=True) as admin:
            admin.execute(
                psycopg.sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(psycopg.sql.Identifier(name))
            )


@pytest.fixture
def isolated_globals() -> Iterator[None]:
    """A process as a reader's starts (no global broker, no schedules declared); afterwards Dramatiq's
    global broker, the declared schedules and the event listeners as they were before."""
    broker = dramatiq.broker.global_broker
    schedules = list(default_registry)
    listeners = events._listeners
    dramatiq.broker.global_broker = None
    default_registry.clear()
    try:
        yield
    finally:
        dramatiq.broker.global_broker = broker
        default_registry.clear()
        for item in schedules:
            default_registry.add(item)
        events._listeners = listeners


def _run(block: Block, code: str, namespace: dict[str, Any]) -> None:
    if block.language == "pycon":
        test = doctest.DocTestParser().get_doctest(code, namespace, block.where, str(block.page), block.line)
        runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
        runner.run(test, clear_globs=False)
        assert not runner.failures, f"{block.where}: the doctest's output differs (see the report above)"
        return
    # Blank lines before the code keep the tracebacks' line numbers those of the page.
    exec(compile("\n" * block.line + code, str(block.page), "exec"), namespace)


def _page_traceback(error: BaseException, block: Block) -> str:
    """The traceback from the page's own lines down (the runner's frames say nothing to a writer)."""
    frames = traceback.extract_tb(error.__traceback__)
    ours = [index for index, frame in enumerate(frames) if frame.filename == str(block.page)]
    shown = traceback.StackSummary.from_list(frames[ours[0] :] if ours else frames)
    return "".join(["Traceback (most recent call last):\n", *shown.format(), *traceback.format_exception_only(error)])


def _close(namespace: dict[str, Any]) -> None:
    """Close what the page opened (brokers and their pools) before its database is dropped."""
    for value in namespace.values():
        if isinstance(value, dramatiq.Broker):
            # A broker that cannot close must not hide the page's own error.
            with contextlib.suppress(Exception):
                value.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("page", RUNNABLE, ids=lambda page: page.relative_to(ROOT).as_posix())
def test_the_python_blocks_of_the_page_run_in_order(
    page: Path,
    page_database: str,
    rabbitmq_url: str,
    isolated_globals: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    replacements = {**dict.fromkeys(DOC_DATABASE_URLS, page_database), **dict.fromkeys(DOC_RABBITMQ_URLS, rabbitmq_url)}
    monkeypatch.setenv("DATABASE_URL", page_database)
    monkeypatch.setenv("RABBITMQ_URL", rabbitmq_url)
    namespace: dict[str, Any] = {"__name__": "__docs__"}
    failure = None
    try:
        for block in python_blocks(page):
            if not block.runs:
                continue
            try:
                _run(block, substitute(block.code, replacements), namespace)
            except Exception as error:
                failure = f"the block at {block.where} fails:\n\n{block.code}\n{_page_traceback(error, block)}"
                break
    finally:
        _close(namespace)
    if failure is not None:
        pytest.fail(
            f"{failure}\nFix the block, or if it cannot run mark it with '<!-- fragment: why -->' on the line "
            "before its fence (docs/testing.md).",
            pytrace=False,
        )
