"""benchmarks/end_to_end.py: its command line parses and its summary keeps the stable keys (nothing is timed here)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "end_to_end.py"


@pytest.fixture(scope="module")
def end_to_end() -> ModuleType:
    spec = importlib.util.spec_from_file_location("end_to_end_benchmark", BENCHMARK)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses and typing look the module up by name
    spec.loader.exec_module(module)
    return module


def test_help_names_every_flag(end_to_end: ModuleType, capsys: pytest.CaptureFixture[str]):
    with pytest.raises(SystemExit) as exit_info:
        end_to_end.parse_args(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--jobs", "--rounds", "--rate", "--latency-seconds", "--relay", "--producers", "--systems"):
        assert flag in out


def test_defaults_run_every_system_once_with_the_worker_relay(end_to_end: ModuleType):
    args = end_to_end.parse_args([])
    assert args.systems == list(end_to_end.SYSTEMS)
    assert (args.rounds, args.relay, args.producers) == (1, "worker", 1)


def test_more_producers_than_the_connection_budget_allows_are_refused(end_to_end: ModuleType):
    with pytest.raises(SystemExit):
        end_to_end.parse_args(["--producers", "3"])


def test_an_unknown_system_is_refused_with_the_choices(end_to_end: ModuleType, capsys: pytest.CaptureFixture[str]):
    with pytest.raises(SystemExit):
        end_to_end.parse_args(["--systems", "ours,celery"])
    assert "procrastinate" in capsys.readouterr().err


def test_the_summary_compares_ours_with_plain_and_the_best_peer(end_to_end: ModuleType):
    def system(e2d: float, drain: float) -> dict[str, float]:
        return {"enqueue_then_drain_per_s": e2d, "drain_per_s": drain, "latency_p50_ms": 2.0, "latency_p99_ms": 9.0}

    figures = {
        "ours": system(600, 1200),
        "plain": system(800, 1600),
        "pgqueuer": system(300, 900),
        "procrastinate": system(400, 500),
    }
    result = end_to_end.summary(figures, end_to_end.parse_args([]), [1.0, 2.0])
    assert result["ratio_to_plain"] == 0.75
    assert result["best_peer"] == "procrastinate"
    assert result["ratio_to_best_peer"] == 1.5
    assert result["drain_ratio_to_plain"] == 0.75
    assert result["latency_p99_ms"] == 9.0
    assert result["systems"] is figures


def test_a_missing_baseline_gives_no_ratio_rather_than_a_wrong_one(end_to_end: ModuleType):
    only_ours = {
        "ours": {"enqueue_then_drain_per_s": 600.0, "drain_per_s": 1.0, "latency_p50_ms": 1, "latency_p99_ms": 2}
    }
    result = end_to_end.summary(only_ours, end_to_end.parse_args([]), [0.0, 0.0])
    assert result["ratio_to_plain"] is None
    assert result["ratio_to_best_peer"] is None
    assert result["best_peer"] is None


def test_the_headline_ratios_are_the_median_of_paired_rounds_with_their_spread(end_to_end: ModuleType):
    # Round 2 ran while the machine was busy for both: its ratio is still a fair sample.
    per_round = {
        "ours": [{"drain_per_s": 900.0}, {"drain_per_s": 400.0}, {"drain_per_s": 1100.0}],
        "plain": [{"drain_per_s": 1000.0}, {"drain_per_s": 500.0}, {"drain_per_s": 1000.0}],
    }
    figures = {name: end_to_end.medians(rounds) for name, rounds in per_round.items()}
    result = end_to_end.summary(figures, end_to_end.parse_args(["--phases", "drain"]), [1.0, 1.0], per_round)
    assert result["drain_ratio_to_plain"] == 0.9
    assert result["drain_ratio_to_plain_spread"] == [0.8, 1.1]
    assert result["round_ratios"]["drain_ratio_to_plain"] == [0.9, 0.8, 1.1]
    assert result["ratio_to_plain"] is None  # the enqueue-then-drain phase did not run
    assert result["ratio_to_plain_spread"] is None


def test_paired_ratios_skip_a_round_that_lacks_the_figure(end_to_end: ModuleType):
    per_round = {"ours": [{"drain_per_s": 800.0}, {}], "plain": [{"drain_per_s": 1000.0}, {"drain_per_s": 900.0}]}
    assert end_to_end.paired_ratios(per_round, "ours", "plain", "drain_per_s") == [0.8]


def test_phases_are_chosen_by_name_and_kept_in_their_order(end_to_end: ModuleType):
    assert end_to_end.parse_args(["--phases", "latency,drain"]).phases == ["drain", "latency"]
    assert end_to_end.parse_args([]).phases == ["drain", "e2d", "latency"]


@pytest.mark.parametrize(
    "argv",
    [["--phases", "drain,warm"], ["--phases", ","], ["--warmup", "1000", "--jobs", "1000"], ["--processes", "5"]],
)
def test_bad_phases_warmup_or_processes_are_refused(end_to_end: ModuleType, argv: list[str]):
    with pytest.raises(SystemExit):
        end_to_end.parse_args(argv)


def test_the_ceiling_splits_the_gap_into_the_keys_statements_and_the_rest(end_to_end: ModuleType):
    per_round = {
        "ours": [{"drain_per_s": 600.0}],
        "plain_key": [{"drain_per_s": 800.0}],
        "plain": [{"drain_per_s": 1000.0}],
    }
    figures = {name: end_to_end.medians(rounds) for name, rounds in per_round.items()}
    result = end_to_end.summary(figures, end_to_end.parse_args(["--phases", "drain"]), [1.0, 1.0], per_round)
    assert result["drain_ceiling_ratio"] == 0.8
    assert result["drain_ratio_to_ceiling"] == 0.75
    assert result["drain_ratio_to_plain"] == 0.6
