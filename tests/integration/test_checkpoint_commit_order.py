"""Checkpoints against writers whose transactions commit out of id order: no row skipped, none processed twice.

A sequence assigns ids at INSERT: a transaction that took id 1 and commits after the one that
took id 2 is invisible to a run that sees 2.  The recipe the how-to used to give (an id
watermark advanced to the last id handled) then skips id 1 for ever.  A transaction-id
checkpoint (``transactions=True``) ends every window below the oldest running transaction, so
the same interleavings lose nothing.  The writers here commit in the reverse order of their ids
on purpose, and a run happens between every two commits, while other runs overlap them.
"""

from __future__ import annotations

import collections
import itertools
import threading
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.rows import dict_row

from dramatiq_reliable import CheckpointError, checkpoint
from dramatiq_reliable.testing import wait_for

pytestmark = pytest.mark.integration

Recipe = Callable[[psycopg.Connection[Any], str], int]


def _table(schema: str, name: str) -> sql.Identifier:
    return sql.Identifier(schema, name)


@pytest.fixture
def tables(db: psycopg.Connection[Any], db_schema: str) -> str:
    """The app's tables, in the test's schema: events stamped with their transaction id, and what a run processed.

    ``processed`` has no key: a row processed twice shows as two rows.
    """
    db.execute(
        sql.SQL(
            "CREATE TABLE {events} (id bigserial PRIMARY KEY, txid bigint NOT NULL DEFAULT txid_current(),"
            " writer int NOT NULL);"
            "CREATE INDEX ON {events} (txid);"
            "CREATE TABLE {processed} (event_id bigint NOT NULL, run text NOT NULL)"
        ).format(events=_table(db_schema, "events"), processed=_table(db_schema, "processed"))
    )
    return db_schema


# -- the recipes ---------------------------------------------------------------------------------


def _record(conn: psycopg.Connection[Any], schema: str, rows: list[dict[str, Any]], run: str) -> None:
    with conn.cursor() as cursor:
        cursor.executemany(
            sql.SQL("INSERT INTO {} (event_id, run) VALUES (%s, %s)").format(_table(schema, "processed")),
            [(row["id"], run) for row in rows],
        )


def ids_recipe(conn: psycopg.Connection[Any], schema: str, run: str) -> int:
    """Today's how-to before this fix: an id watermark, advanced to the last id handled."""
    with checkpoint("events-export", initial=0, conn=conn, schema=schema) as window:
        rows = conn.execute(
            sql.SQL("SELECT id FROM {} WHERE id > %s ORDER BY id LIMIT 10000").format(_table(schema, "events")),
            (window.since,),
        ).fetchall()
        _record(conn, schema, rows, run)
        if rows:
            window.advance(to=rows[-1]["id"])
        return len(rows)


def transactions_recipe(conn: psycopg.Connection[Any], schema: str, run: str) -> int:
    """The how-to's recipe now: rows stamped with txid_current(), read in [since, until) of transaction ids."""
    with checkpoint("events-export", initial=0, conn=conn, schema=schema, transactions=True) as window:
        rows = conn.execute(
            sql.SQL("SELECT id FROM {} WHERE txid >= %s AND txid < %s ORDER BY txid, id").format(
                _table(schema, "events")
            ),
            (window.since, window.until),
        ).fetchall()
        _record(conn, schema, rows, run)
        return len(rows)


def batched_transactions_recipe(conn: psycopg.Connection[Any], schema: str, run: str) -> int:
    """The same with a batch limit: at most two writer transactions a run, cut at a transaction boundary."""
    events = _table(schema, "events")
    with checkpoint("events-export", initial=0, conn=conn, schema=schema, transactions=True) as window:
        cut = conn.execute(
            sql.SQL(
                "SELECT txid FROM {} WHERE txid >= %s AND txid < %s GROUP BY txid ORDER BY txid OFFSET 2 LIMIT 1"
            ).format(events),
            (window.since, window.until),
        ).fetchone()
        if cut is not None:
            window.advance(to=cut["txid"])
        rows = conn.execute(
            sql.SQL("SELECT id FROM {} WHERE txid >= %s AND txid < %s ORDER BY txid, id").format(events),
            (window.since, window.watermark),
        ).fetchall()
        _record(conn, schema, rows, run)
        return len(rows)


# -- the writers and the runs --------------------------------------------------------------------


class Runs:
    """Runs of one recipe, each in a transaction of its own that commits (or, if ``fail``, rolls back)."""

    def __init__(self, url: str, schema: str, recipe: Recipe) -> None:
        self.url, self.schema, self.recipe = url, schema, recipe
        self._numbers = itertools.count()
        self._lock = threading.Lock()
        self.failed = 0

    def run(self, conn: psycopg.Connection[Any], *, fail: bool = False) -> int:
        with self._lock:
            number = next(self._numbers)
        try:
            with conn.transaction():
                handled = self.recipe(conn, self.schema, f"run-{number}")
                if fail:
                    raise RuntimeError("the job failed after processing its window")
        except RuntimeError:
            with self._lock:
                self.failed += 1
            return 0
        return handled

    def connect(self) -> psycopg.Connection[Any]:
        return psycopg.connect(self.url, row_factory=dict_row)


