"""`pgmesh repair`: every persistent difference `pgmesh compare` finds, resolved and written.

Owns: reading each differing row on every node with its version (commit time and origin node:
`pg_xact_commit_timestamp_origin(xmin)`), choosing the winner with the cluster's own conflict rules
(router.conflicts.resolve: the table's resolver for `update_origin_differs`, folded over the nodes that
hold the row; a node without the row has no version and loses to any that has one) or `--from NODE`
(that node's row, or its absence), and writing it on every node that differs.

A partial node (router.cluster.partial) is never a source: the full nodes' differences are repaired
first, then each partial node's (those compare found, and the keys a repair rewrote on the reference full
node in a table it gets: a repair is forwarded nowhere) from the reference's row as it is then: the row
if the node's filter keeps it (its columns only, in the write and in the record: the node never holds the
others), else its absence.

A table without a key has no versions to weigh: its differing rows (each with its copies per node) are
repaired only with `--from NODE` (every other node then holds that node's copies of each, never more),
or on a partial node from its reference; without `--from` they are listed as not repaired, with the
command that would (router.cluster.compare.copies). Identity columns are written with OVERRIDING SYSTEM
VALUE (a row whose identity column GENERATED ALWAYS differs is replaced: no UPDATE can write one), and
generated columns never (the server computes them).

A fix is written so that it neither echoes nor loses a concurrent write: in a session with a replication
origin of its own (`pgmeshrepair_<cluster>_<winner>`: the router forwards only a node's own changes, so
the fix goes nowhere else; `origin_node` names the winner for it), with the winner's commit time as its
own (`pg_replication_origin_xact_setup`: later conflicts weigh the repaired row as the winner's), and
only if the row is still what the comparison read (locked first, hash checked): a row written meanwhile
is left alone and reported. Each fix is recorded in `pgmesh.conflict_history` in the same transaction.

Must not: decide what differs (router.ops.compare.job), or put a DSN in a message.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, Final

import msgspec
import psycopg
from psycopg import sql

from router.cluster.compare.copies import Copies, insert_columns, overriding, winner_copies, write_copies
from router.cluster.compare.worker import SESSION_SQL, kept, row_hash
from router.cluster.members import members_of
from router.cluster.partial import is_partial, reaches, table_part
from router.config.model import Config
from router.conflicts.resolve import ConflictType, Outcome, Version, resolve
from router.errors import PgmeshError, describe
from router.ops.compare.job import CompareReport, Divergence, compare_cluster
from router.service.admin import ask_router

__all__ = ["RepairReport", "cmd_repair", "repair_cluster", "repair_origin"]

_PG_EPOCH_S: Final = 946_684_800  # 2000-01-01 UTC in Unix seconds


_RECORD_SQL: Final = (
    "INSERT INTO pgmesh.conflict_history (source, table_name, key, conflict_type, resolution, resolver,"
    " reason, local_origin, local_commit_time, remote_origin, remote_commit_time, local_row, remote_row)"
    " VALUES ('repair', %s, %s, 'divergence', %s, 'repair', %s, %s,"
    " to_timestamp(%s::float8 / 1000000 + %s), %s,"
    " coalesce(to_timestamp(%s::float8 / 1000000 + %s), clock_timestamp()), %s::jsonb, %s::jsonb)"
)


def repair_origin(config: Config, winner: str) -> str:
    """The replication origin a fix is written under (not under `origin_name`'s prefix: no progress)."""
    return f"pgmeshrepair_{config.cluster.name}_{winner}"


class Fix(msgspec.Struct, frozen=True):
    table: str
    key: str
    winner: str  # the node whose row (or absence) was written
    written: list[str]  # nodes fixed
    skipped: list[str]  # nodes whose row changed since the comparison: left alone


class RepairReport(msgspec.Struct, frozen=True):
    compared: CompareReport
    fixes: list[Fix]
    refused: list[str] = msgspec.field(default_factory=list)  # differences not repaired, with why

    @property
    def exit_code(self) -> int:
        """0: every difference repaired and every table compared; 1: something left (listed)."""
        left = self.compared.unsettled or self.compared.skipped or self.compared.unreplicated
        return 1 if any(f.skipped for f in self.fixes) or left or self.refused else 0

    def render(self) -> str:
        lines = [self.compared.render(), f"repaired {sum(len(f.written) for f in self.fixes)} row(s):"]
        for f in self.fixes:
            note = f"; changed meanwhile, left alone on {', '.join(f.skipped)}" if f.skipped else ""
            lines.append(
                f"  {f.table} {f.key}: {f.winner}'s version written on {', '.join(f.written) or '-'}{note}"
            )
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


def _winner(config: Config, table: str, rows: dict[str, _Row | None], source: str | None) -> str:
    if source is not None:
        return source
    schema, name = table.split(".", 1)
    policy = config.policy(schema, name, ConflictType.UPDATE_ORIGIN_DIFFERS.value)
    present = [n for n in sorted(rows) if rows[n] is not None]
    best = present[0]
    for node in present[1:]:
        here, there = rows[best], rows[node]
        assert here is not None and there is not None
        decision = resolve(
            ConflictType.UPDATE_ORIGIN_DIFFERS,
            here.version,
            there.version,
            policy,
            local_row=json.loads(here.row),
            remote_row=json.loads(there.row),
        )
        if decision.outcome is Outcome.APPLY_REMOTE:
            best = node
    return best


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
    source: str | None, reference: str,
) -> tuple[list[Fix], list[str]]:
    """Rows of tables without a key whose copies differ (router.cluster.compare.copies): each node made
    to hold the winner's copies: `source`'s among full nodes (none given: refused, with why), the
    reference's (through its filter and columns) on a partial node. The fixes, and what was refused."""
    groups: dict[tuple[str, tuple[str, ...]], list[Divergence]] = {}
    for d in found:
        groups.setdefault((d.table, tuple(d.rows)), []).append(d)
    fixes: list[Fix] = []
    refused: list[str] = []
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
    return fixes, refused


