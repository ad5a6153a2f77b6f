"""`pgmesh repair`: every persistent difference `pgmesh compare` finds, resolved and written.

Owns the command: compare, then per table the repair of its differences, with progress and run-time
hints on stderr (router.ops.compare.progress), or with `--dry-run` the plan alone (per table: keys, who
wins how many, rows to insert, update and delete per node), and the report.

Tables with a key, on the full nodes: set-based, by router.cluster.compare.fix (the differing keys read
in bulk on every node with their versions and tombstones, decided in Python by the conflict path's own
rules, router.cluster.compare.verdict: a tombstone newer than the row deletes it everywhere, an older one
gives way to it, a node with neither gets the row; `--from NODE`: that node's row or its absence), then
written per node through a staging table, one transaction per winning version, under the repair origin
of the version's node (`pgmeshrepair_<cluster>_<node>`: forwarded nowhere) and with its commit time.
Where the default rule copied rows to a node that held no record of deleting them, a hint names the
`--from NODE` that would keep that node's absence instead.

A partial node (router.cluster.partial) is never a source: the full nodes' differences are repaired
first, then each partial node's, key by key (those compare found, and the keys a repair rewrote on the
reference full node in a table it gets: a repair is forwarded nowhere) from the reference's row as it is
then: the row if the node's filter keeps it (its columns only, in the write and in the record: the node
never holds the others), else its absence.

A table without a key has no versions to weigh: its differing rows (each with its copies per node) are
repaired only with `--from NODE` (every other node then holds that node's copies of each, never more),
or on a partial node from its reference; without `--from` they are listed as not repaired, with the
command that would (router.cluster.compare.copies), and hinted at while the command runs. Identity
columns are written with OVERRIDING SYSTEM VALUE (a row whose identity column GENERATED ALWAYS differs is
replaced: no UPDATE can write one), and generated columns never (the server computes them).

A fix is written so that it neither echoes nor loses a concurrent write: under a repair origin (the router
forwards only a node's own changes), with the winner's commit time as its own
(`pg_replication_origin_xact_setup`: later conflicts weigh the repaired row as the winner's), and only if
the row is still what the comparison read (locked first, hash checked): a row written meanwhile is left
alone and reported. Each fix is recorded in `pgmesh.conflict_history` in the same transaction.

Must not: decide what differs (router.ops.compare.job), or put a DSN in a message.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Sequence
from typing import Any, Final, TextIO

import msgspec
import psycopg
from psycopg import sql

from router.cluster.compare.copies import Copies, insert_columns, overriding, winner_copies, write_copies
from router.cluster.compare.fix import KeyDiff, NodePlan, TableRepair, decide_table, repair_origin, write_node
from router.cluster.compare.worker import SESSION_SQL, kept, row_hash
from router.cluster.members import members_of
from router.cluster.partial import is_partial, reaches, table_part
from router.config.model import Config
from router.conflicts.resolve import Version
from router.errors import PgmeshError, describe
from router.ops.compare.job import CompareReport, Divergence, compare_cluster
from router.ops.compare.progress import RepairProgress
from router.service.admin import ask_router

__all__ = ["Fix", "RepairReport", "TablePlan", "cmd_repair", "repair_cluster", "repair_origin"]

_PG_EPOCH_S: Final = 946_684_800  # 2000-01-01 UTC in Unix seconds
_LISTED: Final = 1000  # fixes listed one a line in the text report (--json lists every one)


_RECORD_SQL: Final = (
    "INSERT INTO pgmesh.conflict_history (source, table_name, key, conflict_type, resolution, resolver,"
    " reason, local_origin, local_commit_time, remote_origin, remote_commit_time, local_row, remote_row)"
    " VALUES ('repair', %s, %s, 'divergence', %s, 'repair', %s, %s,"
    " to_timestamp(%s::float8 / 1000000 + %s), %s,"
    " coalesce(to_timestamp(%s::float8 / 1000000 + %s), clock_timestamp()), %s::jsonb, %s::jsonb)"
)


class Fix(msgspec.Struct, frozen=True):
    table: str
    key: str
    winner: str  # the node whose row (or absence) was written
    written: list[str]  # nodes fixed
    skipped: list[str]  # nodes whose row changed since the comparison: left alone


class TablePlan(msgspec.Struct, frozen=True):
    """What a repair does to one table: its differing keys, who wins how many (`node`: its row;
    `node (deleted)`: its tombstone), and the rows written per node."""

    table: str
    keys: int
    winners: dict[str, int]
    nodes: dict[str, NodePlan]
    changed: int = 0  # keys whose rows changed since compared: left alone
    note: str = ""

    def render(self) -> str:
        won = ", ".join(f"{w} {n:,}" for w, n in self.winners.items()) or "-"
        lines = [f"  {self.table}: {self.keys:,} key(s); wins: {won}"
                 + (f"; {self.changed:,} changed since compared (left alone)" if self.changed else "")
                 + (f"; {self.note}" if self.note else "")]
        lines += [f"    {node}: insert {p.insert:,}, update {p.update:,}, delete {p.delete:,}"
                  for node, p in self.nodes.items() if p.insert or p.update or p.delete]
        return "\n".join(lines)


class RepairReport(msgspec.Struct, frozen=True):
    compared: CompareReport
    fixes: list[Fix]
    refused: list[str] = msgspec.field(default_factory=list)  # differences not repaired, with why
    plans: list[TablePlan] = msgspec.field(default_factory=list)
    dry_run: bool = False  # nothing written: `plans` says what would be
    hints: list[str] = msgspec.field(default_factory=list)  # where `--from NODE` would decide otherwise

    @property
    def exit_code(self) -> int:
        """0: every difference repaired and every table compared; 1: something left (listed), or a dry
        run that found differences."""
        left = self.compared.unsettled or self.compared.skipped or self.compared.unreplicated
        if self.dry_run and self.compared.differences:
            return 1
        return 1 if any(f.skipped for f in self.fixes) or left or self.refused else 0

    def render(self) -> str:
        lines = [self.compared.render()]
        if self.dry_run or self.plans:
            lines.append("plan (dry run: nothing written):" if self.dry_run else "plan:")
            lines += [p.render() for p in self.plans]
        if not self.dry_run:
            lines.append(f"repaired {sum(len(f.written) for f in self.fixes)} row(s):")
            for f in self.fixes[:_LISTED]:
                note = f"; changed meanwhile, left alone on {', '.join(f.skipped)}" if f.skipped else ""
                on = ", ".join(f.written) or "-"
                lines.append(f"  {f.table} {f.key}: {f.winner}'s version written on {on}{note}")
            if len(self.fixes) > _LISTED:
                lines.append(f"  ... and {len(self.fixes) - _LISTED:,} more (--json lists every one)")
        lines += [f"hint: {h}" for h in self.hints]
        lines += [f"not repaired: {r}" for r in self.refused]
        return "\n".join(lines)


class _Row(msgspec.Struct, frozen=True):
    row: str  # to_jsonb of the row
    version: Version


def _hex(h: int) -> str:
    return f"{h & 0xFFFFFFFFFFFFFFFF:016x}"


def _row_sql(
    table: str, keys: Sequence[str], columns: Sequence[str] | None = None, rows: str | None = None
) -> sql.Composed:
    """The row by its key: as JSON, its commit time and origin, its hash (of `columns` only, if given) and
    whether filter `rows` keeps it (evaluated over the row alone: no other name in scope)."""
    schema, name = table.split(".", 1)
    match = sql.SQL(" AND ").join(sql.SQL("t.{k} = r.{k}").format(k=sql.Identifier(k)) for k in keys)
    keeps = sql.SQL("true") if rows is None else sql.SQL("(SELECT {} FROM (SELECT t.*) AS pgmesh_r)").format(
        kept(rows))
    return sql.SQL(
        "SELECT pg_catalog.to_jsonb(t.*)::text,"
        " ((extract(epoch FROM c.timestamp) - {epoch}) * 1000000)::bigint,"
        " o.roname, {hash}, {keeps}"
        " FROM pg_catalog.jsonb_populate_record(NULL::{rel}, %s::jsonb) AS r JOIN {rel} AS t ON {match}"
        " LEFT JOIN LATERAL pg_catalog.pg_xact_commit_timestamp_origin(t.xmin) AS c ON true"
        " LEFT JOIN pg_catalog.pg_replication_origin AS o ON o.roident = c.roident"
    ).format(epoch=sql.Literal(_PG_EPOCH_S), rel=sql.Identifier(schema, name), match=match,
             hash=row_hash(columns), keeps=keeps)


async def _read_row(
    conn: psycopg.AsyncConnection[Any], config: Config, node: str, d: Divergence, keys: Sequence[str],
    columns: Sequence[str] | None = None, rows: str | None = None,
) -> tuple[_Row | None, str | None, bool]:
    """`node`'s row of `d`'s key (None: none), its hash (`_row_sql`) and whether filter `rows` keeps it."""
    cur = await conn.execute(_row_sql(d.table, keys, columns, rows), [d.key_json])
    got = await cur.fetchone()
    if got is None:
        return None, None, False
    version = Version(None if got[1] is None else int(got[1]), _origin_node(config, node, got[2]))
    return _Row(str(got[0]), version), _hex(int(got[3])), bool(got[4])


def _origin_node(config: Config, node: str, roname: str | None) -> str:
    if roname is None:
        return node
    for prefix in (config.origin_name(""), repair_origin(config, "")):
        if roname.startswith(prefix):
            return roname[len(prefix) :]
    return roname


async def _fix_one(
    conn: psycopg.AsyncConnection[Any],
    config: Config,
    node: str,
    d: Divergence,
    keys: Sequence[str],
    winner: str,
    row: _Row | None,
    mine: _Row | None,
    expected: str | None,
    commit_us: int | None,
    columns: Sequence[str] | None,
) -> bool:
    """Write the winner's row (or its absence) on `node`, as of the winner's commit time `commit_us`, and
    only `columns` of it if given (hashed by those too); False when its row is no longer `expected` (the
    hash compare read)."""
    schema, name = d.table.split(".", 1)
    rel = sql.Identifier(schema, name)
    match = sql.SQL(" AND ").join(sql.SQL("t.{k} = r.{k}").format(k=sql.Identifier(k)) for k in keys)
    async with conn.transaction():
        await conn.execute("SELECT pg_catalog.set_config('session_replication_role', 'replica', true)")
        if commit_us is not None:
            await conn.execute(
                "SELECT pg_catalog.pg_replication_origin_xact_setup('0/0',"
                " to_timestamp(%s::float8 / 1000000 + %s))",
                [commit_us, _PG_EPOCH_S],
            )
        cur = await conn.execute(
            sql.SQL(
                "SELECT {hash} FROM"
                " pg_catalog.jsonb_populate_record(NULL::{rel}, %s::jsonb) AS r JOIN {rel} AS t ON {match}"
                " FOR UPDATE OF t"
            ).format(hash=row_hash(columns), rel=rel, match=match),
            [d.key_json],
        )
        found = await cur.fetchone()
        now = None if found is None else _hex(int(found[0]))
        if now != expected:
            return False
        delete = sql.SQL(
            "DELETE FROM {rel} AS t USING pg_catalog.jsonb_populate_record(NULL::{rel}, %s::jsonb) AS r"
            " WHERE {match}"
        ).format(rel=rel, match=match)
        if row is None:
            await conn.execute(delete, [d.key_json])
        else:
            identity = await insert_columns(conn, d.table, columns)  # generated columns: the server's
            written = list(identity)
            others = [c for c in written if c not in keys]
            cols = sql.SQL(", ").join(map(sql.Identifier, written))
            update = (
                sql.SQL("DO UPDATE SET {}").format(
                    sql.SQL(", ").join(
                        sql.SQL("{c} = EXCLUDED.{c}").format(c=sql.Identifier(c)) for c in others
                    )
                )
                if others
                else sql.SQL("DO NOTHING")
            )
            if any(identity[c] == "a" for c in others):
                # no UPDATE writes an identity column GENERATED ALWAYS (SQLSTATE 428C9): the row is
                # replaced, without a tombstone (the key never leaves)
                await conn.execute("SELECT pg_catalog.set_config('pgmesh.recording', 'y', true)")
                await conn.execute(delete, [d.key_json])
                await conn.execute("SELECT pg_catalog.set_config('pgmesh.recording', '', true)")
                update = sql.SQL("DO NOTHING")
            await conn.execute(
                sql.SQL(
                    "INSERT INTO {rel} ({cols}){override} SELECT {cols}"
                    " FROM pg_catalog.jsonb_populate_record(NULL::{rel}, %s::jsonb)"
                    " ON CONFLICT ({keys}) {update}"
                ).format(
                    rel=rel, cols=cols, override=overriding(identity),
                    keys=sql.SQL(", ").join(map(sql.Identifier, keys)), update=update,
                ),
                [row.row],
            )
        await conn.execute(
            _RECORD_SQL,
            [
                d.table,
                d.key,
                "deleted" if row is None else "written",
                f"pgmesh repair: {winner}'s version",
                None if mine is None else mine.version.node,
                None if mine is None else mine.version.commit_time,
                _PG_EPOCH_S,
                winner,
                commit_us,
                _PG_EPOCH_S,
                None if mine is None else mine.row,
                None if row is None else row.row,
            ],
        )
    return True


async def _write(
    conn: psycopg.AsyncConnection[Any], config: Config, node: str, d: Divergence, keys: Sequence[str],
    winner: str, row: _Row | None, mine: _Row | None, *, expected: str | None, commit_us: int | None,
    columns: Sequence[str] | None = None,
) -> bool:
    """`_fix_one` in a session under the winner's repair origin (forwarded nowhere)."""
    await _under_origin(conn, config, winner)
    try:
        return await _fix_one(conn, config, node, d, keys, winner, row, mine, expected, commit_us, columns)
    except psycopg.Error as exc:
        raise PgmeshError(
            f"repair of {d.table} {d.key} failed: {describe(exc)}; nothing of it was written"
            " there (one transaction); fix the cause and run `pgmesh repair` again",
            node=node, sqlstate=exc.sqlstate,
        ) from None


