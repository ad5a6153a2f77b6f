"""Repairing a table's differing keys set-based: read on every node in bulk, decided, written per range.

Owns, for one table whose key (primary key or replica identity index) names its rows, on its full nodes:

1. The read (`read_states`): the differing keys, in batches of `READ_BATCH`, on every node at once: each
   row with its version (`pg_xact_commit_timestamp_origin(xmin)`: commit time and origin node) and its hash
   (compare's: router.cluster.compare.worker.row_hash), and for each key without a row the key's
   tombstone (`pgmesh.tombstones`, the deleting transaction's version, as router.apply.careful.local reads
   it) or the table's TRUNCATE (`pgmesh.table_tombstones`), whichever is later. A key whose row on some
   node is no longer the one the comparison read is left alone (`TableRepair.changed`: still being
   written, or repaired meanwhile).
2. The decision, in Python (router.cluster.compare.verdict: the conflict path's versions and rules).
3. The write, per node (`write_node`): the fixes copied (COPY) into a temporary staging table, then one
   transaction per winning version (the winner, the version's node and commit time, as the apply path
   writes one transaction per source transaction), each in batches of at most `WRITE_BATCH` keys and a
   handful of statements over the staging table: the rows locked and checked against what the comparison
   read (a row written meanwhile is left alone and reported), each fix recorded in
   `pgmesh.conflict_history`, one DELETE, one INSERT ... ON CONFLICT DO UPDATE. The transactions are
   sent in a pipeline (no round trip each) with `synchronous_commit = off` (a crash loses at most the
   last fixes, which a comparison finds again). Each runs under the repair origin of the version's node
   (`pgmeshrepair_<cluster>_<node>`: the router forwards only a node's own changes, so a fix goes nowhere
   else) with the version's commit time as its own (`pg_replication_origin_xact_setup`), so later
   conflicts weigh the repaired row as the winner's version; in `session_replication_role = replica` (no
   user trigger fires; the tombstone trigger records a repaired deletion, with that version). Identity
   columns are written with OVERRIDING SYSTEM VALUE (rows whose identity column GENERATED ALWAYS is not
   part of the key are replaced: no UPDATE can write one), generated columns never.

The caller (router.ops.compare.repair, the router's continuous verification) hands it the keys a
comparison found, with each node's row hash then (`KeyDiff`), and the open sessions (settings of
router.cluster.compare.worker.SESSION_SQL, autocommit). Partial nodes and tables without a key are not
its concern.

Must not: decide which keys differ, print anything (progress goes to the caller's `Progress`), or put a DSN
in a message.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Final, Protocol

import msgspec
import psycopg
from psycopg import sql

from router.apply.statements import tombstone_key
from router.cluster.compare.copies import insert_columns, overriding
from router.cluster.compare.verdict import Policies, State, Verdict, decide
from router.cluster.compare.worker import row_hash
from router.config.model import Config
from router.conflicts.resolve import ConflictType, Version
from router.errors import PgmeshError, describe

__all__ = [
    "READ_BATCH", "WRITE_BATCH", "KeyDiff", "NodePlan", "Progress", "TableRepair", "decide_table",
    "read_states", "repair_origin", "repair_table", "to_hex", "write_node",
]

READ_BATCH: Final = 10_000  # keys read per query on each node
WRITE_BATCH: Final = 5_000  # keys written per statement (a version with more is cut)
_SYNC_KEYS: Final = 2_000  # the pipeline is synced (progress reported) after about this many keys
PG_EPOCH_S: Final = 946_684_800  # 2000-01-01 UTC in Unix seconds
_STAGE: Final = sql.Identifier("pg_temp", "pgmesh_fix")
# the tombstone trigger's settings (router/conflicts/sql/tombstone.sql): a key's text as it wrote it
_TOMBSTONE_SETTINGS: Final = (
    "SELECT pg_catalog.set_config('timezone', 'UTC', true),"
    " pg_catalog.set_config('datestyle', 'ISO, YMD', true),"
    " pg_catalog.set_config('intervalstyle', 'postgres', true),"
    " pg_catalog.set_config('extra_float_digits', '3', true),"
    " pg_catalog.set_config('bytea_output', 'hex', true)"
)
_VERSION: Final = (
    "((extract(epoch FROM c.timestamp) - {epoch}) * 1000000)::int8, o.roname"
)


def repair_origin(config: Config, node: str) -> str:
    """The replication origin a fix is written under (not under `origin_name`'s prefix: no progress)."""
    return f"pgmeshrepair_{config.cluster.name}_{node}"


def to_hex(h: int | None) -> str | None:
    """A row hash as compare prints it."""
    return None if h is None else f"{h & 0xFFFFFFFFFFFFFFFF:016x}"


class KeyDiff(msgspec.Struct, frozen=True):
    """A key a comparison found differing: its text (`ROW(key)::text`), its columns as a JSON object, and
    each full node's row hash then (hex, as compare prints it; None: no row there)."""

    key: str
    key_json: str
    hashes: dict[str, str | None]


class Progress(Protocol):
    """Where the repair says how far it got (the caller prints it)."""

    def decided(self, keys: int) -> None: ...

    def written(self, rows: int) -> None: ...


class NodePlan(msgspec.Struct):
    """What a repair writes on one node: rows inserted, rows overwritten, rows deleted."""

    insert: int = 0
    update: int = 0
    delete: int = 0


class TableRepair(msgspec.Struct):
    """One table's repair: each decided key's verdict and the nodes it is written on (`plan`), then
    what was written and what was left alone (`write_node`)."""

    table: str
    keys: int
    verdicts: dict[str, Verdict] = msgspec.field(default_factory=dict)
    targets: dict[str, list[str]] = msgspec.field(default_factory=dict)  # key -> nodes to write
    states: dict[str, dict[str, State]] = msgspec.field(default_factory=dict)  # key -> node -> state
    key_json: dict[str, str] = msgspec.field(default_factory=dict)  # key -> its columns as JSON
    changed: list[str] = msgspec.field(default_factory=list)  # rows changed since compared: left alone
    refused: list[str] = msgspec.field(default_factory=list)  # the table's rule decides nothing (error)
    plan: dict[str, NodePlan] = msgspec.field(default_factory=dict)
    written: dict[str, list[str]] = msgspec.field(default_factory=dict)  # key -> nodes written
    skipped: dict[str, list[str]] = msgspec.field(default_factory=dict)  # key -> nodes changed meanwhile

    def winners(self) -> dict[str, int]:
        """Keys per winning state: `node` (its row) or `node (deleted)` (its tombstone)."""
        out: dict[str, int] = {}
        for v in self.verdicts.values():
            label = v.winner if v.row is not None else f"{v.winner} (deleted)"
            out[label] = out.get(label, 0) + 1
        return dict(sorted(out.items()))

    def lacking(self) -> dict[str, int]:
        """Keys copied to a node that alone lacked them, with no tombstone there (per node): the keys
        where `--from` that node might be what the user wants."""
        out: dict[str, int] = {}
        for v in self.verdicts.values():
            if len(v.lacking) == 1:
                out[v.lacking[0]] = out.get(v.lacking[0], 0) + 1
        return out


def _rel(table: str) -> sql.Identifier:
    return sql.Identifier(*table.split(".", 1))


def _match(keys: Sequence[str], a: str, b: str) -> sql.Composable:
    return sql.SQL(" AND ").join(
        sql.SQL("{a}.{k} = {b}.{k}").format(a=sql.Identifier(a), b=sql.Identifier(b), k=sql.Identifier(k))
        for k in keys)


def _origin_node(config: Config, node: str, roname: str | None) -> str:
    """The node a row's origin names (none: `node` itself; a repair's: the version it was written as)."""
    if roname is None:
        return node
    for prefix in (config.origin_name(""), repair_origin(config, "")):
        if roname.startswith(prefix):
            return roname[len(prefix):]
    return roname


def _version(config: Config, node: str, us: int | None, roname: str | None) -> Version:
    return Version(None if us is None else int(us), _origin_node(config, node, roname))


class _Versions:
    """A node's versions as read, each made once (a transaction's rows share one)."""

    __slots__ = ("config", "node", "seen")

    def __init__(self, config: Config, node: str) -> None:
        self.config = config
        self.node = node
        self.seen: dict[tuple[int | None, str | None], Version] = {}

    def __call__(self, us: int | None, roname: str | None) -> Version:
        got = self.seen.get((us, roname))
        if got is None:
            got = self.seen[(us, roname)] = _version(self.config, self.node, us, roname)
        return got


def _later(a: Version | None, b: Version | None) -> Version | None:
    if a is None or b is None:
        return a or b
    return a if a.order() >= b.order() else b


async def read_states(
    conn: psycopg.AsyncConnection[Any], config: Config, node: str, table: str, keys: Sequence[str],
    batch: Sequence[KeyDiff],
) -> dict[int, State]:
    """`node`'s state of each key of `batch` (by its index there; see the module docstring)."""
    rel = _rel(table)
    elements = sql.SQL(
        "pg_catalog.jsonb_array_elements(%s::jsonb) WITH ORDINALITY AS e(j, i)"
        " CROSS JOIN LATERAL pg_catalog.jsonb_populate_record(NULL::{rel}, e.j) AS r"
    ).format(rel=rel)
    version = sql.SQL(_VERSION).format(epoch=sql.Literal(PG_EPOCH_S))
    origin = sql.SQL(
        " LEFT JOIN pg_catalog.pg_replication_origin AS o ON o.roident = c.roident")
    rows = sql.SQL(
        "SELECT e.i, pg_catalog.to_jsonb(t.*)::text, {version}, {hash} FROM {elements}"
        " JOIN {rel} AS t ON {match}"
        " LEFT JOIN LATERAL pg_catalog.pg_xact_commit_timestamp_origin(t.xmin) AS c ON true{origin}"
    ).format(version=version, hash=row_hash(), elements=elements, rel=rel, match=_match(keys, "t", "r"),
             origin=origin)
    key_text = sql.SQL("ARRAY[{}]::text[]").format(sql.SQL(", ").join(
        sql.SQL("(r.{})::text").format(sql.Identifier(k)) for k in keys))
    tombs = sql.SQL(
        "SELECT e.i, {version} FROM {elements}"
        " JOIN pgmesh.tombstones AS ts ON ts.table_name = %s AND ts.key = {key}"
        " LEFT JOIN LATERAL pg_catalog.pg_xact_commit_timestamp_origin(pg_catalog.xid(ts.xid)) AS c"
        " ON true{origin}"
    ).format(version=version, elements=elements, key=sql.SQL(tombstone_key(key_text.as_string(conn))),
             origin=origin)
    truncated = sql.SQL(
        "SELECT {version} FROM pgmesh.table_tombstones AS ts"
        " LEFT JOIN LATERAL pg_catalog.pg_xact_commit_timestamp_origin(pg_catalog.xid(ts.xid)) AS c"
        " ON true{origin} WHERE ts.table_name = %s"
    ).format(version=version, origin=origin)
    payload = "[" + ",".join(d.key_json for d in batch) + "]"  # (each already JSON)
    version_of = _Versions(config, node)
    out: dict[int, State] = {}
    try:
        cur = await conn.execute(rows, [payload])
        for i, row, us, roname, h in await cur.fetchall():
            out[i - 1] = State(row, version_of(us, roname), h)
        if len(out) == len(batch):
            return out
        async with conn.transaction():
            await conn.execute(_TOMBSTONE_SETTINGS)
            cur = await conn.execute(truncated, [table])
            got = await cur.fetchone()
            whole = None if got is None else version_of(got[0], got[1])
            cur = await conn.execute(tombs, [payload, table])
            found = await cur.fetchall()
            deleted = {i - 1: version_of(us, roname) for i, us, roname in found}
    except psycopg.Error as exc:
        raise PgmeshError(f"reading the differing rows failed: {describe(exc)}", node=node, relation=table,
                          sqlstate=exc.sqlstate) from None
    for i in range(len(batch)):
        if i not in out:
            out[i] = State(None, _later(deleted.get(i), whole))
    return out


def _policies(config: Config, table: str) -> Policies:
    schema, name = table.split(".", 1)
    return Policies(config.policy(schema, name, ConflictType.UPDATE_ORIGIN_DIFFERS.value),
                    config.policy(schema, name, ConflictType.UPDATE_DELETED.value))


async def decide_table(
    conns: Mapping[str, psycopg.AsyncConnection[Any]], config: Config, table: str, diffs: Sequence[KeyDiff],
    *, source: str | None = None, progress: Progress | None = None,
) -> TableRepair:
    """Read every differing key of `table` on each node of `conns` (its full nodes) and decide it: the
    verdicts, the nodes each is written on, and what each node gets (`TableRepair.plan`)."""
    out = TableRepair(table, len(diffs), plan={n: NodePlan() for n in conns})
    if not diffs:
        return out
    keys = list(json.loads(diffs[0].key_json))
    policies = _policies(config, table)
    nodes = list(conns)
    for start in range(0, len(diffs), READ_BATCH):
        batch = diffs[start:start + READ_BATCH]
        read = await asyncio.gather(*(read_states(conns[n], config, n, table, keys, batch) for n in nodes))
        for i, d in enumerate(batch):
            states = {n: read[j][i] for j, n in enumerate(nodes)}
            if any(to_hex(states[n].hash) != d.hashes.get(n) for n in nodes):
                out.changed.append(d.key)
                continue
            verdict = decide(d.key, states, policies, source)
            if verdict is None:
                if any(s.row is not None for s in states.values()):
                    out.refused.append(d.key)
                continue
            where = [n for n in nodes if states[n].hash != verdict.hash]
            if not where:
                continue
            out.verdicts[d.key] = verdict
            out.targets[d.key] = where
            out.states[d.key] = states
            out.key_json[d.key] = d.key_json
            for n in where:
                plan = out.plan[n]
                if verdict.row is None:
                    plan.delete += 1
                elif states[n].row is None:
                    plan.insert += 1
                else:
                    plan.update += 1
        if progress is not None:
            progress.decided(len(batch))
    return out


async def _key_columns(
    conn: psycopg.AsyncConnection[Any], table: str, keys: Sequence[str], key_json: Sequence[str]
) -> list[tuple[str, ...]]:
    """Each key's columns as their text (for COPY), read back through the table's types."""
    query = sql.SQL(
        "SELECT {cols} FROM pg_catalog.jsonb_array_elements(%s::jsonb) WITH ORDINALITY AS e(j, i)"
        " CROSS JOIN LATERAL pg_catalog.jsonb_populate_record(NULL::{rel}, e.j) AS r ORDER BY e.i"
    ).format(cols=sql.SQL(", ").join(sql.SQL("(r.{})::text").format(sql.Identifier(k)) for k in keys),
             rel=_rel(table))
    out: list[tuple[str, ...]] = []
    for start in range(0, len(key_json), READ_BATCH):
        payload = "[" + ",".join(key_json[start:start + READ_BATCH]) + "]"
        cur = await conn.execute(query, [payload])
        out += [tuple(str(c) for c in row) for row in await cur.fetchall()]
    return out


def _groups(
    repair: TableRepair, node: str, config: Config
) -> list[tuple[tuple[str, str, int | None], list[str]]]:
    """The keys to write on `node`, grouped by winning version (winner, the version's node, commit time),
    sorted by origin, each group cut into WRITE_BATCH keys."""
    groups: dict[tuple[str, str, int | None], list[str]] = {}
    names = {n.name for n in config.nodes}
    for key, where in repair.targets.items():
        if node not in where:
            continue
        v = repair.verdicts[key]
        origin = v.version.node if v.version is not None and v.version.node in names else v.winner
        commit = None if v.version is None else v.version.commit_time or 0
        if v.version is None and v.row is not None:
            commit = 0  # a row of unknown time: as old as can be written
        groups.setdefault((v.winner, origin, commit), []).append(key)
    out = []
    for ident in sorted(groups, key=lambda g: (g[1], g[0], -1 if g[2] is None else g[2])):
        items = sorted(groups[ident])
        out += [(ident, items[i:i + WRITE_BATCH]) for i in range(0, len(items), WRITE_BATCH)]
    return out


def _statements(table: str, keys: Sequence[str], identity: Mapping[str, str]) -> dict[str, sql.Composed]:
    rel = _rel(table)
    match = _match(keys, "t", "s")
    ok = sql.SQL("s.pgmesh_g = %s AND s.pgmesh_now IS NOT DISTINCT FROM s.pgmesh_expected")
    written = list(identity)
    others = [c for c in written if c not in keys]
    replace = any(identity[c] == "a" for c in others)
    update: sql.Composable = sql.SQL("DO NOTHING")
    if others and not replace:
        update = sql.SQL("DO UPDATE SET {}").format(sql.SQL(", ").join(
            sql.SQL("{c} = EXCLUDED.{c}").format(c=sql.Identifier(c)) for c in others))
    out = {
        "lock": sql.SQL(
            "UPDATE {stage} AS s SET pgmesh_now = x.h FROM (SELECT f.pgmesh_i AS i, {hash} AS h"
            " FROM {stage} AS f JOIN {rel} AS t ON {fmatch} WHERE f.pgmesh_g = %s FOR UPDATE OF t) AS x"
            " WHERE s.pgmesh_g = %s AND s.pgmesh_i = x.i"
        ).format(stage=_STAGE, hash=row_hash(), rel=rel, fmatch=_match(keys, "t", "f")),
        "record": sql.SQL(
            "INSERT INTO pgmesh.conflict_history (source, table_name, key, conflict_type, resolution,"
            " resolver, reason, local_origin, local_commit_time, remote_origin, remote_commit_time,"
            " local_row, remote_row)"
            " SELECT 'repair', %s, s.pgmesh_k, 'divergence',"
            " CASE WHEN s.pgmesh_row IS NULL THEN 'deleted' ELSE 'written' END, 'repair',"
            " CASE WHEN s.pgmesh_row IS NULL THEN %s ELSE %s END, s.pgmesh_old_node,"
            " pg_catalog.to_timestamp(s.pgmesh_old_us::float8 / 1000000 + {epoch}), %s,"
            " coalesce(pg_catalog.to_timestamp(%s::float8 / 1000000 + {epoch}),"
            "  pg_catalog.clock_timestamp()),"
            " (SELECT pg_catalog.to_jsonb(t.*) FROM {rel} AS t WHERE {match}), s.pgmesh_row"
            " FROM {stage} AS s WHERE {ok}"
        ).format(epoch=sql.Literal(PG_EPOCH_S), rel=rel, match=match, stage=_STAGE, ok=ok),
        "delete": sql.SQL(
            "DELETE FROM {rel} AS t USING {stage} AS s WHERE {ok} AND s.pgmesh_row IS NULL AND {match}"
        ).format(rel=rel, stage=_STAGE, ok=ok, match=match),
        "insert": sql.SQL(
            "INSERT INTO {rel} ({cols}){override} SELECT {picked} FROM {stage} AS s"
            " CROSS JOIN LATERAL pg_catalog.jsonb_populate_record(NULL::{rel}, s.pgmesh_row) AS r"
            " WHERE {ok} AND s.pgmesh_row IS NOT NULL ON CONFLICT ({keys}) {update}"
        ).format(rel=rel, cols=sql.SQL(", ").join(map(sql.Identifier, written)),
                 override=overriding(dict(identity)),
                 picked=sql.SQL(", ").join(sql.SQL("r.") + sql.Identifier(c) for c in written), stage=_STAGE,
                 ok=ok, keys=sql.SQL(", ").join(map(sql.Identifier, keys)), update=update),
    }
    if replace:  # no UPDATE writes an identity column GENERATED ALWAYS (428C9): the row is replaced,
        # without a tombstone (the key never leaves)
        out["replace"] = sql.SQL(
            "DELETE FROM {rel} AS t USING {stage} AS s WHERE {ok} AND s.pgmesh_row IS NOT NULL AND {match}"
        ).format(rel=rel, stage=_STAGE, ok=ok, match=match)
    return out


_COPY_ESCAPES: Final = str.maketrans({"\\": "\\\\", "\t": "\\t", "\n": "\\n", "\r": "\\r"})


def _copy_value(value: Any) -> str:
    """A value in COPY's text format."""
    if value is None:
        return "\\N"
    if isinstance(value, int):
        return str(value)
    return str(value).translate(_COPY_ESCAPES)


async def _stage(
    conn: psycopg.AsyncConnection[Any], table: str, keys: Sequence[str], rows: Iterator[tuple[Any, ...]]
) -> None:
    """The staging table (the key's columns, typed as the table's, and the fix), filled by COPY."""
    rel = _rel(table)
    await conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(_STAGE))
    await conn.execute(sql.SQL("CREATE TEMP TABLE pgmesh_fix AS SELECT {} FROM {} AS t LIMIT 0").format(
        sql.SQL(", ").join(sql.SQL("t.") + sql.Identifier(k) for k in keys), rel))
    await conn.execute(sql.SQL(
        "ALTER TABLE {} ADD pgmesh_i int8, ADD pgmesh_g int4, ADD pgmesh_k text, ADD pgmesh_expected int8,"
        " ADD pgmesh_row jsonb, ADD pgmesh_old_node text, ADD pgmesh_old_us int8, ADD pgmesh_now int8"
    ).format(_STAGE))
    columns = sql.SQL(", ").join([*map(sql.Identifier, keys), *(sql.Identifier(c) for c in (
        "pgmesh_i", "pgmesh_g", "pgmesh_k", "pgmesh_expected", "pgmesh_row", "pgmesh_old_node",
        "pgmesh_old_us"))])
    copy_sql = sql.SQL("COPY {} ({}) FROM STDIN").format(_STAGE, columns)
    async with conn.cursor() as cur, cur.copy(copy_sql) as copy:
        chunk: list[str] = []
        for row in rows:
            chunk.append("\t".join(map(_copy_value, row)))
            if len(chunk) >= 1000:
                await copy.write("\n".join(chunk) + "\n")
                chunk = []
        if chunk:
            await copy.write("\n".join(chunk) + "\n")
    await conn.execute(sql.SQL("CREATE INDEX ON {} (pgmesh_g)").format(_STAGE))
    await conn.execute(sql.SQL("ANALYZE {}").format(_STAGE))


