"""The test suite's own behaviour, run as a person runs it: pytest in a subprocess on a few tests.

A missing service is said once, plainly (one line: the service, the URL with its password masked,
the reason), and its tests fail without each retrying it under ``CI=true``, or are skipped on a
laptop.  Needs Postgres (the selection's other tests use it); RabbitMQ is pointed at a closed port.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

from docs_snippets import ROOT
from support import closed_port

SECRET = "Secret123"
#: Six tests that need RabbitMQ, and seven that need nothing.
SELECTION = ["tests/integration/test_retries_rabbitmq.py", "tests/unit/test_redact.py"]


def _pytest(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    environment = {key: value for key, value in os.environ.items() if not key.startswith("PYTEST_")}
    environment.update(env)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
        cwd=ROOT,
        env=environment,
        capture_output=True,
        text=True,
        timeout=240,
    )


def test_with_ci_a_missing_rabbitmq_is_one_line_and_its_tests_fail_without_trying_it(database_url):
    port = closed_port()
    result = _pytest(
        *SELECTION, CI="true", DATABASE_URL=database_url, RABBITMQ_URL=f"amqp://guest:{SECRET}@127.0.0.1:{port}/%2F"
    )
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    lines = result.stdout.strip().splitlines()
    assert [line for line in lines if "RabbitMQ" in line] == [
        f"RabbitMQ is not reachable at amqp://guest:***@127.0.0.1:{port}/%2F (connection refused): CI=true, so the "
        "6 tests that need it failed without running; start it, or point RABBITMQ_URL at it"
    ], output
    assert re.fullmatch(r"7 passed, 6 errors \(service missing\) in [\d.]+s", lines[-1]), output
    assert len(lines) <= 5, output  # the progress line, the summary line, the counts
    for noise in (SECRET, "pika", "AMQPConnectionError", "Traceback", "ERROR at setup"):
        assert noise not in output, output


def test_without_ci_a_missing_rabbitmq_skips_its_tests_with_one_line(database_url):
    port = closed_port()
    result = _pytest(
        *SELECTION, CI="", DATABASE_URL=database_url, RABBITMQ_URL=f"amqp://guest:{SECRET}@127.0.0.1:{port}/%2F"
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    lines = result.stdout.strip().splitlines()
    assert [line for line in lines if "RabbitMQ" in line] == [
        f"6 tests skipped: RabbitMQ is not reachable at amqp://guest:***@127.0.0.1:{port}/%2F (connection refused); "
        "start it, or point the tests at it with RABBITMQ_URL=... (CI=true fails instead)"
    ], output
    assert re.fullmatch(r"7 passed, 6 skipped in [\d.]+s", lines[-1]), output
    assert SECRET not in output and "pika" not in output, output