async def _repair_full(
    conns: dict[str, psycopg.AsyncConnection[Any]], config: Config, d: Divergence, keys: Sequence[str],
    source: str | None,
) -> Fix:
    """A difference between full nodes: the winner's row written on each of them that differs."""
    rows = {name: (await _read_row(conns[name], config, name, d, keys))[0] for name in d.rows}
    winner = _winner(config, d.table, rows, source)
    row = rows[winner]
    written: list[str] = []
    skipped: list[str] = []
    for name in d.rows:
        if d.rows[name] == d.rows[winner]:
            continue
        ok = await _write(conns[name], config, name, d, keys, winner, row, rows[name], expected=d.rows[name],
                          commit_us=row.version.commit_time if row is not None else None)
        (written if ok else skipped).append(name)
    return Fix(d.table, d.key, winner, written, skipped)


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


async def repair_cluster(
    config: Config, names: Sequence[str] = (), *, source: str | None = None, limit: float = 300.0
) -> RepairReport:
    """Compare, then write each persistent difference's winning row on every node that differs (parted
    nodes left out): the full nodes' first, then the partial nodes' (the module docstring)."""
    config = await members_of(config)
    if source is not None and source not in {n.name for n in config.nodes}:
        raise PgmeshError(f"no node {source!r} in the config")
    if source is not None and is_partial(config.node(source)):
        raise PgmeshError(f"node {source} holds part of the data: it cannot be the source of a repair",
                          hint="name a full node, or leave --from out")
    compared = await compare_cluster(config, names, limit=limit, router_running=True)
    partial = [n for n in config.nodes if is_partial(n)]
    reference = next((n.name for n in config.nodes if not is_partial(n)), "")
    conns: dict[str, psycopg.AsyncConnection[Any]] = {}
    fixes: list[Fix] = []
    refused: list[str] = []
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
        keys_of: dict[str, list[str]] = {}

        def keys(d: Divergence) -> list[str]:
            return keys_of.setdefault(d.table, list(json.loads(d.key_json)))

        parts = {n.name for n in partial}
        rewritten: list[Divergence] = []  # the reference's row written by a repair: forwarded nowhere
        keyed = [d for d in compared.differences if d.counts is None]
        fixes, refused = await _repair_keyless(
            conns, config, [d for d in compared.differences if d.counts is not None], source, reference)
        for d in keyed:
            if not parts & d.rows.keys():
                fixes.append(fix := await _repair_full(conns, config, d, keys(d), source))
                if reference in fix.written:
                    rewritten.append(d)
        work = [(d, n, False) for d in keyed for n in d.rows if n in parts]
        found = {(d.table, d.key, n) for d, n, _ in work}
        work += [(d, n.name, True) for d in rewritten for n in partial
                 if reaches(n, d.table) and (d.table, d.key, n.name) not in found]
        for d, node_name, read_now in work:
            fixed = await _repair_part(conns, config, d, keys(d), node_name, reference, read_now=read_now)
            if fixed is not None:
                fixes.append(fixed)
    except psycopg.Error as exc:
        raise PgmeshError(f"repair failed: {describe(exc)}") from None
    finally:
        for conn in conns.values():
            await conn.close()
    return RepairReport(compared, fixes, refused)


async def cmd_repair(
    config: Config,
    names: Sequence[str],
    *,
    source: str | None = None,
    as_json: bool = False,
    limit: float = 300.0,
) -> int:
    """`pgmesh repair`: needs the router running (a difference is decided only once every link caught up)."""
    if await ask_router(config, "GET", "/status") is None:
        raise PgmeshError(
            "pgmesh repair needs the router running (`pgmesh run`): a difference is repaired only"
            " once every link has applied past the comparison"
        )
    report = await repair_cluster(config, names, source=source, limit=limit)
    print(msgspec.json.encode(report).decode() if as_json else report.render())
    return report.exit_code
