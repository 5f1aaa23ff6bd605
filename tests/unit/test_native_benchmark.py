"""benchmarks/native.py: its command line parses and refuses what cannot run (nothing is timed here)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "native.py"


@pytest.fixture(scope="module")
def native() -> ModuleType:
    spec = importlib.util.spec_from_file_location("native_benchmark", BENCHMARK)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_defaults_measure_the_outbox_broker_with_django(native: ModuleType) -> None:
    args = native.parse_args([])
    assert (args.rounds, args.sends, args.batch, args.broker, args.no_django) == (5, 1000, 50, "outbox", False)


@pytest.mark.parametrize("argv", [["--rounds", "0"], ["--batch", "0"], ["--sends", "10", "--batch", "20"]])
def test_impossible_runs_are_refused(native: ModuleType, argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        native.parse_args(argv)


def test_each_round_alternates_the_ways_and_counts_every_send(native: ModuleType) -> None:
    calls: list[tuple[str, int]] = []

    class Fake:
        def __getattr__(self, way: str):  # type: ignore[no-untyped-def]
            def run(count: int) -> float:
                calls.append((way, count))
                return 0.5

            return run

    rates = native.measure_round(Fake(), sends=120, batch=50)
    assert set(rates) == set(native.WAYS)
    n = len(native.WAYS)
    assert [way for way, _ in calls[:n]] == list(native.WAYS)
    assert [way for way, _ in calls[n : 2 * n]] == list(native.WAYS[1:] + native.WAYS[:1])  # the order rotates
    for way in native.WAYS:
        assert sum(count for name, count in calls if name == way) == 120
        assert rates[way] == 120 / (0.5 * 3)  # three slices of 0.5 s each
