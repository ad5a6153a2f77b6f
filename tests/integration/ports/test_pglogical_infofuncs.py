"""pglogical's infofuncs.sql, ported to pgmesh (issue 17).

pglogical checks that `pglogical.pglogical_version()` is the installed extension's version and reports its
protocol versions. pgmesh installs no extension: its version is the package's, printed by
`pgmesh --version`; what it installed on a node is shown by `pgmesh init` (nothing to change when run
again) and its node id by `pgmesh.node_id()` on each node.
"""

from __future__ import annotations

from importlib.metadata import version

import pytest

from router.cluster.install import init_cluster
from router.ops.cli import main
from router.testing.mesh import fetch
from tests.fix_mesh import MeshFactory


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"pgmesh {version('pgmesh')}"


async def test_what_init_installed(mesh: MeshFactory) -> None:
    m = await mesh(nodes=2, schema="CREATE TABLE public.t (id int PRIMARY KEY)")
    report, lines = await init_cluster(m.config)  # again: everything is there already
    assert report.ok, report.render()
    assert all("already installed, nothing changed" in line for line in lines), lines
    ids = [(await fetch(node.dsn(), "SELECT pgmesh.node_id()"))[0][0] for node in m.nodes]
    assert sorted(ids) == [0, 1], ids
