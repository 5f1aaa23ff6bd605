"""The pytest plugin, as a user's test suite sees it: each test runs a small test file of a user's own
with pytest's ``pytester`` and reads its outcome and report.  No service (the fixtures on
Postgres are tested in tests/integration/test_pytest_plugin_postgres.py)."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import dramatiq
import dramatiq.broker
import pytest
from dramatiq.asyncio import get_event_loop_thread
from dramatiq.middleware import AsyncIO

from dramatiq_reliable import ConfigurationError, PayloadError
from dramatiq_reliable.testing import (
    InMemoryBroker,
    assert_enqueued,
    assert_enqueued_count,
    assert_not_enqueued,
    enqueued,
)

pytest_plugins = ["pytester"]


def test_the_plugin_is_registered_by_its_entry_point(pytester: pytest.Pytester) -> None:
    """Installed, the package's plugin is loaded with no conftest line: its option is in --help."""
    result = pytester.runpytest("--help")
    result.stdout.fnmatch_lines(["*--reliable-database-url=URL*"])


def test_the_fixtures_work_in_a_users_test_file(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import dramatiq
        from dramatiq_reliable.testing import assert_enqueued, assert_not_enqueued

        def test_an_order_sends_its_receipt_and_the_receipt_runs(reliable_broker, reliable_idempotency_store):
            receipts = []

            @dramatiq.actor(idempotency_key=lambda order_id: f"receipt-{order_id}")
            def send_receipt(order_id):
                receipts.append(order_id)

            @dramatiq.actor
            def place_order(order_id):
                send_receipt.send(order_id)

            with reliable_broker.transaction():
                place_order.send(42)
            send_receipt.send(42)  # a duplicate: Idempotency skips it
            assert_enqueued(place_order, 42)
            assert reliable_broker.drain() == 3
            assert receipts == [42]
            assert_enqueued(send_receipt, 42)
            assert_not_enqueued(send_receipt, 41)
            keys = reliable_idempotency_store.keys()
            assert ("send_receipt", "receipt-42") in keys and len(keys) == 2  # place_order's key is its message id

        def test_each_test_starts_with_an_empty_broker(reliable_broker):
            assert reliable_broker.sent == [] and reliable_broker.drain() == 0
        """
    )
    result = pytester.runpytest()
    result.assert_outcomes(passed=2)


def test_drain_fails_fast_with_the_actors_own_error_naming_the_message(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import dramatiq

        def test_a_job_that_raises(reliable_broker):
            ran = []

            @dramatiq.actor
            def charge(order_id):
                raise ValueError(f"card declined for order {order_id}")

            @dramatiq.actor
            def later():
                ran.append("later")

            charge.send(7)
            later.send()
            try:
                reliable_broker.drain()
            finally:
                assert ran == []  # the drain stopped at the first error
        """
    )
    result = pytester.runpytest()
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        ["*ValueError: card declined for order 7", "*raised by charge(7), message *, during drain()"]
    )


def test_a_retry_the_failure_scheduled_runs_in_the_next_drain(reliable_broker: InMemoryBroker) -> None:
    attempts: list[int] = []

    @dramatiq.actor(max_retries=1, min_backoff=60_000)
    def flaky() -> None:
        attempts.append(len(attempts))
        if len(attempts) == 1:
            raise ConnectionError("the provider hung up")

    flaky.send()
    with pytest.raises(ConnectionError, match="hung up"):
        reliable_broker.drain()
    assert reliable_broker.drain() == 1  # the retry's minute of backoff does not pass in a test
    assert attempts == [0, 1]


def test_assert_enqueued_says_what_was_sent_instead(reliable_broker: InMemoryBroker) -> None:
    @dramatiq.actor
    def send_receipt(order_id: int, *, lang: str = "en") -> None: ...

    send_receipt.send(41, lang="fr")
    with reliable_broker.transaction():
        send_receipt.send(43)
        with pytest.raises(AssertionError) as failure:
            assert_enqueued(send_receipt, 42)
    assert str(failure.value) == (
        "expected a send of send_receipt(42); sent: send_receipt(41, lang='fr'); "
        "held until their transaction commits: send_receipt(43)"
    )
    with pytest.raises(
        AssertionError,
        match=r"^expected no send of send_receipt; sent: send_receipt\(41, lang='fr'\), send_receipt\(43\)$",
    ):
        assert_not_enqueued(send_receipt)
    with pytest.raises(AssertionError, match=r"^expected 2 sends of send_receipt\(43\), got 1; sent: "):
        assert_enqueued_count(2, send_receipt, 43)
    assert [m.args for m in assert_enqueued_count(1, send_receipt, 41, lang="fr")] == [(41,)]


def test_arguments_match_as_they_travel(reliable_broker: InMemoryBroker) -> None:
    """A tuple argument arrives as a list: either spelling matches it."""

    @dramatiq.actor
    def resize(size: list[int]) -> None: ...

    resize.send((640, 480))
    assert_enqueued(resize, [640, 480])
    assert_enqueued(resize, (640, 480))
    assert enqueued(resize, (480, 640)) == []


def test_a_rolled_back_transaction_block_never_sent(reliable_broker: InMemoryBroker) -> None:
    """Without a database, the block of broker.transaction() is the transaction: it raised, so its sends are dropped."""

    @dramatiq.actor
    def notify(n: int) -> None: ...

    with pytest.raises(KeyError), reliable_broker.transaction():
        notify.send(1)
        raise KeyError("the order was invalid")
    with reliable_broker.transaction():
        notify.send(2)
        assert reliable_broker.drain() == 0  # not committed yet: a worker could not see it
    assert_not_enqueued(notify, 1)
    assert_enqueued_count(1, notify)
    assert reliable_broker.drain() == 1


