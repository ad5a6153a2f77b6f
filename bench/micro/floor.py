"""The floor of applying by SQL: the target backend's CPU per transaction, pgmesh's against plain statements.

What bounds issue 20's targets on a machine where every process shares the same cores: throughput there is
the cores over the CPU every process spends per transaction, and the target's backend is one of them. This
micro measures that backend alone (its own CPU from /proc, not wall time), on one node b set up as the
bench's pgmesh2 (`pgmesh init`, pgbench tables at scale 1, `bench_ins`), in sessions set up as the
applier's (`session_replication_role = replica`, `synchronous_commit = off`, the source's replication
origin), for two transaction shapes, each in batches of 250 transactions per round trip:

  tpcb     three keyed UPDATEs (every column, as pgoutput sends them) and one INSERT into pgbench_history
  inserts  one INSERT into bench_ins

and four ways of sending them:

  pgmesh    what the applier sends: `router.apply.scripts.transaction_script` builds each script from the
            changes as pgoutput sends them (guards, locks, the origin's set-up), one simple query a batch
  simple    the floor of that protocol: BEGIN, plain prepared statements (no conflict detection, no locks),
            the origin's xact_setup (its position moves with the data, as native's does), COMMIT
  pipeline  the same plain statements by the extended protocol (Bind/Execute of statements prepared once,
            text parameters straight from the tuple, no SQL text), pipelined with one Sync a batch (libpq
            pipeline mode): the floor of any client-side apply over SQL
  pipe      what the applier sends through its pipe for the same transactions as `pgmesh`:
            `router.apply.encode` and `router.apply.shapes.Statements` plan each batch (the decision
            functions, the origin's set-up, on 16+ the applied mark and the batch's applied note), its
            statements prepared before it, then run by Bind/Execute with one Sync a batch, as
            `router.apply.pipe` sends it

Compare with the native apply worker's CPU per transaction from `bench.suite.profile` in the same sitting.

    .venv/bin/python -m bench.micro.floor                  # 8 batches per shape and way
    .venv/bin/python -m bench.micro.floor --batches 4 --shape inserts

Owns: the plain statements and their batches. Must not: build the `pgmesh` or `pipe` way's SQL itself
(`transaction_script` and `Statements` do, as for the applier), or touch a node it did not create.
"""

from __future__ import annotations

import argparse
import random
import select
import statistics
import sys
from collections.abc import Callable, Sequence
from typing import Final

import psycopg
from psycopg import pq

from bench.harness.nodes import NODE_SETTINGS, pgbench_init, run_async
from bench.harness.pgmesh import Pgmesh2
from bench.harness.workloads import SCHEMA
from bench.micro import guards
from protocol.messages import Column, Insert, Relation, TupleData, Update
from protocol.transactions import Change, Transaction
from router.apply.decide import Decisions
from router.apply.encode import Encoder
from router.apply.prepared import Prepared
from router.apply.scripts import transaction_script
from router.apply.shapes import Plan, Statements
from router.apply.statements import TargetTable
from router.progress.applied import MARK_START, SOURCE_SETTING
from router.stream.items import ORIGIN_NONE_SINCE
from router.testing.localnodes import LocalNode, create_nodes
from router.testing.mesh import execute, fetch

PER_BATCH = 250
SHAPES = ("tpcb", "inserts")
WAYS = ("pgmesh", "simple", "pipeline", "pipe")
_OK = (pq.ExecStatus.COMMAND_OK, pq.ExecStatus.TUPLES_OK)

_INS = Relation(16400, "public", "bench_ins", "d", (
    Column("id", 20, -1, True), Column("v", 23, -1, False), Column("at", 1184, -1, False)))
_INS_TARGET = TargetTable("public", "bench_ins", frozenset(("id", "v", "at")),
                          {"id": "bigint", "v": "integer", "at": "timestamp with time zone"}, pk=("id",))
TABLES: Final = {**guards.TARGET, ("public", "bench_ins"): _INS_TARGET}
_PLAIN = {
    "u1": "UPDATE pgbench_accounts SET aid = $1, bid = $2, abalance = $3, filler = $4 WHERE aid = $5",
    "u2": "UPDATE pgbench_tellers SET tid = $1, bid = $2, tbalance = $3, filler = $4 WHERE tid = $5",
    "u3": "UPDATE pgbench_branches SET bid = $1, bbalance = $2, filler = $3 WHERE bid = $4",
    "h": "INSERT INTO pgbench_history (tid, bid, aid, delta, mtime, filler, hid) OVERRIDING SYSTEM VALUE"
         " VALUES ($1, $2, $3, $4, $5, $6, $7)",
    "i": "INSERT INTO bench_ins (id, v, at) VALUES ($1, $2, $3)",
    "s": "SELECT pg_catalog.pg_replication_origin_xact_setup($1, $2)",
    "b": "BEGIN",
    "c": "COMMIT",
}
Statement = tuple[str, list[bytes | None]]


