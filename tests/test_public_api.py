"""The public surface is deliberate: a name is added to or removed from it in three places at once.

The public modules are every module of the package tree: ``dramatiq_reliable``, its sub-packages
and every ``.py`` in them, except the private ones (``_x``, at any level), ``cli/`` (the command
line is documented by its ``--help``) and ``__main__``.  Each has an ``__all__`` (empty for a
module whose names are all internal), sorted, holding only names the module defines or, for a
package, deliberately re-exports from the package.  Together they must match
``tests/public_api.txt`` (one ``module.name`` a line) and each name must be documented in
``docs/api.md``, under the module's heading.  Needs no service.
"""

from __future__ import annotations

import ast
import importlib
import importlib.metadata
import inspect
import pkgutil
import re
import types
from pathlib import Path

import pytest

import dramatiq_reliable

ROOT = Path(__file__).resolve().parent.parent
LIST = ROOT / "tests" / "public_api.txt"
DOCS = ROOT / "docs" / "api.md"


def _public_modules() -> list[types.ModuleType]:
    """Every module of the package tree but the private ones, the command line and ``__main__``."""
    modules = [dramatiq_reliable]
    for info in pkgutil.walk_packages(dramatiq_reliable.__path__, prefix="dramatiq_reliable."):
        parts = info.name.split(".")[1:]
        if parts[0] == "cli" or any(part.startswith("_") for part in parts):
            continue
        modules.append(importlib.import_module(info.name))
    return modules


MODULES = _public_modules()


def _exported() -> set[str]:
    return {f"{module.__name__}.{name}" for module in MODULES for name in getattr(module, "__all__", [])}


def _listed() -> set[str]:
    lines = (line.strip() for line in LIST.read_text(encoding="utf-8").splitlines())
    return {line for line in lines if line and not line.startswith("#")}


def _documented() -> dict[str, set[str]]:
    """The names of the ``- `Name` ...`` entries under each ``## `module``` heading of docs/api.md."""
    sections: dict[str, set[str]] = {}
    current: set[str] | None = None
    for line in DOCS.read_text(encoding="utf-8").splitlines():
        heading = re.match(r"^## `([\w.]+)`", line)
        if heading:
            current = sections.setdefault(heading.group(1), set())
        elif current is not None:
            entry = re.match(r"^- `(\w+)`", line)
            if entry:
                current.add(entry.group(1))
    return sections


def _isort_style(name: str) -> tuple[int, str]:
    """The order ruff's RUF022 keeps: CONSTANTS, then Classes, then functions."""
    return (0 if name.isupper() else 1 if name[:1].isupper() else 2, name)


def test_every_public_module_has_an_all_of_names_only_sorted() -> None:
    for module in MODULES:
        names = getattr(module, "__all__", None)
        assert names is not None, f"{module.__name__} has no __all__: add one to {module.__file__}"
        assert list(names) == sorted(names, key=_isort_style), (
            f"{module.__name__}.__all__ is not sorted: sort it in {module.__file__} (ruff check --fix does)"
        )
        assert len(set(names)) == len(names), f"{module.__name__}.__all__ repeats a name"
        for name in names:
            assert hasattr(module, name), f"{module.__name__}.__all__ lists {name!r}, which it does not define"
            value = getattr(module, name)
            assert not isinstance(value, types.ModuleType), (
                f"{module.__name__}.__all__ lists the module {name!r}: __all__ holds names only "
                "(sub-modules stay importable without it)"
            )