def test_sql_in_a_transaction_without_a_database_names_the_fix(reliable_broker: InMemoryBroker) -> None:
    with (
        pytest.raises(ConfigurationError, match="build the broker with database="),
        reliable_broker.transaction() as conn,
    ):
        conn.execute("INSERT INTO orders VALUES (1)")


def test_a_send_is_checked_as_the_postgres_brokers_check_it(reliable_broker: InMemoryBroker) -> None:
    @dramatiq.actor
    def store(value: object) -> None: ...

    with pytest.raises(PayloadError, match="JSON-serialisable"):
        store.send(object())
    with pytest.raises(PayloadError, match="non-negative int"):
        store.send_with_options(args=(1,), delay=-5)
    assert reliable_broker.sent == []


def test_jobs_that_send_each_other_for_ever_fail_the_drain() -> None:
    broker = InMemoryBroker(max_jobs=5)
    try:

        @dramatiq.actor(broker=broker)
        def again() -> None:
            again.send()

        again.send()
        with pytest.raises(AssertionError, match=r"ran 5 jobs and more keep coming \(next: again\(\)\)"):
            broker.drain()
    finally:
        broker.close()


def test_assertions_refuse_an_actor_of_another_broker() -> None:
    broker = dramatiq.brokers.stub.StubBroker()
    try:

        @dramatiq.actor(broker=broker)
        def elsewhere() -> None: ...

        with pytest.raises(ConfigurationError, match="not an InMemoryBroker; declare it after"):
            assert_enqueued(elsewhere)
        with pytest.raises(ConfigurationError, match="expected an actor"):
            assert_enqueued("elsewhere")  # type: ignore[arg-type]
    finally:
        broker.close()


def test_the_applications_own_in_memory_broker_is_the_fixtures(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A conftest that sets an InMemoryBroker before the app's actors are imported keeps its broker and middleware."""
    # pytester runs in this process: the inner conftest's global broker must not outlive this test.
    monkeypatch.setattr(dramatiq.broker, "global_broker", dramatiq.broker.global_broker)
    pytester.makeconftest(
        """
        import dramatiq
        from dramatiq_reliable.testing import InMemoryBroker

        dramatiq.set_broker(InMemoryBroker())
        """
    )
    pytester.makepyfile(
        app="""
        import dramatiq

        @dramatiq.actor
        def welcome(user_id):
            pass
        """
    )
    pytester.makepyfile(
        """
        import dramatiq
        import pytest
        from app import welcome
        from dramatiq_reliable.testing import assert_enqueued_count

        @pytest.mark.parametrize("run", [1, 2])
        def test_one_welcome_per_test(reliable_broker, run):
            assert welcome.broker is reliable_broker is dramatiq.get_broker()
            welcome.send(run)
            assert_enqueued_count(1, welcome)
        """
    )
    pytester.syspathinsert()
    result = pytester.runpytest()
    result.assert_outcomes(passed=2)


def test_the_database_url_fixture_names_the_three_ways_to_give_it(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("DATABASE_URL", raising=False)
    pytester.makepyfile(
        """
        def test_needs_postgres(reliable_schema):
            pass

        def test_needs_nothing(reliable_broker):
            pass
        """
    )
    result = pytester.runpytest()
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(
        [
            "*pass --reliable-database-url=postgresql://..., set reliable_database_url in the pytest ini file, or set DATABASE_URL*"
        ]
    )


def test_loading_the_plugin_imports_nothing_beyond_the_package() -> None:
    """pytest loads the plugin in every project installed beside it: past the package itself (which the
    entry point's path imports), it adds only its own small modules and Dramatiq's stub broker."""
    code = (
        "import sys, pytest, dramatiq_reliable\n"
        "before = set(sys.modules)\n"
        "import dramatiq_reliable.testing.plugin\n"
        "print(' '.join(sorted(set(sys.modules) - before)))\n"
    )
    extra = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout.split()
    assert "dramatiq_reliable.testing.plugin" in extra
    assert [name for name in extra if not name.startswith(("dramatiq_reliable.testing", "dramatiq.brokers.stub"))] == []


def test_a_broker_the_fixture_built_is_global_only_during_its_test(pytester: pytest.Pytester) -> None:
    before = dramatiq.broker.global_broker
    pytester.makepyfile(
        """
        import dramatiq

        def test_it_is_the_global_broker(reliable_broker):
            assert dramatiq.get_broker() is reliable_broker
        """
    )
    pytester.runpytest().assert_outcomes(passed=1)
    assert dramatiq.broker.global_broker is before


def test_an_async_actor_runs_in_drain_and_its_error_is_raised() -> None:
    """Dramatiq's AsyncIO middleware starts its event loop when a worker boots; drain() starts it, close() stops it."""
    broker = InMemoryBroker(middleware=[AsyncIO()])
    seen: list[int] = []
    try:

        @dramatiq.actor(broker=broker)
        async def fetch(n: int) -> None:
            await asyncio.sleep(0)
            if n == 2:
                raise LookupError(f"page {n} is gone")
            seen.append(n)

        fetch.send(1)
        assert broker.drain() == 1
        fetch.send(2)
        with pytest.raises(LookupError, match="page 2 is gone"):
            broker.drain()
        assert seen == [1]
    finally:
        broker.close()
    assert get_event_loop_thread() is None