class Keys:
    """Fresh keys for every batch, the same random draw for every way."""

    def __init__(self) -> None:
        self.rng = random.Random(7)
        self.next_id = 1
        self.lsn = 1

    def tpcb(self) -> list[list[Statement]]:
        out: list[list[Statement]] = []
        for _ in range(PER_BATCH):
            rng = self.rng
            aid, tid, delta = rng.randint(1, 100_000), rng.randint(1, 10), rng.randint(-5000, 5000)
            d = str(delta).encode()
            out.append([
                ("u1", [str(aid).encode(), b"1", d, guards.FILLER.encode(), str(aid).encode()]),
                ("u2", [str(tid).encode(), b"1", d, None, str(tid).encode()]),
                ("u3", [b"1", d, None, b"1"]),
                ("h", [str(tid).encode(), b"1", str(aid).encode(), d, guards.WHEN.encode(), None,
                       str(self.next_id).encode()]),
            ])
            self.next_id += 1
        return out

    def inserts(self) -> list[list[Statement]]:
        out: list[list[Statement]] = []
        for _ in range(PER_BATCH):
            out.append([("i", [str(self.next_id).encode(), b"1", f"{guards.WHEN}+00".encode()])])
            self.next_id += 1
        return out

    def setup(self) -> Statement:
        self.lsn += 1
        return ("s", [f"0/{self.lsn << 8:X}".encode(), f"{guards.WHEN}+00".encode()])


def _literal(value: bytes | None) -> str:
    return "NULL" if value is None else "'" + value.decode().replace("'", "''") + "'"


def transactions(batch: list[list[Statement]], keys: Keys) -> list[Transaction]:
    """`batch` as the source's transactions, their changes as pgoutput sends them."""
    relations = {r.relid: r for r in (*guards.RELATIONS.values(), _INS)}
    by_name = {"u1": "pgbench_accounts", "u2": "pgbench_tellers", "u3": "pgbench_branches",
               "h": "pgbench_history"}
    out = []
    for statements in batch:
        changes: list[Change] = []
        for name, values in statements:
            if name == "i":
                changes.append(Insert(_INS.relid, _row(values)))
                continue
            relation = guards.RELATIONS[by_name[name]]
            row = values if name == "h" else values[: len(relation.columns)]
            kind = Insert if name == "h" else Update
            changes.append(kind(relation.relid, _row(row)))
        keys.lsn += 1
        lsn = keys.lsn
        out.append(Transaction(lsn, lsn << 8, (lsn << 8) + 1, guards.WHEN_US + lsn, changes, relations))
    return out


def _pgmesh_script(
    txns: list[Transaction], prepared: Prepared, origin: int, sixteen: bool
) -> tuple[str, str]:
    """The applier's prelude and script for `txns`, built by `transaction_script` as `LinkSession.script`
    builds it on a link that met no conflict lately (no `pgmesh.remote`); on 16+ the set-up comes last and
    sets the applied mark."""
    prelude: list[str] = []
    scripts = [
        transaction_script(txn, TABLES, prepared=prepared, guard_origin=origin, prelude=prelude,
                           remote=False, setup_last=sixteen, mark=sixteen)
        for txn in txns
    ]
    return "".join(f"{p};\n" for p in prelude), "\n".join(scripts)


def _pipe_plan(txns: list[Transaction], encoder: Encoder, statements: Statements, prepared: Prepared,
               source: str) -> Plan:
    """What `router.apply.sender.Sender.pipe` sends for `txns` on a link that met no conflict lately (no
    remote version): each transaction's statements, then the batch's ending (16+: the applied note)."""
    plan: Plan = []
    for txn in txns:
        enc = encoder.encoded(txn)
        assert enc is not None, "the pipe takes every transaction here"
        plan += statements.transaction(enc, prepared, False)
    plan += statements.ending(txns, statements.late, source)  # announce: on 16+, as the link's
    return plan


