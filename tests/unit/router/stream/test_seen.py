"""What a source had applied from each other node (`Transaction.seen`), and the sequential test on it.

The vector is built from echoes in stream order (router.stream.seen), stamped by the fan-out on every
transaction it hands out, announced or handed out early (router.stream.fanout), and read by
router.conflicts.causality. Transactions are built by hand, or come from the captured PostgreSQL 15
streams (tests/unit/protocol/data/: one echo, under origin `pgmesh_capture_origin`, whose commit time is
the one `pg_replication_origin_xact_setup` gave it).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest

from protocol.messages import Message
from protocol.transactions import Transaction
from router.config.model import ClusterSection, Config, NodeConfig
from router.conflicts.causality import sequential
from router.progress.positions import LinkProgress, SourceProgress
from router.stream.fanout import SourcePump
from router.stream.items import EarlyStream, SourceOptions
from router.stream.linkqueue import LinkQueue
from router.stream.seen import HISTORY_MAX, Seen, SeenVersions, origin_nodes
from router.stream.source import ReplicationSource
from router.stream.spool import Spool, let_go
from tests.unit.router.stream.test_source_frames import feed_all, frames_of
from tests.unit.router.stream.test_spool import REL, insert

CLUSTER = "pgmesh_c_"
EARLY = "pgmeshearly_c_"
ORIGINS = origin_nodes(["a", "b", "c", "b_c"], CLUSTER, EARLY)
CAPTURE_TIME = 757479845000000  # the captured echo's commit time (its origin's, from xact_setup)


def txn(lsn: int, time: int, origin: str | None = None) -> Transaction:
    """A one-row transaction committed at `lsn` (its end 8 bytes later) and `time` (µs)."""
    return Transaction(lsn, lsn, lsn + 8, time, [insert(lsn)], {REL.relid: REL}, origin=origin)


# ------------------------------------------------------------------------------ the vector


def vector(seen: SeenVersions) -> Seen:
    return seen.snapshot


def test_origin_names_map_to_their_nodes_whatever_the_underscores() -> None:
    assert ORIGINS["pgmesh_c_a"] == "a" and ORIGINS["pgmeshearly_c_a"] == "a"
    assert ORIGINS["pgmesh_c_b_c"] == "b_c" and ORIGINS["pgmesh_c_c"] == "c"
    config = Config(ClusterSection(name="demo"), [NodeConfig("a", "dbname=a"), NodeConfig("b", "dbname=b")])
    mapped = origin_nodes(config.node_names, config.origin_name(""), config.early_origin_name(""))
    assert mapped == {config.origin_name("a"): "a", config.early_origin_name("a"): "a",
                      config.origin_name("b"): "b", config.early_origin_name("b"): "b"}


def test_the_vector_keeps_the_newest_commit_time_per_node_in_stream_order() -> None:
    seen = SeenVersions(ORIGINS, own="b")
    assert vector(seen) == ()
    seen.note(txn(10, 1000, "pgmesh_c_a"))
    first = seen.snapshot
    assert first == (("a", 1000),)
    seen.note(txn(20, 900, "pgmesh_c_a"))  # committed later on b, stamped earlier on a: not newer
    assert seen.snapshot is first  # unchanged: the same tuple object
    seen.note(txn(30, 500, "pgmeshearly_c_c"))  # a streamed one applied before its commit
    seen.note(txn(40, 700, "pgmesh_c_b_c"))
    seen.note(txn(50, 9999, "pgmesh_c_b"))  # the source's own origin: cannot be an echo; ignored
    seen.note(txn(60, 9999, "bucardo"))  # another replicator's: no pgmesh node
    seen.note(txn(70, 9999))  # no origin
    assert vector(seen) == (("a", 1000), ("b_c", 700), ("c", 500))  # sorted by node
    seen.note(txn(80, 1200, "pgmesh_c_a"))
    assert vector(seen) == (("a", 1200), ("b_c", 700), ("c", 500))


def test_a_rewind_goes_back_to_the_vector_of_the_echoes_before_it() -> None:
    seen = SeenVersions(ORIGINS, own="b")
    for lsn, time, origin in [(10, 100, "pgmesh_c_a"), (20, 200, "pgmesh_c_c"), (30, 300, "pgmesh_c_a")]:
        seen.note(txn(lsn, time, origin))
    seen.rewind(30)  # the echo at 30 is read again: it is not counted until then
    assert vector(seen) == (("a", 100), ("c", 200))
    seen.note(txn(30, 300, "pgmesh_c_a"))
    assert vector(seen) == (("a", 300), ("c", 200))
    seen.rewind(11)
    assert vector(seen) == (("a", 100),)
    seen.rewind(5)
    assert vector(seen) == ()
    seen.note(txn(10, 100, "pgmesh_c_a"))  # and built again as the source re-reads
    assert vector(seen) == (("a", 100),)


def test_what_no_rewind_can_reach_is_forgotten_and_a_rewind_further_back_starts_empty() -> None:
    seen = SeenVersions(ORIGINS, own="b")
    for i in range(1, 6):
        seen.note(txn(10 * i, 100 * i, "pgmesh_c_a"), confirmed=35)
    assert len(seen._history) == 3  # 30 (the last before the confirmed position), 40, 50
    seen.rewind(35)
    assert vector(seen) == (("a", 300),)
    capped = SeenVersions(ORIGINS)
    for i in range(1, HISTORY_MAX + 3):
        capped.note(txn(10 * i, i, "pgmesh_c_a"))
    assert len(capped._history) == HISTORY_MAX
    capped.rewind(15)  # before every vector still kept: not known, so empty (known less, never more)
    assert vector(capped) == ()


# ------------------------------------------------------------------------------ the fan-out's stamp


def pump_of(source: ReplicationSource) -> SourcePump:
    links = [LinkProgress(source.node, "b"), LinkProgress(source.node, "c")]
    queues = {"b": LinkQueue(1000), "c": LinkQueue(1000)}
    origins = {"pgmesh_capture_origin": "origin", "pgmesh_capture_a": "a"}
    return SourcePump(source, SourceProgress(source.node, links), queues, origins=origins)


def _handed_early(item: object) -> bool:
    """A plain transaction handed out at its first spill, before its commit."""
    if not isinstance(item, Transaction) or item.spill is None:
        return False
    return bool(item.spill.early and item.spill.final is not item)


async def run_items(pump: SourcePump, items: Sequence[object]) -> None:
    """What `SourcePump.run` does with each item the source hands out."""
    for item in items:
        if isinstance(item, Message):
            continue
        if isinstance(item, EarlyStream):
            pump._announce(item)
            continue
        assert isinstance(item, Transaction)
        await pump._dispatch(item)


async def test_every_transaction_handed_out_carries_the_vector_of_the_echoes_before_it() -> None:
    source = ReplicationSource("a", "dbname=unused", "slot_a", ["pub"])
    pump = pump_of(source)
    one, two, three, four = txn(10, 100), txn(30, 300), txn(50, 500), txn(70, 700)
    echo = "pgmesh_capture_origin"
    items = [one, txn(20, 150, echo), two, three, txn(60, 50, echo), four]
    await run_items(pump, items)
    assert pump.stats.echoes == 2 and pump.stats.transactions == 4
    for queue in pump.queues.values():
        handed = [await queue.get() for _ in range(4)]
        assert handed == [one, two, three, four]  # the same objects, stamped in place
    assert (one.seen, two.seen, four.seen) == ((), (("origin", 150),), (("origin", 150),))
    assert two.seen is three.seen is four.seen  # one tuple until an echo changes it


@pytest.mark.parametrize("capture", ["text_v1", "binary_v2_stream"])
async def test_captured_transactions_after_the_echo_carry_its_origin_time(capture: str) -> None:
    source = ReplicationSource("a", "dbname=unused", "slot_a", ["pub"])
    pump = pump_of(source)
    out = feed_all(source, frames_of(capture))
    await run_items(pump, out)
    handed = [await pump.queues["b"].get() for _ in range(pump.stats.transactions)]
    txns = [t for t in out if isinstance(t, Transaction)]
    echo = next(i for i, t in enumerate(txns) if t.origin is not None)
    assert echo > 0 and txns[echo].commit_time == CAPTURE_TIME
    assert txns[echo] not in handed and txns[echo].seen == ()  # an echo goes nowhere, unstamped
    before = [t for t in handed if t.commit_lsn < txns[echo].commit_lsn]
    after = handed[len(before):]
    assert before and after and all(t.seen == () for t in before)
    assert all(t.seen == (("origin", CAPTURE_TIME),) for t in after)


@pytest.mark.parametrize(("capture", "options"), [
    ("binary_v2_stream", SourceOptions(spill_bytes=4096, early_streamed=True)),
    ("text_v1", SourceOptions(spill_bytes=4096, early_spilled=True)),
])
async def test_announced_and_early_transactions_carry_the_vector_too(
    capture: str, options: SourceOptions, tmp_path: Path
) -> None:
    spool = Spool(tmp_path)
    source = ReplicationSource("a", "dbname=unused", "slot_a", ["pub"], options=options, spool=spool)
    pump = pump_of(source)
    out = feed_all(source, frames_of(capture))
    echo = next(i for i, t in enumerate(out) if isinstance(t, Transaction) and t.origin is not None)
    await run_items(pump, out)
    early = [(i, t) for i, t in enumerate(out) if isinstance(t, EarlyStream) or _handed_early(t)]
    assert any(i > echo for i, _ in early)  # the captures have big transactions after the echo
    finals = 0
    for i, item in early:
        txn_ = item.txn if isinstance(item, EarlyStream) else item
        assert isinstance(txn_, Transaction)
        want = (("origin", CAPTURE_TIME),) if i > echo else ()
        assert txn_.seen == want
        final = txn_.spill.final  # its commit, as the appliers read it from the spill file
        if final is not None:
            finals += 1
            assert final.seen == want
    assert finals
    for queue in pump.queues.values():
        queue.drop_side()
        while len(queue):
            let_go(await queue.get())
    assert spool.files == 0


async def test_a_pump_without_origins_stamps_nothing_and_rewinds_its_vector() -> None:
    source = ReplicationSource("a", "dbname=unused", "slot_a", ["pub"])
    plain = SourcePump(source, SourceProgress("a", [LinkProgress("a", "b")]), {"b": LinkQueue(10)})
    await run_items(plain, [txn(20, 150, "pgmesh_capture_origin"), txn(30, 300)])
    assert (await plain.queues["b"].get()).seen == ()
    pump = pump_of(ReplicationSource("a", "dbname=unused", "slot_a", ["pub"]))
    await run_items(pump, [txn(20, 150, "pgmesh_capture_origin"), txn(30, 300)])
    assert vector(pump.seen) == (("origin", 150),)
    link = pump.progress.links[0]
    link.detach(pump.progress.seen)  # it fell behind: the source re-reads from its applied position
    assert pump.rewind_for([link]) == 0
    assert vector(pump.seen) == ()


# ------------------------------------------------------------------------------ sequential or concurrent


def test_a_version_the_source_had_applied_is_sequential() -> None:
    seen = (("a", 1000), ("c", 500))
    assert sequential("a", 1000, seen)  # exactly the version the source applied
    assert sequential("a", 999, seen)  # an older one of a's: the source wrote on top of something newer
    assert not sequential("a", 1001, seen)  # newer than anything of a's the source had: concurrent
    assert not sequential("b", 10, seen)  # nothing of b's known
    assert not sequential("a", 10, ())  # nothing known at all: concurrent (a conflict, as before)
    assert not sequential("a", None, seen)  # unknown local time: the resolver's rule decides


def test_with_the_remote_time_sequential_never_disagrees_with_last_update_wins() -> None:
    seen = (("a", 1000),)
    assert sequential("a", 900, seen, remote_commit_time=1001)
    assert not sequential("a", 900, seen, remote_commit_time=900)  # a tie: the node names decide
    assert not sequential("a", 900, seen, remote_commit_time=800)  # a skewed clock: the resolver decides
