"""The docs site: the CLI reference is the parser's, and the middleware order is written once."""

from __future__ import annotations

import argparse
import importlib.util
import re
from pathlib import Path

import pytest

from dramatiq_reliable.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


def _hook():
    spec = importlib.util.spec_from_file_location("cli_reference", DOCS / "_hooks" / "cli_reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _parsers(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, (*path, name))


def test_the_cli_reference_has_every_command_and_every_option_of_the_parser():
    page = _hook().render()
    for path, parser in _parsers(build_parser()):
        assert f"`{' '.join(('dramatiq-reliable', *path))}`" in page, path
        for action in parser._actions:
            for option in action.option_strings:
                if action.help != argparse.SUPPRESS:
                    assert option in page, (path, option)
    assert "DATABASE_URL" in page
    assert "exit codes:" in page


def test_the_cli_reference_is_the_same_whatever_the_environment(monkeypatch: pytest.MonkeyPatch):
    hook = _hook()
    monkeypatch.delenv("DATABASE_URL", raising=False)
    monkeypatch.delenv("RABBITMQ_URL", raising=False)
    plain = hook.render()
    monkeypatch.setenv("DATABASE_URL", "postgresql://app:Secret123@db.internal:5432/app")
    monkeypatch.setenv("RABBITMQ_URL", "amqp://app:Secret123@mq.internal:5672/%2F")
    monkeypatch.setenv("COLUMNS", "40")
    assert hook.render() == plain
    assert "db.internal" not in plain


def test_the_cli_page_is_filled_in_by_the_hook():
    hook = _hook()
    source = (DOCS / "cli.md").read_text()
    assert hook.MARKER in source
    assert hook.MARKER not in hook.on_page_markdown(source, page=None)


def test_the_middleware_order_is_written_in_one_place_and_every_page_that_builds_a_list_links_to_it():
    arrow_lists = re.compile(r"→.*ClassifiedRetries|ClassifiedRetries.*←")
    builders = re.compile(r"build_middleware\(|middleware=\[")
    for page in sorted(DOCS.rglob("*.md")):
        text = page.read_text()
        name = page.relative_to(DOCS).as_posix()
        if name == "middleware-order.md":
            assert arrow_lists.search(text)
            continue
        assert not arrow_lists.search(text), f"{name} writes the middleware order; link to middleware-order.md"
        if builders.search(text):
            assert "middleware-order.md" in text, f"{name} builds a middleware list without linking to the order"


def test_every_page_is_in_the_site_navigation():
    nav = (ROOT / "mkdocs.yml").read_text()
    for page in sorted(DOCS.rglob("*.md")):
        name = page.relative_to(DOCS).as_posix()
        assert f" {name}" in nav, f"{name} is not in mkdocs.yml's nav"