def _row(values: Sequence[bytes | None]) -> TupleData:
    return TupleData(bytes(0x6E if v is None else 0x74 for v in values), tuple(values))


def _simple_script(batch: list[list[Statement]], keys: Keys) -> str:
    parts = []
    for statements in batch:
        parts.append("BEGIN")
        for name, values in [*statements, keys.setup()]:
            parts.append(f"EXECUTE p_{name}({', '.join(_literal(v) for v in values)})")
        parts.append("COMMIT")
    return ";\n".join(parts)


class Session:
    """One session on b set up as the applier's, driven through libpq (psycopg's `pq`)."""

    def __init__(self, dsn: str, origin: str, source: str) -> None:
        self.conn = psycopg.connect(dsn, autocommit=True)
        self.conn.execute("SET session_replication_role = replica; SET synchronous_commit = off")
        self.conn.execute("SELECT set_config('pgmesh.installed_at', now()::text, false)")
        # the decision functions are this node's own, not DDL to replicate (as `make_functions`)
        self.conn.execute("SELECT pg_catalog.set_config('pgmesh.ddl_local', 'on', false)")
        self.sixteen = self.conn.info.server_version >= ORIGIN_NONE_SINCE
        if self.sixteen:  # the applied mark (router.progress.applied), as the applier's connection starts it
            self.conn.execute("SELECT set_config(%s, %s, false)", [SOURCE_SETTING, source])
            self.conn.execute(MARK_START.replace("$1", "%s").replace("$2", "%s"), [origin, source])
        self.conn.execute("SELECT pg_catalog.pg_replication_origin_session_setup(%s)", [origin])
        self.pg = self.conn.pgconn
        for name, body in _PLAIN.items():
            if name not in ("b", "c"):  # for `simple`; BEGIN and COMMIT it sends as they are
                self.conn.execute(f"PREPARE p_{name} AS {body}")
            result = self.pg.prepare(name.encode(), body.encode())
            if result.status not in _OK:
                raise RuntimeError(result.error_message.decode())

    def cpu(self) -> float:
        """The backend's CPU seconds so far (the scheduler's nanoseconds: /proc's ticks are too coarse)."""
        with open(f"/proc/{self.pg.backend_pid}/schedstat") as f:
            return int(f.read().split()[0]) / 1e9

    def simple(self, text: str) -> None:
        self.pg.send_query(text.encode())
        while (result := self.pg.get_result()) is not None:
            if result.status not in _OK:
                raise RuntimeError(result.error_message.decode())

    def pipeline(self, batch: list[list[Statement]], keys: Keys) -> None:
        pg = self.pg
        pg.enter_pipeline_mode()
        sent = 0
        for statements in batch:
            for name, values in [("b", []), *statements, keys.setup(), ("c", [])]:
                pg.send_query_prepared(name.encode(), values or None)
                sent += 1
        self._sync(sent)

    def piped(self, prepares: Sequence[tuple[bytes, str, Sequence[int] | None]], plan: Plan) -> None:
        """Prepare `prepares` (name, SQL, parameter types) and run `plan` (name, parameters), one Sync, as
        `router.apply.pipe.Pipe.send` does."""
        pg = self.pg
        pg.enter_pipeline_mode()
        for name, sql, types in prepares:
            pg.send_prepare(name, sql.encode(), types)
        for name, params in plan:
            pg.send_query_prepared(name, params)
        self._sync(len(prepares) + len(plan))

    def _sync(self, sent: int) -> None:
        """Sync the pipeline, read the `sent` commands' results up to it, leave pipeline mode."""
        pg = self.pg
        pg.pipeline_sync()
        while pg.flush():
            select.select([], [pg.socket], [])
        while True:
            while pg.is_busy():
                select.select([pg.socket], [], [])
                pg.consume_input()
            result = pg.get_result()
            if result is None:
                continue
            if result.status == pq.ExecStatus.PIPELINE_SYNC:
                break
            if result.status not in _OK:
                raise RuntimeError(result.error_message.decode())
            sent -= 1
        pg.exit_pipeline_mode()
        if sent:
            raise RuntimeError(f"{sent} statements without a result")

    def close(self) -> None:
        self.conn.execute("SELECT pg_catalog.pg_replication_origin_session_reset()")
        self.conn.close()


async def prepare(nodes: list[LocalNode]) -> tuple[Pgmesh2, int]:
    for node in nodes:
        await pgbench_init(node)
        await execute(node.dsn(), SCHEMA)
    system = Pgmesh2(nodes)
    await system.setup()
    query = "SELECT roident FROM pg_catalog.pg_replication_origin WHERE roname = %s"
    rows = await fetch(nodes[1].dsn(), query, [system.origin])
    return system, int(rows[0][0])


