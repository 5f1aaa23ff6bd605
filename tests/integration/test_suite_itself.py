"""The test suite's own behaviour, run as a person runs it: pytest in a subprocess on a few tests.

A missing service is said once, plainly (one line: the service, the URL with its password masked,
the reason), and its tests fail without each retrying it under ``CI=true``, or are skipped on a
laptop (RabbitMQ pointed at a closed port; Postgres real, for the selection's other tests).  A
queue a test leaves behind fails the session under ``CI=true``, named with the test it came from,
and is deleted.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

from docs_snippets import ROOT
from support import closed_port, vhost_of

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


_LEAKING_TEST = """
import os
import pika


def test_declares_a_queue_the_janitor_never_hears_of(queue_name, rabbitmq_url):
    connection = pika.BlockingConnection(pika.URLParameters(rabbitmq_url))
    connection.channel().queue_declare(f"{queue_name}_leak")
    connection.close()
    with open(os.environ["LEAK_FILE"], "w") as file:
        file.write(f"{queue_name}_leak")
"""


def test_with_ci_a_queue_left_behind_fails_the_session_and_is_deleted(
    tmp_path, queues, rabbit, database_url, rabbitmq_url
):
    (tmp_path / "test_leak.py").write_text(_LEAKING_TEST)
    leak_file = tmp_path / "leaked"
    # The suite's conftest as a plugin, for a test file outside the suite.
    result = _pytest(
        "-c", str(ROOT / "pyproject.toml"), "--rootdir", str(ROOT), "-p", "conftest", str(tmp_path / "test_leak.py"),
        CI="true", DATABASE_URL=database_url, RABBITMQ_URL=rabbitmq_url, LEAK_FILE=str(leak_file),
    )  # fmt: skip
    output = result.stdout + result.stderr
    leaked = leak_file.read_text()
    queues.add(leaked)  # deleted after this test whatever happened
    assert result.returncode == 1, output
    [line] = [line for line in result.stdout.splitlines() if "left behind" in line]
    assert line.startswith(f"1 queue left behind by tests in vhost {vhost_of(rabbitmq_url)!r} (found with "), line
    assert f"deleted now: {leaked} (from " in line and "test_declares_a_queue_the_janitor_never_hears_of" in line
    assert line.endswith("CI=true, so the run fails"), line
    assert re.search(r"1 passed in", result.stdout), output
    assert not rabbit.exists(leaked)
