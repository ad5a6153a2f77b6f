"""A link's queue (router.stream.linkqueue): bounded in transactions and in bytes of payload."""

from __future__ import annotations

import asyncio

import pytest

from protocol.transactions import Transaction
from router.errors import ConnectionLost
from router.stream.linkqueue import LinkQueue


def txn(end: int, nbytes: int) -> Transaction:
    return Transaction(end, end - 1, end, 0, [], {}, nbytes=nbytes)


def test_full_at_whichever_bound_comes_first_and_one_big_transaction_always_fits() -> None:
    queue = LinkQueue(maxlen=10, max_bytes=1000)
    assert queue.offer(txn(1, 5000))  # bigger than the bound alone: it fits in an empty queue
    assert queue.full and not queue.offer(txn(2, 1))
    assert asyncio.run(queue.get()).end_lsn == 1
    for end in range(2, 6):
        assert queue.offer(txn(end, 250))
    assert queue.full and not queue.offer(txn(6, 250))  # 1000 bytes held
    assert [t.end_lsn for t in queue.take(2)] == [2, 3]
    assert not queue.full and queue.offer(txn(6, 250))
    queue.push_front(txn(1, 400))  # put back: counted again
    assert queue.full
    queue.clear()
    assert not queue.full and len(queue) == 0
    for end in range(10):
        assert queue.offer(txn(end + 10, 1))
    assert queue.full  # ten transactions


async def test_interrupt_wakes_an_idle_consumer_once_and_a_reconnect_forgets_it() -> None:
    queue = LinkQueue(maxlen=10)
    waiting = asyncio.ensure_future(queue.get())
    await asyncio.sleep(0)
    queue.interrupt(ConnectionLost("dropped", node="b"))
    with pytest.raises(ConnectionLost):
        await waiting
    queue.interrupt(ConnectionLost("dropped", node="b"))
    queue.forget_interrupt()  # the consumer connected again meanwhile
    waiting = asyncio.ensure_future(queue.get())
    await asyncio.sleep(0)
    assert not waiting.done()
    waiting.cancel()
