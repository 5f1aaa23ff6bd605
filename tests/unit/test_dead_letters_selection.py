"""The selection rule the CLI and the web page share: what an action picks, and what its preview says."""

from __future__ import annotations

import time

import pytest
from dramatiq.broker import MessageProxy
from dramatiq.brokers.stub import StubBroker
from dramatiq.message import Message

from dramatiq_reliable import ConfigurationError, DeadLetterFilter
from dramatiq_reliable.dead_letters import DeadLetters
from dramatiq_reliable.dead_letters.selection import Preview, Selection
from dramatiq_reliable.testing import InMemoryDeadLetterStore


def _store(*, sent_days_ago: list[float]) -> InMemoryDeadLetterStore:
    store = InMemoryDeadLetterStore()
    broker = StubBroker(middleware=[DeadLetters(store=store)])
    store.broker = broker
    for days in sent_days_ago:
        message = Message(
            queue_name="default",
            actor_name="charge",
            args=(),
            kwargs={},
            options={},
            message_timestamp=int((time.time() - days * 86400) * 1000),
        )
        proxy = MessageProxy(message)
        proxy.stuff_exception(ValueError("declined"))
        proxy.fail()
        DeadLetters(store=store).capture(broker, proxy)
    return store


def test_a_selection_that_names_nothing_is_refused_unless_everything_is_said():
    with pytest.raises(ConfigurationError, match="say which dead letters"):
        Selection.of([], DeadLetterFilter())
    everything = Selection.of([], DeadLetterFilter(), everything=True)
    assert everything.ids is None and everything.describe() == "all"


def test_ids_are_kept_once_in_order_and_described():
    selection = Selection.of([7, 4, 7])
    assert selection.ids == (7, 4)
    assert selection.describe() == "2 ids (7, 4)"
    assert Selection.of([3], DeadLetterFilter(queue_name="q")).describe() == "id 3, queue_name='q'"
    assert Selection.of(range(1, 13)).describe().endswith("10, ...)")


def test_the_replay_preview_counts_the_rows_the_age_rule_leaves_dead_unless_forced():
    store = _store(sent_days_ago=[0, 0, 10])
    by_filter = Selection.of(where=DeadLetterFilter(actor_name="charge"))
    assert by_filter.preview(store, "replay") == Preview(total=3, too_old=1)
    assert by_filter.preview(store, "replay").touched == 2
    assert by_filter.preview(store, "replay", force=True) == Preview(total=3, too_old=0)
    assert by_filter.preview(store, "discard") == Preview(total=3, too_old=0)
    first = store.list().items[-1].id
    assert Selection.of([first, 999]).preview(store, "discard") == Preview(total=1)
