"""benchmarks/native_django.py runs alone and prints django_send_ratio as the last JSON line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.integration,
    pytest.mark.needs_session(
        "the benchmark's Django test runner creates and drops a database, which PgBouncer's idle connections hold"
    ),
]

BENCHMARK = Path(__file__).resolve().parents[3] / "benchmarks" / "native_django.py"


def test_the_benchmark_prints_the_ratio_of_the_sending_view_to_the_plain_one(database_url):
    done = subprocess.run(
        [sys.executable, str(BENCHMARK), "--rounds", "1", "--seconds", "0.3", "--broker", "postgres"],
        env={**os.environ, "DATABASE_URL": database_url},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert 0 < result["django_send_ratio"] < 2
    assert result["django_send_per_s"] > 0 and result["django_plain_per_s"] > 0
