"""pglogical's init_fail.sql, ported to pgmesh's `init` (issue 17).

pglogical refuses a subscription to a provider it cannot reach (a role that does not exist), to one
without a pglogical node, and one whose role may not open a replication connection. pgmesh's equivalent
is `pgmesh init` over a config whose nodes are reached as such roles: every problem is a failed check
that names the node and says what to do, install refuses, and no node gets anything of pgmesh. With a
superuser on every node, the same nodes install.
"""

from __future__ import annotations

import pytest

from router.cluster.checks import check_cluster
from router.cluster.install import init_cluster, install
from router.config.model import parse_config
from router.errors import ConfigError
from router.testing.mesh import execute, fetch
from tests.fix_mesh import MeshFactory

NOTHING = "SELECT count(*) FROM pg_namespace WHERE nspname = 'pgmesh'"


async def test_init_fail(mesh: MeshFactory) -> None:
    m = await mesh(nodes=2, init=False, schema="CREATE TABLE public.t (id int PRIMARY KEY)")
    a, b = m.nodes
    for node in m.nodes:
        await execute(node.dsn(), "CREATE USER nonreplica", "CREATE USER nonsuper WITH REPLICATION")
    text = m.config_text()
    cases = {
        # a role that does not exist on b
        "nonexisting": (text.replace(b.dsn(), b.dsn(user="nonexisting")), [("b", "connect")],
                        'role "nonexisting" does not exist'),
        # roles that can log in but are no superusers (one may replicate, the other not)
        "nonsuper": (text.replace(a.dsn(), a.dsn(user="nonreplica")).replace(b.dsn(), b.dsn(user="nonsuper")),
                     [("a", "superuser"), ("b", "superuser")], "superuser"),
    }
    for name, (config_text, problems, words) in cases.items():
        config = parse_config(config_text)
        report = await check_cluster(config)
        assert [(c.node, c.check) for c in report.problems] == problems, (name, report.render())
        assert all(words in c.detail for c in report.problems), (name, report.render())
        assert all(c.hint for c in report.problems), (name, report.render())
        with pytest.raises(ConfigError, match="node"):
            await install(config, report)
        for node in m.nodes:
            assert await fetch(node.dsn(), NOTHING) == [(0,)], name

    report, _ = await init_cluster(m.config)
    assert report.ok, report.render()
    for node in m.nodes:
        assert await fetch(node.dsn(), NOTHING) == [(1,)]