async def _under_origin(conn: psycopg.AsyncConnection[Any], config: Config, winner: str) -> None:
    """Set the session up under the winner's repair origin (created if missing)."""
    await conn.execute(
        "SELECT pg_catalog.pg_replication_origin_session_reset()"
        " WHERE pg_catalog.pg_replication_origin_session_is_setup()"
    )
    origin = repair_origin(config, winner)
    await conn.execute(
        "SELECT pg_catalog.pg_replication_origin_create(%s) WHERE NOT EXISTS"
        " (SELECT 1 FROM pg_catalog.pg_replication_origin WHERE roname = %s)",
        [origin, origin],
    )
    await conn.execute("SELECT pg_catalog.pg_replication_origin_session_setup(%s)", [origin])


async def _repair_keyless(
    conns: dict[str, psycopg.AsyncConnection[Any]], config: Config, found: Sequence[Divergence],
    source: str | None, reference: str, *, dry_run: bool = False,
) -> tuple[list[Fix], list[str], list[TablePlan]]:
    """Rows of tables without a key whose copies differ (router.cluster.compare.copies): each node made
    to hold the winner's copies: `source`'s among full nodes (none given: refused, with why), the
    reference's (through its filter and columns) on a partial node. The fixes, what was refused, and
    the plans (`dry_run`: only those, from the copies compare counted)."""
    groups: dict[tuple[str, tuple[str, ...]], list[Divergence]] = {}
    for d in found:
        groups.setdefault((d.table, tuple(d.rows)), []).append(d)
    fixes: list[Fix] = []
    refused: list[str] = []
    plans: list[TablePlan] = []
    for (table, nodes), items in groups.items():
        partial = [n for n in nodes if is_partial(config.node(n))]
        part = table_part(config.node(partial[0]), table) if partial else None
        columns, rows = (part.columns, part.rows) if part is not None else (None, None)
        if partial:
            winner, targets = reference, partial
        elif source is None:
            refused.append(
                f"{table}: {len(items)} row(s) with copies that differ, in a table without a key: no"
                f" version tells which node's copies are right; `pgmesh repair --from NODE {table}` makes"
                " every node hold that node's copies")
            continue
        else:
            winner, targets = source, [n for n in nodes if n != source]
        plans.append(_copies_plan(table, items, winner, targets))
        if dry_run:
            continue
        have = await winner_copies(conns[winner], table, [d.key for d in items], columns, rows)
        written: dict[str, list[str]] = {d.key: [] for d in items}
        skipped: dict[str, list[str]] = {d.key: [] for d in items}
        for node in targets:
            wanted = [Copies(d.key, (d.counts or {}).get(node, 0), *have.get(d.key, (0, None)))
                      for d in items]
            wanted = [c for c in wanted if c.expected != c.wanted]
            if not wanted:
                continue
            await _under_origin(conns[node], config, winner)
            try:
                done, left = await write_copies(conns[node], table, winner, node, wanted, columns)
            except psycopg.Error as exc:
                raise PgmeshError(
                    f"repair of {table}'s copies failed: {describe(exc)}; nothing of it was written there"
                    " (one transaction); fix the cause and run `pgmesh repair` again",
                    node=node, relation=table, sqlstate=exc.sqlstate) from None
            for text in done:
                written[text].append(node)
            for text in left:
                skipped[text].append(node)
        fixes += [Fix(table, d.key, winner, written[d.key], skipped[d.key]) for d in items
                  if written[d.key] or skipped[d.key]]
    return fixes, refused, plans


