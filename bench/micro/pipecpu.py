"""The router's CPU per transaction on the pipe's apply side (router.apply.pipe): plan, send, read back.

One node b set up as bench.micro.floor's (pgmesh init, pgbench tables, `bench_ins`), TPC-B and one-row
insert transactions as pgoutput sends them (floor's `Keys`), encoded by `router.apply.encode` (untimed),
then, in batches of 250 (`--size`), three ways, interleaved, each its own session and `Encoder` (its
shapes and statements kept across batches, as a source's):

  libpq    `Statements.transaction` plans, libpq's pipeline mode sends and reads (`Pipe.open(libpq=True)`,
           what a TLS session does, and every session before the socket pipe)
  socket   `Statements.wire` builds each change's Bind + Execute, written to the socket and the answer
           walked by protocol.frontend (`_SocketPipe`): the first of a source's links
  shared   the same with the Bind bytes already built by another link (`Encoded.bound`): each further
           link of the source

The figure is this process's CPU (time.process_time) per transaction, from the plan to the results read,
so the router's per-link cost of the apply side, without decoding (the same for every way).

    .venv/bin/python -m bench.micro.pipecpu                # 8 batches per shape and way, ~30 s
    .venv/bin/python -m bench.micro.pipecpu --batches 40 --size 10 --shape inserts

Must not: touch a node it did not create.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Sequence
from typing import Any

import psycopg

from bench.harness.nodes import NODE_SETTINGS, run_async
from bench.micro import floor
from router.apply.decide import Decisions, session_settings
from router.apply.encode import Encoded, Encoder
from router.apply.pipe import Pipe
from router.apply.prepared import Prepared
from router.apply.shapes import Statements
from router.progress.applied import MARK_START
from router.stream.items import ORIGIN_NONE_SINCE
from router.testing.localnodes import create_nodes

WAYS = ("libpq", "socket", "shared")


async def _open(dsn: str, way: str, source: str, settings: str) -> Pipe:
    async with await psycopg.AsyncConnection.connect(dsn) as conn:  # rows before now: no conflict (floor's)
        cur = await conn.execute("SELECT now()::text")
        row = await cur.fetchone()
        assert row is not None
        installed_at = str(row[0])
    return await Pipe.open(dsn, "b", source=source, synchronous_commit="off", installed_at=installed_at,
                           settings=settings, libpq=way == "libpq")


async def measure(dsn: str, system: Any, origin_id: int, shapes: Sequence[str],
                  batches: int, size: int) -> dict[tuple[str, str], list[float]]:
    keys = floor.Keys()
    prepared = Prepared(Decisions(system.config))
    source, origin = system.a.name, system.origin
    settings = session_settings(source, "b", origin_id, system.config.origin_name(""))
    out: dict[tuple[str, str], list[float]] = {(s, w): [] for s in shapes for w in WAYS}
    pipes, plans = {}, {}
    encoders = {way: Encoder() for way in WAYS}  # one a way for the run, as one a source (its shapes kept)
    for way in WAYS:
        pipes[way] = await _open(dsn, way, source, settings)
        async with await psycopg.AsyncConnection.connect(dsn) as conn:
            cur = await conn.execute("SHOW server_version_num")
            row = await cur.fetchone()
            sixteen = row is not None and int(row[0]) >= ORIGIN_NONE_SINCE
        plans[way] = Statements(source, origin, late=sixteen, mark=sixteen)
        plans[way].tables = floor.TABLES
        plans[way].origin = str(origin_id)
        if sixteen:
            await pipes[way].statement(MARK_START, [origin.encode(), source.encode()])
    try:
        for round_ in range(batches + 1):  # the first round warms up (prepares), untimed
            for shape in shapes:
                for way in WAYS:
                    batch = (keys.tpcb() if shape == "tpcb" else keys.inserts())[:size]
                    txns = floor.transactions(batch, keys)
                    encoded = [encoders[way].encoded(t) for t in txns]
                    pipe, statements = pipes[way], plans[way]
                    await pipe.take_origin(origin)
                    if way == "shared":  # another link built the Bind bytes
                        for enc in encoded:
                            assert enc is not None
                            statements.wire(enc, prepared, False)
                    began = time.process_time()
                    await _batch(pipe, statements, prepared, [e for e in encoded if e is not None], txns, way)
                    spent = time.process_time() - began
                    await pipe.let_origin_go()
                    if round_:
                        out[(shape, way)].append(spent / size * 1e6)
    finally:
        for pipe in pipes.values():
            await pipe.close()
    return out


async def _functions(pipe: Pipe, prepared: Prepared) -> None:
    """The decision functions not created yet (as `LinkSession.make_functions`), untimed."""
    if prepared.creates:
        await pipe.statement("SELECT pg_catalog.set_config('pgmesh.ddl_local', 'on', false)")
        for create in prepared.creates:
            result = await pipe.statement(create)
            if result.error is not None:
                raise result.error
        prepared.creates = []


async def _batch(pipe: Pipe, statements: Statements, prepared: Prepared, encoded: list[Encoded],
                 txns: list[Any], way: str) -> None:
    """What `Sender.pipe` does for one batch, from the plan to the results."""
    build = statements.transaction if way == "libpq" else statements.wire
    plan: list[Any] = []
    for enc in encoded:
        plan += build(enc, prepared, False)
    plan += statements.ending(txns, statements.late, statements.source)
    await _functions(pipe, prepared)  # (the first round's only: untimed)
    prepares = statements.new
    statements.sent()
    closes, statements.stale = statements.stale, []
    commands = await pipe.send(prepares, plan, closes)
    result = await pipe.results(commands)
    if result.error is not None:
        raise result.error
    statements.fresh = []


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.micro.pipecpu",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=8, help="timed batches per shape and way")
    parser.add_argument("--size", type=int, default=floor.PER_BATCH, help="transactions a batch (<= 250)")
    parser.add_argument("--shape", action="append", choices=floor.SHAPES, help="repeatable (default: both)")
    args = parser.parse_args(argv)
    shapes = args.shape or list(floor.SHAPES)
    nodes = create_nodes(["a", "b"], settings=NODE_SETTINGS)
    try:
        system, origin_id = run_async(lambda: floor.prepare(nodes))
        results = asyncio.run(measure(nodes[1].dsn(), system, origin_id, shapes, args.batches, args.size))
    finally:
        for node in nodes:
            node.destroy()
    print(f"router CPU µs per transaction, apply side ({args.batches} batches of {args.size})")
    floor.print_table(results, shapes, WAYS, "libpq")
    return 0


if __name__ == "__main__":
    sys.exit(main())