async def repair_table(
    conns: Mapping[str, psycopg.AsyncConnection[Any]], config: Config, table: str, diffs: Sequence[KeyDiff],
    *, source: str | None = None, progress: Progress | None = None, dry_run: bool = False,
) -> TableRepair:
    """`decide_table`, then (unless `dry_run`) `write_node` on each of its nodes at once: the whole
    repair of one table's differing keys between full nodes (`conns`: one session each, see the module
    docstring)."""
    repair = await decide_table(conns, config, table, diffs, source=source, progress=progress)
    if not dry_run:
        await asyncio.gather(*(write_node(c, config, node, repair, progress) for node, c in conns.items()))
    return repair


async def write_node(
    conn: psycopg.AsyncConnection[Any], config: Config, node: str, repair: TableRepair,
    progress: Progress | None = None,
) -> None:
    """Write `repair`'s fixes on `node` (the module docstring), filling `repair.written` and `.skipped`."""
    table = repair.table
    mine = sorted(k for k, where in repair.targets.items() if node in where)
    if not mine:
        return
    try:
        await _write(conn, config, node, repair, mine, progress)
    except psycopg.Error as exc:
        raise PgmeshError(
            f"repair of {table} failed: {describe(exc)}; the fixes of that version were not written there"
            " (one transaction each; those committed before stay); fix the cause and run `pgmesh repair`"
            " again", node=node, relation=table, sqlstate=exc.sqlstate) from None


