"""`router.nodes.connect`: how each `Failure` reports a DSN that does not parse and a server that refuses
(no server: a closed port on this host refuses at once)."""

from __future__ import annotations

import socket

import psycopg
import pytest

from router.config.model import NodeConfig
from router.errors import PgmeshError
from router.nodes.connect import Failure, connect

_BAD = NodeConfig(name="a", dsn="not a dsn password=s3cret")


def _refusing() -> NodeConfig:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return NodeConfig(name="a", dsn=f"host=127.0.0.1 port={port} user=u dbname=d password=s3cret")


async def test_as_is_reports_a_bad_dsn_without_echoing_it_and_lets_the_rest_through() -> None:
    with pytest.raises(PgmeshError) as bad:
        await connect(_BAD, purpose="test", failure=Failure.AS_IS)
    assert str(bad.value) == (
        "node a: the dsn is not a valid libpq connection string (hint: fix its dsn in the config)"
    )
    with pytest.raises(psycopg.OperationalError):
        await connect(_refusing(), purpose="test", admin=True, failure=Failure.AS_IS)


async def test_cannot_connect_names_the_node() -> None:
    with pytest.raises(PgmeshError) as refused:
        await connect(_refusing(), purpose="test", wait_s=5, lock_wait_s=1.5)
    assert refused.value.node == "a"
    assert refused.value.message.startswith("cannot connect: ")
    assert refused.value.hint is None
    assert "s3cret" not in str(refused.value)


async def test_unreachable_says_every_node_must_be_reachable() -> None:
    with pytest.raises(PgmeshError) as bad:
        await connect(_BAD, purpose="test", failure=Failure.UNREACHABLE)
    assert str(bad.value) == "node a: the dsn is not a valid libpq connection string"
    with pytest.raises(PgmeshError) as refused:
        await connect(_refusing(), purpose="test", autocommit=False, failure=Failure.UNREACHABLE)
    assert refused.value.message.startswith("cannot connect: ")
    assert refused.value.sqlstate is None
    assert refused.value.hint == "every node must be reachable; check that node a is running"
