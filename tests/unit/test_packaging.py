"""The declared licence ships: LICENSE holds the texts it names, and the wheel and the sdist carry it."""

from __future__ import annotations

import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LICENSE = ROOT / "LICENSE"
#: Debian's copies of the texts, where this machine has them.
COMMON_LICENSES = Path("/usr/share/common-licenses")


def _pyproject() -> dict:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: pytest brings tomli
        import tomli as tomllib
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))


def test_license_holds_the_lgpl_v3_then_the_gpl_v3_it_adds_its_permissions_to() -> None:
    """LGPL-3.0 is a set of permissions on top of GPL-3.0: the licence needs both texts."""
    assert _pyproject()["project"]["license"] == "LGPL-3.0-or-later"
    text = LICENSE.read_text(encoding="utf-8")
    lesser = text.index("GNU LESSER GENERAL PUBLIC LICENSE\n                       Version 3, 29 June 2007")
    general = text.index(
        "                    GNU GENERAL PUBLIC LICENSE\n                       Version 3, 29 June 2007"
    )
    assert lesser == text.index("GNU LESSER") and lesser < general
    assert text.rstrip().endswith("<https://www.gnu.org/licenses/why-not-lgpl.html>.")


@pytest.mark.skipif(not (COMMON_LICENSES / "GPL-3").exists(), reason="no /usr/share/common-licenses here")
def test_license_is_the_texts_verbatim() -> None:
    lgpl = (COMMON_LICENSES / "LGPL-3").read_text(encoding="utf-8")
    gpl = (COMMON_LICENSES / "GPL-3").read_text(encoding="utf-8")
    assert LICENSE.read_text(encoding="utf-8") == f"{lgpl}\n\n{gpl}"


def test_the_wheel_and_the_sdist_carry_the_license(tmp_path: Path) -> None:
    sdist_builder = pytest.importorskip("hatchling.builders.sdist")
    wheel_builder = pytest.importorskip("hatchling.builders.wheel")
    [wheel] = wheel_builder.WheelBuilder(str(ROOT)).build(directory=str(tmp_path), versions=["standard"])
    [sdist] = sdist_builder.SdistBuilder(str(ROOT)).build(directory=str(tmp_path), versions=["standard"])
    expected = LICENSE.read_bytes()
    with zipfile.ZipFile(wheel) as archive:
        [info] = [name for name in archive.namelist() if name.endswith(".dist-info/licenses/LICENSE")]
        assert archive.read(info) == expected
        [metadata] = [name for name in archive.namelist() if name.endswith(".dist-info/METADATA")]
        headers = archive.read(metadata).decode().split("\n\n", 1)[0].splitlines()
        assert "License-Expression: LGPL-3.0-or-later" in headers
        assert "License-File: LICENSE" in headers
    with tarfile.open(sdist) as archive:
        [member] = [m for m in archive.getmembers() if m.name.count("/") == 1 and m.name.endswith("/LICENSE")]
        extracted = archive.extractfile(member)
        assert extracted is not None and extracted.read() == expected
