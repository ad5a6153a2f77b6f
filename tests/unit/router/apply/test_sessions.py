"""`router.apply.sessions`: DSNs as libpq reads them, turned into asyncpg's arguments (no server).

The same sessions against a real node (several hosts tried in turn): tests/integration/test_sessions.py.
"""

from __future__ import annotations

from router.apply.sessions import asyncpg_connect_args


def test_libpq_keywords_and_uris_become_asyncpg_arguments() -> None:
    args = asyncpg_connect_args(
        "host=db1 port=6432 dbname=app user=pgmesh password='s e c' sslmode=disable connect_timeout=7"
        " application_name=pgmesh-b passfile=/etc/pgpass target_session_attrs=read-write"
    )
    assert args == {
        "host": "db1", "port": 6432, "database": "app", "user": "pgmesh", "password": "s e c",
        "ssl": False, "timeout": 7.0, "server_settings": {"application_name": "pgmesh-b"},
        "passfile": "/etc/pgpass", "target_session_attrs": "read-write",
    }
    several = asyncpg_connect_args("postgresql://u@db1:5432,db2:5433/app?target_session_attrs=primary")
    assert several["host"] == ["db1", "db2"] and several["port"] == [5432, 5433]
    assert several["target_session_attrs"] == "primary" and several["database"] == "app"
    one_port = asyncpg_connect_args("host=db1,db2 port=5432")
    assert one_port["host"] == ["db1", "db2"] and one_port["port"] == 5432
