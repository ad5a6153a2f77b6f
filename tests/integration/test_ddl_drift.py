"""DDL never diverges silently (issue 18, item 3): schema drift found and held (router.ddl.drift), and
`[ddl] mode = "locked"` (router.ddl.sql.capture's ddl_locked, `pgmesh ddl`), on real clusters."""

from __future__ import annotations

import logging
from collections.abc import Awaitable

import msgspec
import psycopg
import pytest

from router.cluster.install import init_cluster
from router.config.model import DdlSection
from router.ops.control import render_status
from router.ops.ddl import cmd_ddl
from router.service.supervisor import Router
from router.testing.mesh import execute, fetch, free_port, running_router, wait_converged, wait_for
from tests.fix_mesh import MeshFactory

SCHEMA = "CREATE TABLE t (id bigint PRIMARY KEY, v text);"
LOCAL = "SET pgmesh.ddl_local = on; "


async def column_type(dsn: str, column: str) -> str | None:
    rows = await fetch(
        dsn, "SELECT format_type(atttypid, atttypmod) FROM pg_attribute WHERE attrelid = 't'::regclass"
        " AND attname = %s AND NOT attisdropped", [column],
    )
    return rows[0][0] if rows else None


def states(router: Router) -> set[str]:
    return {link.state for link in router.status().links}


async def test_concurrent_add_column_is_drift_held_until_the_types_agree(
    mesh: MeshFactory, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="router.ddl.drift")
    m = await mesh(nodes=2, schema=SCHEMA)
    a, b = m.nodes
    async with running_router(m.config) as router:
        router.drift.recheck_s, router.drift.settle_s = 0.5, 3.0
        await execute(a.dsn(), "INSERT INTO t VALUES (1, 'a')")
        await wait_converged(m.nodes, ["t"])
        # "at about the same time": neither command reaches the other node before its own ran
        await router.pause(None)
        before = await fetch(a.dsn(), "SELECT pg_current_wal_lsn()")
        await execute(a.dsn(), "ALTER TABLE t ADD COLUMN z int")
        await execute(b.dsn(), "ALTER TABLE t ADD COLUMN z text")
        await router.resume(None)
        await wait_for(lambda: states(router) == {"error"}, "both links to stop on the DDL")
        assert all("42701" in (link.last_error or "") for link in router.status().links)
        # the failed command is still to apply on b (its origin's progress stays before it)
        progress = "SELECT pg_replication_origin_progress('pgmesh_t_a', true) <= %s::pg_lsn"
        assert await fetch(b.dsn(), progress, [before[0][0]]) == [(True,)], "failed DDL counted as applied"

        # the obvious fix by hand: drop z locally, resume; each node replays the other's ADD COLUMN
        await execute(b.dsn(), LOCAL + "ALTER TABLE t DROP COLUMN z")
        await router.resume("b")
        await wait_for(lambda: _is(column_type(b.dsn(), "z"), "integer"), "a's z on b")
        await execute(a.dsn(), LOCAL + "ALTER TABLE t DROP COLUMN z")
        await router.resume("a")
        await wait_for(lambda: _is(column_type(a.dsn(), "z"), "text"), "b's z on a")

        # a holds z text, b z integer: drift, in status, metrics and one log line
        await wait_for(lambda: states(router) == {"schema drift"}, "both links held on schema drift")
        report = router.status()
        assert len(report.schema_drift) == 1, report.schema_drift
        assert "public.t" in report.schema_drift[0] and "column z" in report.schema_drift[0]
        assert "integer on b" in report.schema_drift[0] and "text on a" in report.schema_drift[0]
        assert "SCHEMA DRIFT: table public.t" in render_status(report)
        assert all("column z" in (link.last_error or "") for link in report.links)
        await wait_for(lambda: 'pgmesh_schema_drift{node="a",table="public.t"} 1' in router.metrics.render(),
                       "the drift in /metrics")
        text = router.metrics.render()
        assert 'pgmesh_schema_drift{node="b",table="public.t"} 1' in text
        assert 'pgmesh_link_state{source="a",state="schema_drift",target="b"} 1.0' in text
        found = [r.getMessage() for r in caplog.records if r.getMessage().startswith("schema drift: ")]
        assert len(found) == 1, found
        assert all(word in found[0] for word in ("public.t", "column z", "on a", "on b")), found[0]
        assert not router.health()[0]

        # held: the rows written meanwhile wait (nothing applied, nothing lost)
        await execute(a.dsn(), "INSERT INTO t VALUES (2, 'a', '20')")
        await execute(b.dsn(), "INSERT INTO t VALUES (3, 'b', 30)")
        held = [router.appliers[("a", "b")], router.appliers[("b", "a")]]
        await wait_for(lambda: all(link.pending >= 1 for link in held), "the new rows queued, held")
        assert states(router) == {"schema drift"}
        assert await fetch(b.dsn(), "SELECT count(*) FROM t WHERE id = 2") == [(0,)]
        assert await fetch(a.dsn(), "SELECT count(*) FROM t WHERE id = 3") == [(0,)]

        # a `pgmesh resume` keeps a drifted link held
        await router.resume(None)
        assert states(router) == {"schema drift"}

        # fixed: a's z is made integer as on b; the links run again and the rows converge
        await execute(a.dsn(), LOCAL + "ALTER TABLE t ALTER COLUMN z TYPE integer USING z::integer")
        await wait_for(lambda: states(router) <= {"streaming", "catching up"}, "the links to run again")
        await wait_converged(m.nodes, ["t"])
        assert router.status().schema_drift == []
        await wait_for(lambda: "pgmesh_schema_drift{" not in router.metrics.render(), "the drift gone")
        assert any("schema drift over: table public.t" in r.getMessage() for r in caplog.records)
    for node in m.nodes:
        assert await fetch(node.dsn(), "SELECT id, v, z FROM t ORDER BY id") == [
            (1, "a", None), (2, "a", 20), (3, "b", 30)
        ]


