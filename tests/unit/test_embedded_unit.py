"""EmbeddedPostgres refuses a data directory it would take from someone else, before touching it."""

from __future__ import annotations

from pathlib import Path

import pytest

from dramatiq_reliable import ConfigurationError
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