def _copies_plan(table: str, items: Sequence[Divergence], winner: str, targets: Sequence[str]) -> TablePlan:
    """A keyless table's plan from the copies compare counted: copies inserted and deleted per node."""
    nodes = {n: NodePlan() for n in targets}
    for d in items:
        counts = d.counts or {}
        for n in targets:
            gap = counts.get(winner, 0) - counts.get(n, 0)
            nodes[n].insert += max(gap, 0)
            nodes[n].delete += max(-gap, 0)
    return TablePlan(table, len(items), {f"{winner}'s copies": len(items)}, nodes,
                     note="a table without a key: copies")


async def _repair_part(
    conns: dict[str, psycopg.AsyncConnection[Any]], config: Config, d: Divergence, keys: Sequence[str],
    node: str, reference: str, *, read_now: bool = False,
) -> Fix | None:
    """A key of partial node `node`: the reference's row written there if the node's filter keeps it
    (its columns only), else deleted there, as of the reference row's commit time; None where the node
    already holds that. `read_now`: the key was not compared on `node` (the reference's row was
    repaired): its row now is what is expected still there when written."""
    part = table_part(config.node(node), d.table)
    columns = part.columns if part is not None else None
    ref, ref_hash, keeps = await _read_row(
        conns[reference], config, reference, d, keys, columns, part.rows if part is not None else None)
    mine, mine_hash, _ = await _read_row(conns[node], config, node, d, keys, columns)
    expected = mine_hash if read_now else d.rows[node]
    if not keeps:
        ref_hash = None
    if expected == ref_hash:
        return None
    row = None
    if ref is not None and keeps:
        held = {k: v for k, v in json.loads(ref.row).items() if columns is None or k in columns}
        row = _Row(json.dumps(held), ref.version)
    ok = await _write(conns[node], config, node, d, keys, reference, row, mine, expected=expected,
                      commit_us=ref.version.commit_time if ref is not None else None, columns=columns)
    return Fix(d.table, d.key, reference, [node] if ok else [], [] if ok else [node])


