"""The extended protocol's frontend codec (protocol.frontend): the bytes of Parse, Bind + Execute, Close and
Sync, and `Results` over server answers captured from a real PostgreSQL 15.20 (the batches in `CAPTURED`'s
comments, sent by `python -m tests.unit.protocol.test_frontend`, which prints the answers as hex)."""

from __future__ import annotations

import asyncio
import struct

import asyncpg
import pytest

from protocol.frontend import (
    SYNC,
    Results,
    bind_body,
    bind_execute,
    bind_named,
    close_statement,
    error_fields,
    parse,
)

# The batches sent (each followed by Sync), in order, on one session with `CREATE TABLE t (id int PRIMARY
# KEY, v text)`; their answers are CAPTURED's values.
BATCHES: dict[str, list[bytes]] = {
    "batch": [close_statement(b"gone"), parse(b"s1", b"SELECT $1::int + 1", [25]),
              parse(b"s2", b"INSERT INTO t VALUES ($1, $2)"), bind_execute(b"s2", [b"1", None]),
              bind_execute(b"s1", [b"41"])],
    "nodecision": [parse(b"s3", b"SELECT 1 WHERE false"), bind_execute(b"s2", [b"2", b"x"]),
                   bind_execute(b"s3", None)],
    "error": [parse(b"b", b"BEGIN"), parse(b"c", b"COMMIT"), bind_execute(b"b", None),
              bind_execute(b"s2", [b"3", b"y"]), bind_execute(b"s2", [b"3", b"z"]),
              bind_execute(b"s1", [b"1"]), bind_execute(b"c", None)],
    "rollback": [parse(b"", b"ROLLBACK"), bind_execute(b"", None)],
    "notice": [parse(b"n", b"DO $$BEGIN RAISE NOTICE 'hello'; END$$"), bind_execute(b"n", None),
               parse(b"", b"SET application_name = 'pgmesh-capture'"), bind_execute(b"", None),
               parse(b"", b""), bind_execute(b"", None)],
}

CAPTURED = {name: bytes.fromhex(text) for name, text in {
    # CloseComplete, 2 ParseComplete, BindComplete, INSERT 0 1, BindComplete, DataRow (42), SELECT 1, ready
    "batch": "3300000004310000000431000000043200000004430000000f494e5345525420302031003200000004440000"
             "000c0001000000023432430000000d53454c4543542031005a0000000549",
    # the last statement returns no row
    "nodecision": "31000000043200000004430000000f494e5345525420302031003200000004430000000d53454c4543542030"
                  "005a0000000549",
    # BEGIN, an insert, a duplicate key (the error), then skipped to the Sync: ready in a failed transaction
    "error": "310000000431000000043200000004430000000a424547494e003200000004430000000f494e534552542030"
             "203100320000000445000000a8534552524f5200564552524f5200433233353035004d6475706c6963617465"
             "206b65792076616c75652076696f6c6174657320756e6971756520636f6e73747261696e742022745f706b65"
             "792200444b657920286964293d28332920616c7265616479206578697374732e00737075626c696300747400"
             "6e745f706b657900466e6274696e736572742e63004c36363400525f62745f636865636b5f756e6971756500"
             "005a0000000545",
    "rollback": "31000000043200000004430000000d524f4c4c4241434b005a0000000549",
    # a NoticeResponse, SET's ParameterStatus (sent before ReadyForQuery), an empty query
    "notice": "310000000432000000044e0000007a534e4f5449434500564e4f5449434500433030303030004d68656c6c6f"
              "0057504c2f706753514c2066756e6374696f6e20696e6c696e655f636f64655f626c6f636b206c696e652031"
              "2061742052414953450046706c5f657865632e63004c333930370052657865635f73746d745f726169736500"
              "004300000007444f003100000004320000000443000000085345540031000000043200000004490000000453"
              "000000246170706c69636174696f6e5f6e616d650070676d6573682d63617074757265005a0000000549",
}.items()}


def commands(batch: list[bytes]) -> int:
    """How many commands a batch sends: a Bind + Execute is one, as are a Parse and a Close."""
    return len(batch)


def read(name: str, chunk: int | None = None) -> Results:
    data = CAPTURED[name]
    results = Results(commands(BATCHES[name]))
    buf = bytearray()
    step = chunk or len(data)
    for start in range(0, len(data), step):
        buf += data[start:start + step]
        done = results.feed(buf)
        assert done == (start + step >= len(data))
    assert buf == b""
    return results


def test_a_batch_that_succeeds_and_decides() -> None:
    results = read("batch")
    assert results.ready and results.status == b"I"
    assert results.failed_at is None and results.error is None
    assert results.decided  # the last command (SELECT $1 + 1) returned a row
    assert results.index == 5


