"""The appliers' sessions: DSNs as libpq reads them, turned into asyncpg's arguments, against a real node."""

from __future__ import annotations

import socket
from typing import Any

import asyncpg

from router.apply.sessions import asyncpg_connect_args


def test_libpq_keywords_and_uris_become_asyncpg_arguments() -> None:
    args = asyncpg_connect_args(
        "host=db1 port=6432 dbname=app user=pgmesh password='s e c' sslmode=require connect_timeout=7"
        " application_name=pgmesh-b passfile=/etc/pgpass target_session_attrs=read-write"
    )
    assert args == {
        "host": "db1", "port": 6432, "database": "app", "user": "pgmesh", "password": "s e c",
        "ssl": "require", "timeout": 7.0, "server_settings": {"application_name": "pgmesh-b"},
        "passfile": "/etc/pgpass", "target_session_attrs": "read-write",
    }
    several = asyncpg_connect_args("postgresql://u@db1:5432,db2:5433/app?target_session_attrs=primary")
    assert several["host"] == ["db1", "db2"] and several["port"] == [5432, 5433]
    assert several["target_session_attrs"] == "primary" and several["database"] == "app"
    one_port = asyncpg_connect_args("host=db1,db2 port=5432")
    assert one_port["host"] == ["db1", "db2"] and one_port["port"] == 5432


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_several_hosts_are_tried_in_turn(pg_nodes: Any) -> None:
    (node,) = pg_nodes(1)
    dead = free_port()  # nothing listens there
    dsn = node.dsn().replace(f"port={node.port}", f"port={dead},{node.port}").replace(
        f"host={node.host}", f"host={node.host},{node.host}"
    )
    assert f"port={dead},{node.port}" in dsn
    conn = await asyncpg.connect(**asyncpg_connect_args(dsn))
    try:
        assert await conn.fetchval("SELECT 1") == 1
    finally:
        await conn.close()
