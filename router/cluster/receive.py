"""Nodes that only receive (`receive_only = true` under their `[[nodes]]`): one-way links.

Such a node gets every other node's transactions and sends none: the router builds no link out of it
(router.service.supervisor), though it still streams it for its tombstone recorder, so its slot keeps
moving. Nothing would carry a local write on it to the others, so the nodes would drift apart for good:
pgmesh refuses such writes up front. Every replicated table there has a statement trigger,
`pgmesh_receive_only`, BEFORE INSERT, UPDATE, DELETE and TRUNCATE, that raises (SQLSTATE 25006,
read_only_sql_transaction) in any session not in `session_replication_role = replica`: the appliers,
`pgmesh repair`, `push` and the join's copy write in replica sessions and are not refused. The node's
`pgmesh.node_info` says `receive_only`, which the DDL capture reads to give a table made later by
replicated DDL the same trigger (router/ddl/sql/capture.sql). `pgmesh init` sets it up, or takes it away
when the config no longer says so. Tables that are not replicated stay writable.

Must not: decide anything about links (the supervisor does), or put a DSN in a message.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from psycopg import sql

from router.config.model import PGMESH_SCHEMA, Config
from router.nodes.connect import Conn

__all__ = ["RECEIVE_ONLY_KEY", "TRIGGER", "ensure_receive_only"]

RECEIVE_ONLY_KEY: Final = "receive_only"
TRIGGER: Final = "pgmesh_receive_only"
_FUNCTION: Final = sql.SQL("""
CREATE OR REPLACE FUNCTION {schema}.refuse_local_write() RETURNS trigger LANGUAGE plpgsql AS $body$
BEGIN
  RAISE EXCEPTION 'this node only receives (pgmesh: receive_only): % on %.% would reach no other node',
    TG_OP, TG_TABLE_SCHEMA, TG_TABLE_NAME
    USING ERRCODE = 'read_only_sql_transaction',
          HINT = 'write on a node that sends; or set receive_only = false for this node and run pgmesh init';
END
$body$
""")
_CREATE: Final = ("CREATE TRIGGER {trigger} BEFORE INSERT OR UPDATE OR DELETE OR TRUNCATE ON {table}"
                  " FOR EACH STATEMENT EXECUTE FUNCTION {schema}.refuse_local_write()")


async def ensure_receive_only(
    conn: Conn, config: Config, node: str, tables: Sequence[tuple[str, str]]
) -> list[str]:
    """In the install's transaction: `node`'s receive-only state as the config says (node_info, the
    refusing triggers on `tables`); one line if it changed."""
    schema = sql.Identifier(PGMESH_SCHEMA)
    wanted = config.node(node).receive_only
    cur = await conn.execute(sql.SQL("SELECT 1 FROM {}.node_info WHERE key = %s").format(schema),
                             [RECEIVE_ONLY_KEY])
    was = await cur.fetchone() is not None
    await conn.execute(_FUNCTION.format(schema=schema))
    trigger = sql.Identifier(TRIGGER)
    for table in tables:
        ident = sql.Identifier(*table)
        await conn.execute(sql.SQL("DROP TRIGGER IF EXISTS {} ON {}").format(trigger, ident))
        if wanted:
            await conn.execute(sql.SQL(_CREATE).format(trigger=trigger, table=ident, schema=schema))
    if wanted and not was:
        await conn.execute(sql.SQL("INSERT INTO {}.node_info VALUES (%s, 'on')").format(schema),
                           [RECEIVE_ONLY_KEY])
        return [f"receives only: no link out of it; local writes to its {len(tables)} replicated tables"
                " refused"]
    if was and not wanted:
        forget = sql.SQL("DELETE FROM {}.node_info WHERE key = %s").format(schema)
        await conn.execute(forget, [RECEIVE_ONLY_KEY])
        return ["sends again (receive_only taken away): local writes to its replicated tables allowed"]
    return []