async def test_ddl_in_flight_is_not_drift(mesh: MeshFactory) -> None:
    """DDL from one node while another replays it: columns differ for a moment, never reported."""
    m = await mesh(nodes=3, schema=SCHEMA)
    a, b, c = m.nodes
    async with running_router(m.config) as router:
        router.drift.recheck_s = 0.5
        await router.pause("c")  # c lags: a's DDL reaches b, not c
        await execute(a.dsn(), "ALTER TABLE t ADD COLUMN w int")
        await wait_for(lambda: _is(column_type(b.dsn(), "w"), "integer"), "a's DDL on b")
        await wait_for(lambda: router.appliers[("a", "b")].stats.ddl_applied == 1, "the replay counted")
        await router.resume("c")
        await wait_for(lambda: _is(column_type(c.dsn(), "w"), "integer"), "a's DDL on c")
        await execute(b.dsn(), "INSERT INTO t VALUES (1, 'b', 1)")
        await wait_converged(m.nodes, ["t"])
        assert await router.drift.check() == {}
        assert router.status().schema_drift == []
        assert states(router) <= {"streaming", "catching up"}


async def test_locked_mode_refuses_direct_ddl_and_pgmesh_ddl_reaches_every_node(
    mesh: MeshFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    m = await mesh(nodes=2, schema=SCHEMA, extra='[ddl]\nmode = "locked"\n', admin_port=free_port())
    a, b = m.nodes
    with pytest.raises(psycopg.errors.FeatureNotSupported, match="runs only through pgmesh ddl") as refused:
        await execute(a.dsn(), "ALTER TABLE t ADD COLUMN w int")
    assert "pgmesh ddl" in (refused.value.diag.message_hint or "")
    with pytest.raises(psycopg.errors.FeatureNotSupported):
        await execute(b.dsn(), "CREATE TABLE other (id int PRIMARY KEY)")
    with pytest.raises(psycopg.errors.FeatureNotSupported):
        await execute(b.dsn(), "DROP TABLE t")
    # what is not replicated stays allowed: a temporary table, DDL kept local on purpose
    await execute(a.dsn(), "CREATE TEMP TABLE scratch (x int); DROP TABLE scratch")
    await execute(a.dsn(), LOCAL + "CREATE INDEX t_v_local ON t (v)")
    assert await column_type(a.dsn(), "w") is None

    async with running_router(m.config) as router:
        await execute(a.dsn(), "INSERT INTO t VALUES (1, 'a')")
        assert await cmd_ddl(m.config, "ALTER TABLE t ADD COLUMN w int DEFAULT 7", node="b") == 0
        assert "barrier: applied on every node" in capsys.readouterr().out
        for node in m.nodes:  # no --wait needed: locked mode drains and waits by itself
            assert await column_type(node.dsn(), "w") == "integer", node.name
        await execute(b.dsn(), "INSERT INTO t (id, v) VALUES (2, 'b')")
        await wait_converged(m.nodes, ["t"])
        assert all(applier.last_error is None for applier in router.appliers.values())
    assert await fetch(a.dsn(), "SELECT id, w FROM t ORDER BY id") == [(1, 7), (2, 7)]

    # back to "replicated": init installs the permissive trigger again
    report, _ = await init_cluster(msgspec.structs.replace(m.config, ddl=DdlSection()))
    assert report.ok, report.render()
    await execute(a.dsn(), "ALTER TABLE t ADD COLUMN u int")


async def _is(value: Awaitable[object], expected: object) -> bool:
    return await value == expected
