"""``make test`` installs once, then only when pyproject.toml changes, and checks the formatting."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")


def _planned(checkout: Path, target: str) -> str:
    """What ``make -n target`` would run in ``checkout`` (a dry run: nothing is installed).

    Run from ``make test`` itself (CI), a nested make prints "make[1]: Entering directory ..." with
    the checkout's path first: the outer make's variables are left out, and so is that line.
    """
    outer = {"MAKEFLAGS", "MAKELEVEL", "MFLAGS", "MAKEOVERRIDES"}
    result = subprocess.run(
        ["make", "--no-print-directory", "-n", "-f", str(ROOT / "Makefile"), target],
        cwd=checkout,
        env={key: value for key, value in os.environ.items() if key not in outer},
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    return result.stdout


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    """A checkout whose .venv exists and was installed after pyproject.toml last changed."""
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    (tmp_path / ".venv" / "bin").mkdir(parents=True)
    (tmp_path / ".venv" / "bin" / "python").touch()
    (tmp_path / ".venv" / ".dev-installed").touch()
    _set_mtime(tmp_path / "pyproject.toml", 1_000_000_000)
    _set_mtime(tmp_path / ".venv" / ".dev-installed", 1_000_000_100)
    return tmp_path


def _set_mtime(path: Path, seconds: int) -> None:
    os.utime(path, (seconds, seconds))


def test_an_installed_checkout_is_not_installed_again(checkout: Path) -> None:
    plan = _planned(checkout, "test")
    assert "pip install" not in plan
    assert "pytest -q" in plan


def test_a_changed_pyproject_installs_again(checkout: Path) -> None:
    _set_mtime(checkout / "pyproject.toml", 1_000_000_200)
    assert "pip install -q -e '.[dev]'" in _planned(checkout, "test")


def test_a_fresh_checkout_creates_the_virtualenv_and_installs(tmp_path: Path) -> None:
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    plan = _planned(tmp_path, "test")
    assert "-m venv .venv" in plan
    assert "pip install -q -e '.[dev]'" in plan


def test_make_test_checks_lint_formatting_and_types_before_the_tests(checkout: Path) -> None:
    plan = _planned(checkout, "test").splitlines()
    steps = [
        next(i for i, line in enumerate(plan) if word in line)
        for word in ("bin/ruff check", "bin/ruff format --check", "bin/mypy", "bin/pytest")
    ]
    assert steps == sorted(steps)