async def _connect(config: Config) -> dict[str, psycopg.AsyncConnection[Any]]:
    conns: dict[str, psycopg.AsyncConnection[Any]] = {}
    try:
        for node in config.nodes:
            try:
                conn = await psycopg.AsyncConnection.connect(
                    node.dsn, autocommit=True, connect_timeout=10, application_name="pgmesh repair"
                )
            except psycopg.Error as exc:
                raise PgmeshError(f"cannot connect: {describe(exc)}", node=node.name) from None
            conns[node.name] = conn
            await conn.execute(SESSION_SQL)
    except BaseException:
        for conn in conns.values():
            await conn.close()
        raise
    return conns


def _plan(repair: TableRepair) -> TablePlan:
    return TablePlan(repair.table, repair.keys, repair.winners(), repair.plan, len(repair.changed))


def _hints(repair: TableRepair) -> list[str]:
    """Where the default rule copied rows to a node that held no record of deleting them."""
    return [
        f"{repair.table}: {n:,} key(s) missing on {node} only, with no record of a deletion there, are"
        f" copied to {node} (a row beats its absence); if {node} deleted them on purpose (a deletion pgmesh"
        f" never saw), consider `pgmesh repair --from {node} {repair.table}`"
        for node, n in sorted(repair.lacking().items())
    ]


