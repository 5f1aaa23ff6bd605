"""Without Debian's pgbouncer the pooler tests skip on a laptop and fail in CI, as the browser tests do."""

from __future__ import annotations

import pgbouncer
import pytest


def _no_binary(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pgbouncer.shutil, "which", lambda name: None)
    monkeypatch.setattr(pgbouncer.os.path, "exists", lambda path: False)


def test_a_missing_pgbouncer_skips_outside_ci_naming_the_install(monkeypatch: pytest.MonkeyPatch) -> None:
    _no_binary(monkeypatch)
    monkeypatch.setenv("CI", "")
    with pytest.raises(pytest.skip.Exception, match="apt-get install -y pgbouncer"):
        pgbouncer._binary()


def test_a_missing_pgbouncer_fails_in_ci(monkeypatch: pytest.MonkeyPatch) -> None:
    _no_binary(monkeypatch)
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="apt-get install -y pgbouncer"):
        pgbouncer._binary()