def _write_and_run(runs: Runs, writers: int, rounds: int) -> list[list[int]]:
    """``writers`` threads insert 1-3 rows each a round; after all have inserted, they commit in the
    reverse order of their ids, and each runs the recipe right after its commit (so a run sees a
    later id committed while an earlier one is still open).  Two more threads run the recipe all
    along, every third run failing, so runs overlap each other.  Returns the commit order per round.
    """
    inserted = threading.Barrier(writers)
    turn = threading.Condition()
    state: dict[str, Any] = {"round": 0, "turn": 0, "max_ids": collections.defaultdict(dict), "order": []}
    done = threading.Event()
    errors: list[BaseException] = []

    def writer(number: int) -> None:
        try:
            with psycopg.connect(runs.url, row_factory=dict_row) as conn, runs.connect() as run_conn:
                for current in range(rounds):
                    count = 1 + (number + current) % 3
                    ids = [
                        conn.execute(
                            sql.SQL("INSERT INTO {} (writer) VALUES (%s) RETURNING id").format(
                                _table(runs.schema, "events")
                            ),
                            (number,),
                        ).fetchone()["id"]  # type: ignore[index]
                        for _ in range(count)
                    ]
                    with turn:
                        state["max_ids"][current][number] = max(ids)
                    inserted.wait(timeout=30)  # every writer holds an open transaction with its ids
                    with turn:
                        # Highest ids commit first: every commit but the last leaves lower ids open.
                        mine = state["max_ids"][current]
                        rank = sorted(mine, key=lambda w: -mine[w]).index(number)
                        assert turn.wait_for(
                            lambda current=current, rank=rank: state["round"] == current and state["turn"] == rank,
                            timeout=30,
                        )
                    conn.commit()
                    runs.run(run_conn)
                    with turn:
                        state["order"].append(max(ids))
                        state["turn"] += 1
                        if state["turn"] == writers:
                            state["turn"], state["round"] = 0, current + 1
                        turn.notify_all()
        except BaseException as error:
            errors.append(error)
            inserted.abort()

    def background() -> None:
        try:
            with runs.connect() as conn:
                for number in itertools.count():
                    if done.is_set():
                        return
                    runs.run(conn, fail=number % 3 == 2)
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(writers)]
    threads += [threading.Thread(target=background) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads[:writers]:
        thread.join(timeout=120)
    done.set()
    for thread in threads[writers:]:
        thread.join(timeout=60)
    assert not errors, errors
    assert not any(thread.is_alive() for thread in threads)
    order = state["order"]
    return [order[i : i + writers] for i in range(0, len(order), writers)]


def _counts(db: psycopg.Connection[Any], schema: str) -> dict[int, int]:
    """How many times each event was processed (0: skipped)."""
    query = sql.SQL(
        "SELECT e.id, count(p.event_id) AS n FROM {} e LEFT JOIN {} p ON p.event_id = e.id GROUP BY e.id"
    ).format(_table(schema, "events"), _table(schema, "processed"))
    return {row[0]: row[1] for row in db.execute(query).fetchall()}


def _drain(runs: Runs, db: psycopg.Connection[Any]) -> None:
    """Run until every event was processed: the horizon passes the last writer once every
    transaction open on the server (other tests' too) has ended."""
    with runs.connect() as conn:

        def finished() -> bool:
            runs.run(conn)
            return all(_counts(db, runs.schema).values())

        wait_for(finished, timeout_ms=120_000, message="a drain that processes every committed event")


@pytest.mark.parametrize(
    "recipe",
    [
        transactions_recipe,
        batched_transactions_recipe,
        pytest.param(
            ids_recipe,
            marks=pytest.mark.xfail(
                strict=True, reason="the old recipe: an id committed after a higher one is behind the watermark"
            ),
        ),
    ],
    ids=["transactions", "transactions-batched", "ids-old-recipe"],
)
def test_concurrent_writers_committing_out_of_id_order_lose_no_row_and_none_is_processed_twice(
    recipe: Recipe, database_url: str, tables: str, db: psycopg.Connection[Any]
) -> None:
    """4 writers x 12 rounds, commits in reverse id order, a run after every commit and two more
    threads running (a third of their runs failing): every event is processed exactly once."""
    runs = Runs(database_url, tables, recipe)
    rounds = _write_and_run(runs, writers=4, rounds=12)
    assert all(order == sorted(order, reverse=True) for order in rounds)  # every round committed out of order
    if recipe is not ids_recipe:
        _drain(runs, db)
    counts = _counts(db, tables)
    assert len(counts) == sum(1 + (w + r) % 3 for w in range(4) for r in range(12))
    skipped = sorted(event for event, n in counts.items() if n == 0)
    doubled = sorted(event for event, n in counts.items() if n > 1)
    assert skipped == [], f"{len(skipped)} of {len(counts)} events skipped for ever"
    assert doubled == [], f"{len(doubled)} events processed twice"
    assert runs.failed > 0  # failed runs rolled their processing back with their watermark


# -- one interleaving, step by step --------------------------------------------------------------


@pytest.fixture
def connections(database_url: str) -> Iterator[Callable[[], psycopg.Connection[Any]]]:
    opened: list[psycopg.Connection[Any]] = []

    def connect() -> psycopg.Connection[Any]:
        opened.append(psycopg.connect(database_url, row_factory=dict_row))
        return opened[-1]

    yield connect
    for conn in opened:
        conn.close()


def _insert(conn: psycopg.Connection[Any], schema: str) -> int:
    row = conn.execute(
        sql.SQL("INSERT INTO {} (writer) VALUES (0) RETURNING id").format(_table(schema, "events"))
    ).fetchone()
    assert row is not None
    return int(row["id"])


@pytest.mark.parametrize("first_transaction_id", ["early", "late"])
def test_a_row_that_took_its_id_first_and_commits_last_is_processed_by_a_later_run(
    first_transaction_id: str, tables: str, connections: Callable[[], psycopg.Connection[Any]], db
) -> None:
    """A inserts id 1, B inserts id 2 and commits, a run runs, A commits: the next run processes id 1.

    Whether B's transaction id is above A's ("early": A got its transaction id first) or below
    it ("late": B got one first, then A), no run skips a row and none processes one twice.
    """
    a, b, job = connections(), connections(), connections()
    if first_transaction_id == "late":
        b.execute("SELECT txid_current()")  # B's transaction id is older than A's
    first = _insert(a, tables)
    second = _insert(b, tables)
    assert first < second
    b.commit()
    seen = transactions_recipe(job, tables, "run-1")
    job.commit()
    a.commit()

    def caught_up() -> bool:
        transactions_recipe(job, tables, "run-n")
        job.commit()
        return all(_counts(db, tables).values())

    # The horizon passes A once every transaction open on the server (other tests' too) has ended.
    wait_for(caught_up, timeout_ms=60_000, message="a run that processes id 1")
    assert _counts(db, tables) == {first: 1, second: 1}
    # B's row is in the first window only if B's transaction id is older than A's.
    assert seen == 0 if first_transaction_id == "early" else seen in (0, 1)


def test_the_old_recipe_skips_that_row_for_ever(tables: str, connections: Callable[[], psycopg.Connection[Any]], db):
    """The same interleaving with an id watermark: the run sees id 2, records it, and id 1 is never processed."""
    a, b, job = connections(), connections(), connections()
    first = _insert(a, tables)
    second = _insert(b, tables)
    b.commit()
    ids_recipe(job, tables, "run-1")
    job.commit()
    a.commit()
    ids_recipe(job, tables, "run-2")
    job.commit()
    assert _counts(db, tables) == {first: 0, second: 1}


def test_overlapping_transaction_runs_do_not_share_a_window(
    tables: str, connections: Callable[[], psycopg.Connection[Any]], db
) -> None:
    """The second run waits on the checkpoint row, then starts where the first one's window ended."""
    first_conn, second_conn = connections(), connections()
    _insert(first_conn, tables)
    first_conn.commit()
    windows: dict[str, tuple[int, int | None]] = {}
    first_in, first_may_finish = threading.Event(), threading.Event()

    def first() -> None:
        with checkpoint("events-export", initial=0, conn=first_conn, schema=tables, transactions=True) as window:
            windows["first"] = (window.since, window.until)
            first_in.set()
            first_may_finish.wait(30)
        first_conn.commit()

    def second() -> None:
        with checkpoint("events-export", initial=0, conn=second_conn, schema=tables, transactions=True) as window:
            windows["second"] = (window.since, window.until)
        second_conn.commit()

    one = threading.Thread(target=first)
    one.start()
    assert first_in.wait(30)
    two = threading.Thread(target=second)
    two.start()
    waiting = sql.SQL("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE {}").format(
        sql.Literal(f'%"{tables}".checkpoints%')
    )
    try:
        wait_for(lambda: db.execute(waiting).fetchone()[0] == 1, message="the second run did not wait on the row lock")
        assert "second" not in windows
    finally:
        first_may_finish.set()
    one.join(30)
    two.join(30)
    assert windows["first"][0] == 0
    assert windows["second"][0] == windows["first"][1]


def test_a_checkpoint_is_continued_only_as_the_kind_it_was_started(
    database_url: str, tables: str, connections: Callable[[], psycopg.Connection[Any]]
) -> None:
    """An id watermark read as a transaction id (or back) would skip or repeat everything: refused."""
    conn = connections()
    with checkpoint("ids", initial=0, conn=conn, schema=tables) as window:
        window.advance(to=285)
    with checkpoint("txids", initial=0, conn=conn, schema=tables, transactions=True):
        pass
    conn.commit()
    with (
        pytest.raises(CheckpointError, match=r"holds an integer watermark of ids \(285\) but transactions=True"),
        checkpoint("ids", initial=0, conn=conn, schema=tables, transactions=True),
    ):
        pass
    conn.rollback()
    with (
        pytest.raises(CheckpointError, match="holds a transaction-id watermark but transactions=False"),
        checkpoint("txids", initial=0, conn=conn, schema=tables),
    ):
        pass