async def _repair_keyed(
    conns: dict[str, psycopg.AsyncConnection[Any]], config: Config, table: str, items: Sequence[Divergence],
    source: str | None, tally: RepairProgress, dry_run: bool,
) -> TableRepair:
    """One table's differences between full nodes, set-based (router.cluster.compare.fix)."""
    nodes = list(items[0].rows)
    mine = {n: conns[n] for n in nodes}
    diffs = [KeyDiff(d.key, d.key_json, dict(d.rows)) for d in items]
    repair = await decide_table(mine, config, table, diffs, source=source, progress=tally)
    tally.plan(sum(len(where) for where in repair.targets.values()))
    if source is None:
        for hint in _hints(repair):
            tally.hint(hint)
    if not dry_run:
        await asyncio.gather(*(write_node(mine[n], config, n, repair, tally) for n in nodes))
    return repair


async def repair_cluster(
    config: Config, names: Sequence[str] = (), *, source: str | None = None, limit: float = 300.0,
    dry_run: bool = False, progress: TextIO | None = None,
) -> RepairReport:
    """Compare, then write each persistent difference's winning row on every node that differs (parted
    nodes left out): the full nodes' first, then the partial nodes' (the module docstring). `dry_run`:
    decide and plan only. `progress`: where the progress line and the hints go (None: nowhere)."""
    config = await members_of(config)
    if source is not None and source not in {n.name for n in config.nodes}:
        raise PgmeshError(f"no node {source!r} in the config")
    if source is not None and is_partial(config.node(source)):
        raise PgmeshError(f"node {source} holds part of the data: it cannot be the source of a repair",
                          hint="name a full node, or leave --from out")
    tally = RepairProgress(progress, 0)
    tally.note("comparing the nodes (the router must be running)")
    compared = await compare_cluster(config, names, limit=limit, router_running=True)
    partial = [n for n in config.nodes if is_partial(n)]
    parts = {n.name for n in partial}
    reference = next((n.name for n in config.nodes if not is_partial(n)), "")
    keyed = [d for d in compared.differences if d.counts is None]
    full: dict[str, list[Divergence]] = {}
    for d in keyed:
        if not parts & d.rows.keys():
            full.setdefault(d.table, []).append(d)
    tally.start(sum(len(v) for v in full.values()))
    tally.note(f"compare found {len(compared.differences):,} difference(s) in {compared.seconds:.1f} s"
               + (" (dry run: nothing is written)" if dry_run else ""))
    conns = await _connect(config)
    fixes: list[Fix] = []
    hints: list[str] = []
    try:
        fixes, refused, plans = await _repair_keyless(
            conns, config, [d for d in compared.differences if d.counts is not None], source, reference,
            dry_run=dry_run)
        if source is None:
            hints += refused
            for line in refused:
                tally.hint(line)
        rewritten: list[Divergence] = []  # the reference's row written by a repair: forwarded nowhere
        for table, items in full.items():
            repair = await _repair_keyed(conns, config, table, items, source, tally, dry_run)
            plans.append(_plan(repair))
            hints += _hints(repair) if source is None else []
            if repair.refused:
                refused.append(
                    f"{table}: {len(repair.refused):,} key(s) the table's conflict rule does not decide"
                    f" (error): `pgmesh repair --from NODE {table}` makes every node hold that node's row")
            if dry_run:
                continue
            by_key = {d.key: d for d in items}
            fixes += [Fix(table, k, v.winner, repair.written.get(k, []), repair.skipped.get(k, []))
                      for k, v in repair.verdicts.items()]
            fixes += [Fix(table, k, "-", [], list(by_key[k].rows)) for k in repair.changed]
            rewritten += [by_key[k] for k, on in repair.written.items() if reference in on]
        if not dry_run:
            fixes += await _repair_partial(conns, config, keyed, rewritten, partial, reference)
        elif any(parts & d.rows.keys() for d in keyed):
            plans.append(TablePlan("(partial nodes)", sum(1 for d in keyed if parts & d.rows.keys()), {}, {},
                                   note="written from the reference's row after the full nodes' repair"))
    except psycopg.Error as exc:
        raise PgmeshError(f"repair failed: {describe(exc)}") from None
    finally:
        for conn in conns.values():
            await conn.close()
    tally.finish()
    return RepairReport(compared, fixes, refused, plans, dry_run, hints)


