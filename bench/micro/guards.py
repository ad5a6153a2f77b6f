"""Target-side cost of one TPC-B transaction as pgmesh's applier sends it, by guard variant.

Where the applier's time goes on the target: one node b after `pgmesh init` (pgbench tables at scale 1,
`pgbench_history` with a key), one session set up as the applier's (`session_replication_role = replica`,
the source's replication origin), and batches of 250 TPC-B transactions sent as one simple query each,
as the applier batches them. Each variant gets the same number of batches, interleaved, with fresh random
keys; the figure is target wall time per transaction (the query's round trip / 250), min and median.

  pgmesh      what `router.apply.statements` emits: the scripts are built by `transaction_script` itself,
              from TPC-B changes as pgoutput sends them, with the applier's prepared statements. Per
              transaction BEGIN, the origin's xact_setup (prepared), three guarded UPDATEs (a
              data-modifying CTE; the origin and row-count checks are inline CASEs that call PL/pgSQL
              only for a row that does not fit), the insert's locks and the guarded INSERT (it raises
              in its WHERE clause when a tombstone holds the key), COMMIT: 8 statements.
  plpgsql     what `router.apply.statements` emitted before (session 4 of the performance issue): the same
              statements with `pgmesh.expect_origin` called per row, `pgmesh.expect_rows` on every
              count, the insert counted through a CTE, and the xact_setup as a SELECT with literals.
  fused       plpgsql's checks with the four changes in one prepared statement (one CTE per change,
              one `expect_rows` on the sum): 5 statements. Valid only when no two changes touch the
              same key.
  setup       plpgsql, with the origin's xact_setup as a prepared statement.
  setup_lock  setup, the insert's locks taken in that same statement: 7 statements.
  updates     the UPDATEs guarded as plpgsql does, the INSERT plain (no lock, no tombstone probe).
  cte_only    the CTEs and `expect_rows`, no origin check, plain INSERT.
  unguarded   plain prepared UPDATEs and INSERT, no conflict detection at all: the floor of this way of
              applying (what the guards cost is pgmesh minus this).

    .venv/bin/python -m bench.micro.guards                 # 8 batches per variant
    .venv/bin/python -m bench.micro.guards --batches 4 --variant pgmesh --variant plpgsql --variant unguarded

Owns: the variants' SQL, the TPC-B changes as pgoutput sends them, and the table. Must not: build the
`pgmesh` variant's SQL itself (`router.apply.scripts.transaction_script` does, as for the applier), or
touch a node it did not create.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Sequence

from bench.harness.nodes import NODE_SETTINGS, pgbench_init, run_async
from bench.harness.pgmesh import Pgmesh2
from protocol.messages import Column, Insert, Relation, TupleData, Update
from protocol.transactions import Change, Transaction
from router.apply.prepared import Prepared
from router.apply.scripts import transaction_script
from router.apply.sessions import open_session
from router.apply.statements import TargetTable
from router.testing.localnodes import LocalNode, create_nodes

PER_BATCH = 250
FILLER = " " * 84
WHEN = "2026-01-01 00:00:00"
WHEN_US = 820_540_800_000_000  # WHEN as a commit time: µs since 2000-01-01 UTC

_UPDATES = (
    ("pgbench_accounts", "aid = $1, bid = $2, abalance = $3, filler = $4", "aid = $5", 6),
    ("pgbench_tellers", "tid = $1, bid = $2, tbalance = $3, filler = $4", "tid = $5", 6),
    ("pgbench_branches", "bid = $1, bbalance = $2, filler = $3", "bid = $4", 5),
)
_LOCK = ("SELECT pg_catalog.pg_advisory_xact_lock_shared(pg_catalog.hashtext('public.pgbench_history'), 0),"
         " pg_catalog.pg_advisory_xact_lock(pg_catalog.hashtextextended('public.pgbench_history:' ||"
         " pg_catalog.array_to_string(ARRAY[$1::bigint::text]::text[], ','), 0))")
_HISTORY = "INSERT INTO pgbench_history (tid, bid, aid, delta, mtime, filler, hid) OVERRIDING SYSTEM VALUE"
_PICKS = ("$1::integer, $2::integer, $3::integer, $4::integer, $5::timestamp without time zone,"
          " $6::character(22), $7::bigint")
_NO_TOMBSTONE = ("NOT EXISTS (SELECT 1 FROM pgmesh.tombstones t WHERE t.table_name = 'public.pgbench_history'"
                 " AND t.key = ARRAY[$7::bigint::text]::text[])")


def _prepares(variant: str) -> list[str]:
    out: list[str] = []
    if variant in ("setup", "setup_lock"):
        setup = "SELECT pg_catalog.pg_replication_origin_xact_setup($1, $2)"
        if variant == "setup_lock":
            setup += _LOCK.replace("$1", "$3").replace("SELECT ", ", ", 1)
        out.append(f"PREPARE {variant}_setup AS {setup}")
        out.extend(p.replace("PREPARE plpgsql_", f"PREPARE {variant}_") for p in _prepares("plpgsql"))
        return out
    if variant == "fused":
        out.append(f"PREPARE fused_lock AS {_LOCK}")
        shifted = _PICKS
        for n in range(7, 0, -1):
            shifted = shifted.replace(f"${n}:", f"${n + 15}:")
        ctes = [
            "u1 AS (UPDATE pgbench_accounts SET aid = $1, bid = $2, abalance = $3, filler = $4"
            " WHERE aid = $5 AND pgmesh.expect_origin(xmin, $6) RETURNING 1)",
            "u2 AS (UPDATE pgbench_tellers SET tid = $7, bid = $8, tbalance = $9, filler = $10"
            " WHERE tid = $11 AND pgmesh.expect_origin(xmin, $6) RETURNING 1)",
            "u3 AS (UPDATE pgbench_branches SET bid = $12, bbalance = $13, filler = $14"
            " WHERE bid = $15 AND pgmesh.expect_origin(xmin, $6) RETURNING 1)",
            f"i1 AS ({_HISTORY} SELECT {shifted} WHERE {_NO_TOMBSTONE.replace('$7', '$22')} RETURNING 1)",
        ]
        total = " + ".join(f"(SELECT count(*) FROM {c})" for c in ("u1", "u2", "u3", "i1"))
        out.append(f"PREPARE fused AS WITH {', '.join(ctes)} SELECT pgmesh.expect_rows({total}, 4)")
        return out
    for i, (table, sets, where, origin) in enumerate(_UPDATES, 1):
        update = f"UPDATE {table} SET {sets} WHERE {where}"
        if variant in ("plpgsql", "updates", "setup", "setup_lock"):
            body = (f"WITH w AS ({update} AND pgmesh.expect_origin(xmin, ${origin}) RETURNING 1)"
                    " SELECT pgmesh.expect_rows(count(*), 1) FROM w")
        elif variant == "cte_only":
            body = (f"WITH w AS ({update} AND ${origin}::oid IS NOT NULL RETURNING 1)"
                    " SELECT pgmesh.expect_rows(count(*), 1) FROM w")
        else:
            body = f"{update} AND ${origin}::oid IS NOT NULL"
        out.append(f"PREPARE {variant}_{i} AS {body}")
    if variant == "plpgsql":
        out.append(f"PREPARE plpgsql_lock AS {_LOCK}")
        out.append(f"PREPARE plpgsql_insert AS WITH w AS ({_HISTORY} SELECT {_PICKS} WHERE {_NO_TOMBSTONE}"
                   " RETURNING 1) SELECT pgmesh.expect_rows(count(*), 1) FROM w")
    else:
        out.append(f"PREPARE {variant}_insert AS {_HISTORY} VALUES ($1, $2, $3, $4, $5, $6, $7)")
    return out


# The pgbench tables as pgoutput describes them (text values), and as the applier finds them on the target.
_TABLES: dict[str, tuple[tuple[str, int, str, bool], ...]] = {
    "pgbench_accounts": (("aid", 23, "integer", True), ("bid", 23, "integer", False),
                         ("abalance", 23, "integer", False), ("filler", 1042, "character(84)", False)),
    "pgbench_tellers": (("tid", 23, "integer", True), ("bid", 23, "integer", False),
                        ("tbalance", 23, "integer", False), ("filler", 1042, "character(84)", False)),
    "pgbench_branches": (("bid", 23, "integer", True), ("bbalance", 23, "integer", False),
                         ("filler", 1042, "character(88)", False)),
    "pgbench_history": (("tid", 23, "integer", False), ("bid", 23, "integer", False),
                        ("aid", 23, "integer", False), ("delta", 23, "integer", False),
                        ("mtime", 1114, "timestamp without time zone", False),
                        ("filler", 1042, "character(22)", False), ("hid", 20, "bigint", True)),
}
RELATIONS = {
    name: Relation(16384 + i, "public", name, "d", tuple(Column(c, oid, -1, key) for c, oid, _, key in cols))
    for i, (name, cols) in enumerate(_TABLES.items())
}
TARGET = {
    ("public", name): TargetTable(
        "public", name, frozenset(c for c, *_ in cols), {c: t for c, _, t, _ in cols},
        pk=tuple(c for c, _, _, key in cols if key),
    )
    for name, cols in _TABLES.items()
}


def _row(values: Sequence[object]) -> TupleData:
    cells = tuple(None if v is None else str(v).encode() for v in values)
    return TupleData(bytes(0x6E if v is None else 0x74 for v in cells), cells)


def _emitted_batch(first_hid: int, origin: int, rng: random.Random, prepared: Prepared) -> tuple[str, str]:
    """The PREPAREs not sent yet, and the batch, as `router.apply.statements` writes them for the applier."""
    prelude: list[str] = []
    scripts = []
    rel = RELATIONS
    for hid in range(first_hid, first_hid + PER_BATCH):
        aid, tid, delta = rng.randint(1, 100_000), rng.randint(1, 10), rng.randint(-5000, 5000)
        changes: list[Change] = [
            Update(rel["pgbench_accounts"].relid, _row((aid, 1, delta, FILLER))),
            Update(rel["pgbench_tellers"].relid, _row((tid, 1, delta, None))),
            Update(rel["pgbench_branches"].relid, _row((1, delta, None))),
            Insert(rel["pgbench_history"].relid, _row((tid, 1, aid, delta, WHEN, None, hid))),
        ]
        relations = {r.relid: r for r in rel.values()}
        txn = Transaction(hid, hid << 8, (hid << 8) + 1, WHEN_US + hid, changes, relations)
        scripts.append(
            transaction_script(txn, TARGET, prepared=prepared, guard_origin=origin, prelude=prelude)
        )
    return "".join(f"{p};\n" for p in prelude), "\n".join(scripts)


def _batch(variant: str, first_hid: int, origin: int, rng: random.Random) -> str:
    out: list[str] = []
    for hid in range(first_hid, first_hid + PER_BATCH):
        aid, tid, delta = rng.randint(1, 100_000), rng.randint(1, 10), rng.randint(-5000, 5000)
        out.append("BEGIN")
        if variant == "setup":
            out.append(f"EXECUTE setup_setup('0/{hid:X}', '{WHEN}+00')")
        elif variant == "setup_lock":
            out.append(f"EXECUTE setup_lock_setup('0/{hid:X}', '{WHEN}+00', '{hid}')")
        else:
            out.append(f"SELECT pg_catalog.pg_replication_origin_xact_setup('0/{hid:X}', '{WHEN}+00')")
        history = f"'{tid}', '1', '{aid}', '{delta}', '{WHEN}', NULL, '{hid}'"
        if variant == "fused":
            out.append(f"EXECUTE fused_lock('{hid}')")
            out.append(f"EXECUTE fused('{aid}', '1', '{delta}', '{FILLER}', '{aid}', '{origin}',"
                       f" '{tid}', '1', '{delta}', NULL, '{tid}', '1', '{delta}', NULL, '1', {history})")
        else:
            out.append(f"EXECUTE {variant}_1('{aid}', '1', '{delta}', '{FILLER}', '{aid}', '{origin}')")
            out.append(f"EXECUTE {variant}_2('{tid}', '1', '{delta}', NULL, '{tid}', '{origin}')")
            out.append(f"EXECUTE {variant}_3('1', '{delta}', NULL, '1', '{origin}')")
            if variant in ("plpgsql", "setup"):
                out.append(f"EXECUTE {variant}_lock('{hid}')")
            out.append(f"EXECUTE {variant}_insert({history})")
        out.append("COMMIT")
    return ";\n".join(out) + ";"


async def measure(nodes: list[LocalNode], variants: Sequence[str], batches: int) -> dict[str, list[float]]:
    for node in nodes:
        await pgbench_init(node)
    system = Pgmesh2(nodes)
    await system.setup()
    conn = await open_session(nodes[1].dsn())  # set up as the applier's sessions are
    try:
        # rows from before this point are every node's common start (what the applier sets, too)
        await conn.execute("SELECT set_config('pgmesh.installed_at', now()::text, false)")
        origin = await conn.fetchval(
            "SELECT roident FROM pg_catalog.pg_replication_origin WHERE roname = $1", system.origin)
        await conn.execute("SELECT pg_catalog.pg_replication_origin_session_setup($1)", system.origin)
        for variant in variants:
            if variant != "pgmesh":
                await conn.execute(";\n".join(_prepares(variant)))
        prepared = Prepared()
        rng = random.Random(7)
        hid = 1

        async def script_for(variant: str) -> str:
            """The next batch of `variant` (the applier's PREPAREs it needs sent first, untimed)."""
            nonlocal hid
            if variant == "pgmesh":
                prelude, script = _emitted_batch(hid, origin, rng, prepared)
                if prelude:
                    await conn.execute(prelude)
            else:
                script = _batch(variant, hid, origin, rng)
            hid += PER_BATCH
            return script

        out: dict[str, list[float]] = {v: [] for v in variants}
        for variant in variants:
            await conn.execute(await script_for(variant))  # warm-up (generic plans)
        for _ in range(batches):
            for variant in variants:
                script = await script_for(variant)
                began = time.perf_counter()
                await conn.execute(script)
                out[variant].append((time.perf_counter() - began) / PER_BATCH * 1e6)
        return out
    finally:
        await conn.close()


VARIANTS = ("pgmesh", "plpgsql", "setup", "setup_lock", "fused", "updates", "cte_only", "unguarded")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.micro.guards", description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=8, help="batches of 250 transactions per variant")
    parser.add_argument("--variant", action="append", choices=VARIANTS, help="repeatable (default: all)")
    args = parser.parse_args(argv)
    variants = args.variant or list(VARIANTS)
    nodes = create_nodes(["a", "b"], settings=NODE_SETTINGS)
    try:
        results = run_async(lambda: measure(nodes, variants, args.batches))
    finally:
        for node in nodes:
            node.destroy()
    base = statistics.median(results[variants[0]])
    print(f"target µs per TPC-B transaction ({args.batches} batches of {PER_BATCH} per variant)")
    print("| variant | min | median | vs " + variants[0] + " |")
    print("|---|--:|--:|--:|")
    for variant, values in results.items():
        median = statistics.median(values)
        print(f"| {variant} | {min(values):.0f} | {median:.0f} | {median / base:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