async def _write(
    conn: psycopg.AsyncConnection[Any], config: Config, node: str, repair: TableRepair, mine: Sequence[str],
    progress: Progress | None,
) -> None:
    table = repair.table
    keys = _key_names(repair)
    columns = await _key_columns(conn, table, keys, [repair.key_json[k] for k in mine])
    by_key = dict(zip(mine, columns, strict=True))
    groups = _groups(repair, node, config)

    def staged() -> Iterator[tuple[Any, ...]]:
        i = 0
        for g, (_, items) in enumerate(groups):
            for key in items:
                state, verdict = repair.states[key][node], repair.verdicts[key]
                old = state.version if state.row is not None else None
                i += 1
                yield (*by_key[key], i, g, key, state.hash, verdict.row, None if old is None else old.node,
                       None if old is None else old.commit_time)

    await _stage(conn, table, keys, staged())
    statements = _statements(table, keys, await insert_columns(conn, table))
    origins = sorted({ident[1] for ident, _ in groups})
    await conn.execute(
        "SELECT pg_catalog.pg_replication_origin_create(x) FROM unnest(%s::text[]) AS x WHERE NOT EXISTS"
        " (SELECT 1 FROM pg_catalog.pg_replication_origin WHERE roname = x)",
        [[repair_origin(config, o) for o in origins]])
    current: str | None = None
    pending = 0
    try:
        async with conn.pipeline() as pipe:
            for g, ((winner, origin, commit), items) in enumerate(groups):
                if origin != current:
                    await conn.execute(
                        "SELECT pg_catalog.pg_replication_origin_session_reset()"
                        " WHERE pg_catalog.pg_replication_origin_session_is_setup()")
                    await conn.execute("SELECT pg_catalog.pg_replication_origin_session_setup(%s)",
                                       [repair_origin(config, origin)])
                    current = origin
                await _one_version(conn, statements, table, g, winner, commit)
                pending += len(items)
                if pending >= _SYNC_KEYS:
                    await pipe.sync()
                    if progress is not None:
                        progress.written(pending)
                    pending = 0
    finally:
        await _reset_origin(conn)
    if progress is not None and pending:
        progress.written(pending)
    cur = await conn.execute(sql.SQL(
        "SELECT pgmesh_k FROM {} WHERE pgmesh_now IS DISTINCT FROM pgmesh_expected").format(_STAGE))
    stale = {str(k) for (k,) in await cur.fetchall()}
    await conn.execute(sql.SQL("DROP TABLE {}").format(_STAGE))
    for key in mine:
        (repair.skipped if key in stale else repair.written).setdefault(key, []).append(node)


