"""The docs site: the CLI reference is the parser's, the middleware order is written once, and every
Python block is seen by the snippet test (which runs them: tests/integration/test_docs_snippets.py)."""

from __future__ import annotations

import argparse
import importlib.util
import re
from pathlib import Path

import docs_snippets
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


def test_every_python_block_of_the_docs_runs_or_is_a_fragment_that_says_why():
    """The snippet test (tests/integration/test_docs_snippets.py) sees every block a reader sees."""
    opening = re.compile(r"^[ \t]*(`{3,}|~{3,})[ \t]*(python|pycon|py)\b", re.IGNORECASE | re.MULTILINE)
    marker = re.compile(r"<!--\s*fragment")
    for page in docs_snippets.PAGES:
        text = page.read_text(encoding="utf-8")
        every = docs_snippets.blocks(page)
        found = docs_snippets.python_blocks(page)
        # Fences and markers shown as examples inside another block (docs/testing.md) are its text.
        quoted = "".join(block.code for block in every)
        fences = len(opening.findall(text)) - len(opening.findall(quoted))
        assert len(found) == fences, f"{page.name}: {fences} Python fences, the snippet test sees {len(found)}"
        for block in found:
            assert block.fragment != "", f"{block.where}: say why it is a fragment: '<!-- fragment: why -->'"
        markers = len(marker.findall(text)) - len(marker.findall(quoted))
        assert markers == sum(block.fragment is not None for block in found), (
            f"{page.name}: a '<!-- fragment -->' marker that no Python block follows (it ends the last non-blank "
            "line before the fence)"
        )
    assert sum(block.runs for page in docs_snippets.PAGES for block in docs_snippets.python_blocks(page)) > 30


def test_the_snippet_parser_dedents_list_blocks_and_finds_markers_before_the_fence(tmp_path: Path):
    page = tmp_path / "page.md"
    page.write_text(
        "Intro\n\n```python\nx = 1\n```\n\n"
        "1. A step: <!-- fragment: needs a mailer -->\n\n    ```python\n    mailer.send()\n    ```\n\n"
        '<!-- fragment -->\n````python title="t"\n```\n````\n\n'
        "```sh\necho no\n```\n\n```pycon\n>>> x + 1\n2\n```\n",
        encoding="utf-8",
    )
    found = docs_snippets.blocks(page)
    assert [(b.language, b.code, b.fragment, b.line) for b in found] == [
        ("python", "x = 1\n", None, 3),
        ("python", "mailer.send()\n", "needs a mailer", 9),
        ("python", "```\n", "", 14),
        ("sh", "echo no\n", None, 18),
        ("pycon", ">>> x + 1\n2\n", None, 22),
    ]
    assert [b.runs for b in found] == [True, False, False, False, True]


def test_the_snippet_urls_are_replaced_with_the_tests_own():
    code = 'OutboxBroker(url="amqp://guest:guest@localhost:5672", database="postgresql://app@localhost/app")'
    replaced = docs_snippets.substitute(
        code, {"postgresql://app@localhost/app": "dbname=docs_1", "amqp://guest:guest@localhost:5672": "amqp://t/v"}
    )
    assert replaced == "OutboxBroker(url='amqp://t/v', database='dbname=docs_1')"
    quoted = docs_snippets.substitute(
        "connect('postgresql://app@localhost/app')", {"postgresql://app@localhost/app": "a'b"}
    )
    assert quoted == 'connect("a\'b")'


def test_the_install_page_lists_every_extra_of_pyproject():
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: pytest brings tomli
        import tomli as tomllib
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["optional-dependencies"]
    page = (DOCS / "install.md").read_text(encoding="utf-8")
    listed = set(re.findall(r"^\| `([\w-]+)` \|", page, flags=re.MULTILINE))
    missing, unknown = sorted(set(extras) - listed), sorted(listed - set(extras))
    assert not missing, f"docs/install.md's table of extras lacks {missing}: add a row '| `name` | what for |'"
    assert not unknown, f"docs/install.md lists extras that pyproject.toml does not define: {unknown}"