async def _repair_partial(
    conns: dict[str, psycopg.AsyncConnection[Any]], config: Config, keyed: Sequence[Divergence],
    rewritten: Sequence[Divergence], partial: Sequence[Any], reference: str,
) -> list[Fix]:
    """Each partial node's differences, and the keys a repair rewrote on the reference in a table it
    gets, key by key (`_repair_part`)."""
    parts = {n.name for n in partial}
    keys_of: dict[str, list[str]] = {}

    def keys(d: Divergence) -> list[str]:
        return keys_of.setdefault(d.table, list(json.loads(d.key_json)))

    work = [(d, n, False) for d in keyed for n in d.rows if n in parts]
    found = {(d.table, d.key, n) for d, n, _ in work}
    work += [(d, n.name, True) for d in rewritten for n in partial
             if reaches(n, d.table) and (d.table, d.key, n.name) not in found]
    fixes = []
    for d, node_name, read_now in work:
        fixed = await _repair_part(conns, config, d, keys(d), node_name, reference, read_now=read_now)
        if fixed is not None:
            fixes.append(fixed)
    return fixes


async def cmd_repair(
    config: Config,
    names: Sequence[str],
    *,
    source: str | None = None,
    as_json: bool = False,
    limit: float = 300.0,
    dry_run: bool = False,
) -> int:
    """`pgmesh repair`: needs the router running (a difference is decided only once every link caught up).
    Progress and hints on stderr, the report on stdout."""
    if await ask_router(config, "GET", "/status") is None:
        raise PgmeshError(
            "pgmesh repair needs the router running (`pgmesh run`): a difference is repaired only"
            " once every link has applied past the comparison"
        )
    report = await repair_cluster(config, names, source=source, limit=limit, dry_run=dry_run,
                                  progress=sys.stderr)
    print(msgspec.json.encode(report).decode() if as_json else report.render())
    return report.exit_code