def _top_level_names(module: types.ModuleType) -> tuple[set[str], set[str]]:
    """The names ``module``'s source defines at top level, and those it imports from the package."""
    assert module.__file__ is not None
    tree = ast.parse(Path(module.__file__).read_text(encoding="utf-8"))
    defined: set[str] = set()
    imported: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.add(node.name)
        elif isinstance(node, ast.Assign):
            defined.update(target.id for target in node.targets if isinstance(target, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            defined.add(node.target.id)
        elif isinstance(node, ast.ImportFrom) and node.level > 0:  # from .x import Name: our own code
            imported.update(alias.asname or alias.name for alias in node.names)
    return defined, imported


def test_every_public_name_is_defined_by_its_module_or_re_exported_by_its_package() -> None:
    """A module lists what it defines; only a package (``__init__``) lists names it imports, its
    deliberate re-exports, and only from this package's own code."""
    for module in MODULES:
        defined, imported = _top_level_names(module)
        is_package = hasattr(module, "__path__")
        for name in module.__all__:
            if name in defined:
                continue
            assert is_package, (
                f"{module.__name__}.__all__ lists {name!r}, which it imports: list a name in the module that "
                "defines it, and re-export it from the package's __init__"
            )
            assert name in imported, (
                f"{module.__name__}.__all__ lists {name!r}, which it neither defines nor imports from this package"
            )


def test_the_error_module_lists_every_error_it_defines() -> None:
    from dramatiq_reliable import errors

    defined = sorted(
        name
        for name, value in vars(errors).items()
        if inspect.isclass(value) and issubclass(value, BaseException) and value.__module__ == "dramatiq_reliable"
    )
    assert sorted(errors.__all__) == defined


def test_the_public_names_are_the_checked_in_list() -> None:
    exported, listed = _exported(), _listed()
    added, removed = sorted(exported - listed), sorted(listed - exported)
    assert not added and not removed, (
        "the public surface changed: "
        + (f"new names {added}: add them to tests/public_api.txt and document them in docs/api.md; " if added else "")
        + (
            f"names gone {removed}: remove them from tests/public_api.txt and docs/api.md (and say so in CHANGELOG.md)"
            if removed
            else ""
        )
    )


def test_every_public_name_is_documented_in_docs_api_md() -> None:
    documented = _documented()
    missing = []
    for qualified in sorted(_exported()):
        module, _, name = qualified.rpartition(".")
        if name not in documented.get(module, set()):
            missing.append(qualified)
    assert not missing, (
        f"not documented in docs/api.md: {missing}; add each as a line '- `Name` (kind): what it is for' under the heading '## `module`' of its module"
    )
    modules = {module.__name__: module for module in MODULES}
    stale = sorted(
        f"{module}.{name}"
        for module, names in documented.items()
        for name in names
        if module in modules and not hasattr(modules[module], name)
    )
    assert not stale, f"docs/api.md documents names that no longer exist: {stale}; remove them from docs/api.md"


def test_every_public_module_has_its_heading_in_docs_api_md() -> None:
    """Also a module with no public names: its heading says so, and where to look instead."""
    documented = _documented()
    missing = [module.__name__ for module in MODULES if module.__name__ not in documented]
    assert not missing, f"docs/api.md has no heading '## `module`' for {missing}"
    unknown = sorted(set(documented) - {module.__name__ for module in MODULES})
    assert not unknown, f"docs/api.md has headings for modules that are not public modules: {unknown}"


def _public_errors() -> list[type[BaseException]]:
    found: dict[str, type[BaseException]] = {}
    for module in [*MODULES, importlib.import_module("dramatiq_reliable.errors")]:
        for name in getattr(module, "__all__", []):
            value = getattr(module, name)
            if inspect.isclass(value) and issubclass(value, BaseException):
                found[f"{module.__name__}.{name}"] = value
    return [found[key] for key in sorted(found)]


@pytest.mark.parametrize("error", _public_errors(), ids=lambda error: error.__name__)
def test_every_public_error_is_a_reliable_error_of_the_public_package(error: type[BaseException]) -> None:
    """Stored error types and fingerprints name the public package, whatever module defines the class."""
    assert issubclass(error, dramatiq_reliable.ReliableError), f"{error!r} must subclass ReliableError (errors.py)"
    assert error.__module__ == "dramatiq_reliable", f"{error!r}: set __module__ = 'dramatiq_reliable' (errors.py)"
    assert getattr(dramatiq_reliable, error.__name__) is error, f"export {error.__name__} from dramatiq_reliable"


def test_tracing_is_importable_from_the_package() -> None:
    from dramatiq_reliable import Tracing
    from dramatiq_reliable.tracing.middleware import Tracing as Defined

    assert Tracing is Defined


def test_the_version_is_the_installed_metadata_version() -> None:
    assert dramatiq_reliable.__version__ == importlib.metadata.version("dramatiq-reliable")
    assert dramatiq_reliable.__version__ != "0+unknown"