async def _reset_origin(conn: psycopg.AsyncConnection[Any]) -> None:
    if conn.closed:
        return
    if conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
        await conn.rollback()
    await conn.execute("SELECT pg_catalog.pg_replication_origin_session_reset()"
                       " WHERE pg_catalog.pg_replication_origin_session_is_setup()")


async def _one_version(
    conn: psycopg.AsyncConnection[Any], statements: Mapping[str, sql.Composed], table: str, g: int,
    winner: str, commit: int | None,
) -> None:
    """One transaction: the fixes of group `g` (one winning version), as of its commit time."""
    await conn.execute("BEGIN")
    await conn.execute(
        "SELECT pg_catalog.set_config('session_replication_role', 'replica', true),"
        " pg_catalog.set_config('synchronous_commit', 'off', true)")
    if commit is not None:
        await conn.execute(
            "SELECT pg_catalog.pg_replication_origin_xact_setup('0/0',"
            " pg_catalog.to_timestamp(%s::float8 / 1000000 + %s))", [commit, PG_EPOCH_S])
    await conn.execute(statements["lock"], [g, g])
    await conn.execute(statements["record"], [
        table, f"pgmesh repair: {winner}'s deletion (its tombstone wins)",
        f"pgmesh repair: {winner}'s version", winner, commit, g])
    await conn.execute(statements["delete"], [g])
    if "replace" in statements:
        await conn.execute("SELECT pg_catalog.set_config('pgmesh.recording', 'y', true)")
        await conn.execute(statements["replace"], [g])
        await conn.execute("SELECT pg_catalog.set_config('pgmesh.recording', '', true)")
    await conn.execute(statements["insert"], [g])
    await conn.execute("COMMIT")


def _key_names(repair: TableRepair) -> list[str]:
    return list(json.loads(next(iter(repair.key_json.values()))))