def test_the_last_command_without_a_row_did_not_decide() -> None:
    results = read("nodecision")
    assert results.ready and not results.decided and results.failed_at is None


def test_an_error_mid_batch_names_its_command_and_fields() -> None:
    results = read("error")
    assert results.failed_at == 4 and results.status == b"E"
    assert not results.decided  # the later commands were skipped
    error = results.error
    assert error is not None
    assert error["C"] == "23505" and error["S"] == "ERROR" and error["t"] == "t" and error["n"] == "t_pkey"
    assert error["D"] == "Key (id)=(3) already exists." and error["s"] == "public"
    assert set(error) == {"C", "M", "D", "S", "s", "t", "n"}  # V, F, L, R are not asyncpg's
    made = asyncpg.PostgresError.new(error)
    assert isinstance(made, asyncpg.UniqueViolationError) and made.constraint_name == "t_pkey"


def test_notices_parameter_statuses_and_empty_queries() -> None:
    results = read("notice")
    assert results.ready and results.failed_at is None and results.index == 6


@pytest.mark.parametrize("name", sorted(CAPTURED))
def test_answers_read_a_byte_at_a_time_are_the_same(name: str) -> None:
    whole, bytewise = read(name), read(name, 1)
    assert [getattr(whole, s) for s in Results.__slots__] == [getattr(bytewise, s) for s in Results.__slots__]


def test_feed_stops_at_ready_and_keeps_what_follows() -> None:
    buf = bytearray(CAPTURED["rollback"] + CAPTURED["batch"][:7])
    results = Results(2)
    assert results.feed(buf) and buf == CAPTURED["batch"][:7]
    rest = Results(5)
    assert not rest.feed(buf) and rest.index == 1  # CloseComplete read
    assert buf == CAPTURED["batch"][5:7]  # an incomplete message waits


def test_the_messages_bytes() -> None:
    assert SYNC == b"S\x00\x00\x00\x04"
    assert close_statement(b"ab") == b"C\x00\x00\x00\x08Sab\x00"
    assert parse(b"p", b"SELECT $1", [25]) == b"P" + struct.pack("!I", 22) + b"p\x00SELECT $1\x00\x00\x01" + \
        struct.pack("!I", 25)
    assert parse(b"", b"BEGIN") == b"P\x00\x00\x00\x0d\x00BEGIN\x00\x00\x00"
    bound = bind_execute(b"s", [b"xy", None, b""])
    bind = (b"\x00s\x00" + b"\x00\x00" + b"\x00\x03" + b"\x00\x00\x00\x02xy" + b"\xff\xff\xff\xff"
            + b"\x00\x00\x00\x00" + b"\x00\x00")
    assert bound == b"B" + struct.pack("!I", len(bind) + 4) + bind + b"E\x00\x00\x00\x09\x00\x00\x00\x00\x00"
    assert bind_execute(b"s", None) == bind_execute(b"s", ())
    assert bind_named(b"s", bind_body([b"xy", None, b""])) == bound  # a body shared by two names
    long, many = b"x" * 70_000, [b"1"] * 1500  # a length packed, not from the table; a count too
    start = b"B" + struct.pack("!I", 70_017) + b"\x00s\x00\x00\x00\x00\x01" + struct.pack("!I", 70_000)
    assert bind_execute(b"s", [long])[:18] == start + b"xx"
    assert bind_execute(b"s", many)[10:12] == struct.pack("!H", 1500)
    assert len(bind_execute(b"s", many)) == 1 + 4 + 1 + 2 + 2 + 2 + 1500 * 5 + 2 + 10


def test_error_fields_stop_at_the_terminator() -> None:
    assert error_fields(b"CXX000\x00Mboom\x00Fx.c\x00\x00") == {"C": "XX000", "M": "boom"}
    assert error_fields(b"\x00") == {}


async def _capture() -> None:  # pragma: no cover - run by hand, against a throw-away node
    import os
    import socket

    import psycopg

    from router.testing.localnodes import create_nodes

    (node,) = create_nodes(["frontend"])
    try:
        conn = await psycopg.AsyncConnection.connect(node.dsn(), autocommit=True)
        await conn.execute("CREATE TABLE t (id int PRIMARY KEY, v text)")
        sock = socket.socket(fileno=os.dup(conn.pgconn.socket))
        for name, batch in BATCHES.items():
            sock.sendall(b"".join(batch) + SYNC)
            data = b""
            while len(data) < 6 or data[-6] != ord("Z"):
                data += sock.recv(65536)
            print(name, data.hex())
        sock.close()
        await conn.close()
        print("version", node.sql("SHOW server_version").strip())
    finally:
        node.destroy()


if __name__ == "__main__":
    asyncio.run(_capture())
