"""`pgmesh init` runs each custom resolver on generated pairs in both orders (issue 18, item 6).

An asymmetric resolver (its outcome depends on which side is local) is refused, naming the table and the
resolver; a symmetric one on another table passes, and once the asymmetric one is gone init installs.
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from router.cluster.checks import check_cluster
from router.cluster.install import init_cluster
from router.errors import ConfigError
from router.testing.mesh import running_router, wait_for
from tests.fix_mesh import MeshFactory

SCHEMA = """
CREATE TABLE "fair" ("id" int PRIMARY KEY, "qty" numeric, "note" text);
CREATE TABLE "biased" ("id" int PRIMARY KEY, "qty" numeric, "note" text);
"""


def later_wins(conflict: str, local_row: dict[str, Any], remote_row: dict[str, Any], local: Any,
               remote: Any) -> Any:
    """Symmetric: the later version wins (as last_update_wins), whichever side is local."""
    if local is not None and local.order() > remote.order():
        return dict(local_row) if local_row else "keep_local"
    return dict(remote_row) if conflict in ("update_origin_differs", "insert_exists") else "apply_remote"


def local_wins(conflict: str, local_row: dict[str, Any], remote_row: dict[str, Any], local: Any,
               remote: Any) -> Any:
    """Asymmetric: each node keeps its own row, so two nodes keep different rows for ever."""
    return dict(local_row) if local_row else "apply_remote"


FAIR = f'[[tables]]\nname = "public.fair"\nresolver = "{__name__}:later_wins"\n'
BIASED = (
    f'\n[[tables]]\nname = "public.biased"\n[tables.types]\nupdate_origin_differs = "{__name__}:local_wins"\n'
)


async def test_init_refuses_an_asymmetric_custom_resolver_and_accepts_a_symmetric_one(
    mesh: MeshFactory,
) -> None:
    m = await mesh(nodes=2, schema=SCHEMA, extra=FAIR + BIASED, init=False)
    report = await check_cluster(m.config)
    resolver_checks = [c for c in report.checks if c.check == "resolver"]
    assert [(c.node, c.relation, c.ok) for c in resolver_checks] == [
        ("a", "public.biased", False),
        ("a", "public.fair", True),
    ], report.render()
    assert [(c.check, c.relation) for c in report.problems] == [("resolver", "public.biased")]
    refused = resolver_checks[0].detail
    expected = f"custom resolver {__name__}:local_wins can leave nodes apart: update against update, x = "
    assert refused.startswith(expected), refused
    assert "the node holding x ends with" in refused
    rendered = report.render()
    assert "NOT READY" in rendered and "table public.biased: custom resolver" in rendered
    with pytest.raises(ConfigError):
        await init_cluster(m.config)

    fair = [t for t in m.config.tables if t.name != "public.biased"]
    fair_only = msgspec.structs.replace(m.config, tables=fair)
    report, _done = await init_cluster(fair_only)
    assert report.ok, report.render()
    assert [c.relation for c in report.checks if c.check == "resolver"] == ["public.fair"]


async def test_a_cluster_allowing_divergence_says_so_in_status_and_metrics(mesh: MeshFactory) -> None:
    """`allow_divergence = true` with a resolver that can diverge: the running router's status lists the
    setting, and /metrics has `pgmesh_divergence_allowed{setting=...} 1` for it, for as long as it runs."""
    extra = '[conflicts]\nallow_divergence = true\nresolver = "keep_local"\n'
    m = await mesh(nodes=2, schema="CREATE TABLE t (id int PRIMARY KEY, v text);", extra=extra)
    async with running_router(m.config) as router:
        assert any("keep_local" in s for s in router.status().divergence), router.status().divergence

        def exported() -> bool:
            text = router.metrics.registry.render()
            return any(line.startswith("pgmesh_divergence_allowed{setting=") and "keep_local" in line
                       and float(line.split()[-1]) == 1 for line in text.splitlines())

        await wait_for(exported, "the divergence gauge in /metrics")
