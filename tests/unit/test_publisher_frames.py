"""The publisher's own content header frames are pika's, byte for byte, and fail as pika's do."""

from __future__ import annotations

import struct

import pika
import pika.exceptions
import pika.frame
import pytest
from hypothesis import given
from hypothesis import strategies as st

from dramatiq_reliable.outbox.publisher import _header_frame


def _pika(channel: int, size: int, message_id: str, priority: int | None) -> bytes:
    properties = pika.BasicProperties(delivery_mode=2, priority=priority, message_id=message_id)
    return pika.frame.Header(channel, size, properties).marshal()


@given(
    channel=st.integers(1, 65535),
    size=st.integers(0, 2**63 - 1),
    message_id=st.text(max_size=60),
    priority=st.none() | st.integers(0, 255),
)
def test_the_header_frame_equals_what_pika_marshals(channel, size, message_id, priority):
    assert _header_frame(channel, size, message_id, priority) == _pika(channel, size, message_id, priority)


def test_the_header_frame_decodes_back_to_the_same_properties():
    frame = _header_frame(7, 1234, "é-id", 5)
    _, decoded = pika.frame.decode_frame(frame)
    assert (decoded.channel_number, decoded.body_size) == (7, 1234)
    props = decoded.properties
    assert (props.delivery_mode, props.priority, props.message_id) == (2, 5, "é-id")


def test_a_message_id_over_255_bytes_fails_as_in_pika():
    for encode in (_header_frame, _pika):
        with pytest.raises(pika.exceptions.ShortStringTooLong):
            encode(1, 10, "é" * 128, None)


@pytest.mark.parametrize("priority", [256, -1])
def test_a_priority_outside_a_byte_fails_as_in_pika(priority):
    for encode in (_header_frame, _pika):
        with pytest.raises(struct.error):
            encode(1, 10, "id", priority)