def measure(node: LocalNode, system: Pgmesh2, origin_id: int, shapes: Sequence[str], ways: Sequence[str],
            batches: int) -> dict[tuple[str, str], list[float]]:
    """Backend CPU µs per transaction, per (shape, way), one figure per batch; ways interleaved."""
    keys = Keys()
    assert system.config is not None  # set up by `prepare`
    prepared = Prepared(Decisions(system.config))  # the statements decide conflicts, as the applier's
    # one session: a replication origin is one session's at a time
    session = Session(node.dsn(), system.origin, system.a.name)
    # the pipe's, as `LinkSession.open_pipe` sets them up (tables, Decisions and Prepared: `pgmesh`'s)
    encoder = Encoder()
    statements = Statements(system.a.name, system.origin, late=session.sixteen, mark=session.sixteen)
    statements.tables = TABLES
    statements.origin = str(origin_id)
    runs: dict[str, Callable[[Session, list[list[Statement]]], None]] = {
        "simple": lambda s, b: s.simple(_simple_script(b, keys)),
        "pipeline": lambda s, b: s.pipeline(b, keys),
    }
    out: dict[tuple[str, str], list[float]] = {(s, w): [] for s in shapes for w in ways}
    try:
        for round_ in range(batches + 1):  # the first round warms up (generic plans), untimed
            for shape in shapes:
                for way in ways:
                    batch = keys.tpcb() if shape == "tpcb" else keys.inserts()
                    if way == "pgmesh":
                        txns = transactions(batch, keys)
                        prelude, script = _pgmesh_script(txns, prepared, origin_id, session.sixteen)
                        _make_functions(session, prepared)
                        if prelude:
                            session.simple(prelude)
                        began = session.cpu()
                        session.simple(script)
                    elif way == "pipe":
                        txns = transactions(batch, keys)
                        plan = _pipe_plan(txns, encoder, statements, prepared, system.a.name)
                        _make_functions(session, prepared)
                        prepares = statements.new
                        statements.sent()
                        if prepares:  # as `pgmesh`'s prelude: prepared before, outside the measure
                            session.piped(prepares, [])
                        statements.fresh = []  # the batch succeeded (`Sender.pipe`)
                        began = session.cpu()
                        session.piped([], plan)
                    else:
                        began = session.cpu()
                        runs[way](session, batch)
                    if round_:
                        out[(shape, way)].append((session.cpu() - began) / PER_BATCH * 1e6)
    finally:
        session.close()
    return out


def _make_functions(session: Session, prepared: Prepared) -> None:
    """The decision functions not created yet, as `LinkSession.make_functions`."""
    if prepared.creates:
        session.simple(";\n".join(prepared.creates))
        prepared.creates = []


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.micro.floor", description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=8, help="timed batches of 250 per shape and way")
    parser.add_argument("--shape", action="append", choices=SHAPES, help="repeatable (default: both)")
    parser.add_argument("--way", action="append", choices=WAYS, help="repeatable (default: all)")
    args = parser.parse_args(argv)
    shapes, ways = args.shape or list(SHAPES), args.way or list(WAYS)
    nodes = create_nodes(["a", "b"], settings=NODE_SETTINGS)
    try:
        system, origin_id = run_async(lambda: prepare(nodes))
        results = measure(nodes[1], system, origin_id, shapes, ways, args.batches)
    finally:
        for node in nodes:
            node.destroy()
    print(f"target backend CPU µs per transaction ({args.batches} batches of {PER_BATCH} per shape and way)")
    print_table(results, shapes, ways, ways[0])
    return 0


def print_table(
    results: dict[tuple[str, str], list[float]], shapes: Sequence[str], ways: Sequence[str], base: str
) -> None:
    """Min and median µs per shape and way, and each median against `base`'s (also bench.micro.pipecpu)."""
    print(f"| shape | way | min | median | vs {base} |")
    print("|---|---|--:|--:|--:|")
    for shape in shapes:
        reference = statistics.median(results[(shape, base)])
        for way in ways:
            values = results[(shape, way)]
            median = statistics.median(values)
            print(f"| {shape} | {way} | {min(values):.1f} | {median:.1f} | {median / reference:.2f} |")


if __name__ == "__main__":
    sys.exit(main())
