"""Apply paths as users meet them, three nodes and a router process: a STORED generated column beside a
TOASTed text updated on two nodes at once, a large transaction into such a table, and an application that
calls nextval() itself on every node (before and after `pgmesh sequences convert`).

Owns: those scripted paths, each ending in `wait_identical` (every table, keyless ones included, and the
schema facts, the same on every node) or in the loud report asserted.
Must not: sleep for a fixed time, or reach into the router's objects (only its CLI, /status, /metrics
and its log).
"""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from router.testing.mesh import wait_for
from tests.fix_mesh import MeshFactory
from tests.integration.real_use.users import RouterProcess, pgmesh, psql, wait_identical

# A text over 2 kB that pglz cannot shrink below the TOAST threshold (random md5 chains): stored out of
# line, so an UPDATE that leaves it alone sends it as "unchanged TOAST".
BIG = "(SELECT string_agg(md5(random()::text || g::text), '') FROM generate_series(1, 150) g)"

GENERATED_SCHEMA = """
CREATE TABLE items (id int PRIMARY KEY, name text NOT NULL, price int NOT NULL,
                    price_x2 int GENERATED ALWAYS AS (price * 2) STORED, note text);
"""


def _status(config: Path) -> dict[str, Any]:
    done = pgmesh(config, "status", "--json", check=True)
    status: dict[str, Any] = json.loads(done.stdout)
    return status


def _streaming(config: Path) -> bool:
    links = _status(config)["links"]
    return bool(links) and all(lk["state"] == "streaming" and not lk["last_error"] for lk in links)


async def _started(tmp_path: Path, made: Any) -> tuple[RouterProcess, Path]:
    router = RouterProcess(tmp_path, made)
    router.start()
    config = tmp_path / "r.toml"
    await wait_for(lambda: _streaming(config), "every link streaming", 60)
    return router, config


async def test_generated_column_beside_toasted_text_updated_on_two_nodes(
    mesh: MeshFactory, tmp_path: Path
) -> None:
    """Node a changes the large text, node b the price, of the same rows while the links are held
    (paused: the two updates are concurrent). b's update carries the text as unchanged TOAST and wins
    (later): a and c overwrite a's version with b's row, read whole on b, whose generated price_x2 only
    the server may write. Every link keeps streaming and every node ends the same."""
    made = await mesh(nodes=3, schema=GENERATED_SCHEMA)
    a, b, c = made.nodes
    psql(a, f"INSERT INTO items (id, name, price, note) SELECT i, 'item ' || i, 10 * i, {BIG}"
            " FROM generate_series(1, 4) i")
    toasted = psql(a, "SELECT count(*) FROM items WHERE pg_column_size(note) > 2000").stdout
    assert " 4\n" in toasted, toasted
    router, config = await _started(tmp_path, made)
    try:
        await wait_identical(made.nodes)
        pgmesh(config, "pause", check=True)
        psql(a, f"UPDATE items SET note = {BIG} WHERE id IN (1, 2)")  # the text, first
        psql(b, "UPDATE items SET price = 7 WHERE id IN (1, 2)")  # the price, later: it wins
        psql(b, "UPDATE items SET price = 9 WHERE id = 3")  # the other order: the text, later, wins
        psql(c, f"UPDATE items SET note = {BIG} WHERE id = 3")  # (its row whole: price 30 stays)
        pgmesh(config, "resume", check=True)
        await wait_identical(made.nodes)
        await wait_for(lambda: _streaming(config), "every link streaming after the conflicts", 30)
        rows = psql(c, "SELECT id, price, price_x2 FROM items ORDER BY id").stdout
        assert "1 |     7 |       14" in rows and "3 |    30 |       60" in rows, rows
        assert "428C9" not in router.output()
    finally:
        await router.stop()


async def test_large_transactions_into_a_table_with_a_generated_column(
    mesh: MeshFactory, tmp_path: Path
) -> None:
    """A 3,000-row INSERT (the large path: COPY runs) into a table with a generated column applies; then
    two large UPDATEs of the same 200 rows on two nodes at once (one the text, one the price) go from the
    large path to the careful one (conflicts), where the winning rows are read whole on their source."""
    made = await mesh(nodes=3, schema=GENERATED_SCHEMA)
    a, b, _ = made.nodes
    router, config = await _started(tmp_path, made)
    try:
        psql(a, f"INSERT INTO items (id, name, price, note) SELECT i, 'item ' || i, i,"
                f" CASE WHEN i <= 200 THEN {BIG} END FROM generate_series(1, 3000) i")
        await wait_identical(made.nodes)
        pgmesh(config, "pause", check=True)
        psql(a, f"UPDATE items SET note = {BIG} || id WHERE id <= 200")
        psql(b, "UPDATE items SET price = price + 1000 WHERE id <= 200")
        pgmesh(config, "resume", check=True)
        await wait_identical(made.nodes)
        await wait_for(lambda: _streaming(config), "every link streaming after the large conflicts", 30)
        won = "SELECT count(*) FROM items WHERE id <= 200 AND price > 1000 AND price_x2 = 2 * price"
        rows = psql(a, won).stdout
        assert " 200\n" in rows, rows
    finally:
        await router.stop()


INVOICES_SCHEMA = """
CREATE SEQUENCE invoice_no_seq;
CREATE TABLE invoices (no bigint PRIMARY KEY, customer text NOT NULL, amount numeric NOT NULL);
"""


def _invoice_round(nodes: list[Any], round_: int) -> None:
    """Each node's application books two invoices, numbering them itself with nextval() (one psql
    session per invoice, as an application's connection pool would)."""
    for node in nodes:
        for i in range(2):
            psql(node, f"INSERT INTO invoices VALUES (nextval('invoice_no_seq'), 'customer of {node.name}',"
                       f" {round_ * 100 + i})")


def _lost(config: Path) -> dict[str, dict[str, int]]:
    lost: dict[str, dict[str, int]] = _status(config).get("lost_inserts", {})
    return lost


def _metrics(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text: str = reply.read().decode()
        return text


async def test_application_calling_nextval_itself_on_three_nodes(mesh: MeshFactory, tmp_path: Path) -> None:
    """An application numbers invoices with nextval('invoice_no_seq') itself (no column default names the
    sequence) on three nodes at once. Unconverted, each node hands out 1, 2: of 6 inserts 2 rows remain,
    and the 4 others are lost to key collisions, which `pgmesh status`, /metrics and the router's log
    report (with the hint to convert); `sequences status` lists the sequence, and after `sequences
    convert` (default mode: snowflake, which a nextval() caller never reaches: step for it) no insert is
    lost."""
    made = await mesh(nodes=3, schema=INVOICES_SCHEMA)
    nodes = made.nodes
    router, config = await _started(tmp_path, made)
    try:
        shown = pgmesh(config, "sequences", "status", check=True).stdout
        assert "public.invoice_no_seq" in shown and "local (unconverted)" in shown, shown
        assert "WARNING: sequence public.invoice_no_seq hand(s) out the same values" in shown, shown

        pgmesh(config, "pause", check=True)  # held: the three applications insert at once
        _invoice_round(nodes, 1)
        pgmesh(config, "resume", check=True)
        await wait_identical(nodes)
        count = psql(nodes[0], "SELECT count(*) FROM invoices").stdout
        assert " 2\n" in count, count  # 6 inserts committed, 2 rows left: the collisions' losers are gone
        # every node decided 2 collisions per key: 4 lost inserts, counted and shown
        await wait_for(lambda: all(_lost(config).get(n.name, {}).get("public.invoices") == 4 for n in nodes),
                       "4 lost inserts on every node in `pgmesh status`", 30)
        text = pgmesh(config, "status", check=True).stdout
        assert "LOST INSERTS on a" in text and "public.invoices 4" in text, text
        assert "pgmesh sequences convert" in text, text
        metrics = _metrics(router.port)
        for node in nodes:
            sample = rf'pgmesh_lost_inserts_total{{[^}}]*node="{node.name}"[^}}]*}} 4(\.0)?$'
            assert re.search(sample, metrics, re.M), metrics[-2000:]
        log = (tmp_path / "r.log").read_text()
        assert "lost to key collisions on public.invoices" in log and "pgmesh sequences convert" in log

        converted = pgmesh(config, "sequences", "convert", check=True).stdout
        assert "converted to step mode" in converted, converted
        shown = pgmesh(config, "sequences", "status", check=True).stdout
        assert "step 100 offset 2" in shown and "WARNING" not in shown, shown

        pgmesh(config, "pause", check=True)
        _invoice_round(nodes, 2)
        pgmesh(config, "resume", check=True)
        await wait_identical(nodes)
        count = psql(nodes[0], "SELECT count(*) FROM invoices").stdout
        assert " 8\n" in count, count  # every insert kept
        assert all(_lost(config).get(n.name, {}).get("public.invoices") == 4 for n in nodes), _lost(config)
    finally:
        await router.stop()


async def test_a_publication_that_publishes_generated_columns(mesh: MeshFactory, tmp_path: Path) -> None:
    """PostgreSQL 18: a DBA sets publish_generated_columns = stored on pgmesh's publication (say, for
    another subscriber's sake). The rows then carry price_x2, which no INSERT or UPDATE may write: the
    links apply them without it (the target computes it), single rows and a large COPY run alike."""
    made = await mesh(nodes=3, schema=GENERATED_SCHEMA, versions=[18, 18, 18])
    a, b, _ = made.nodes
    for node in made.nodes:
        psql(node, "SET pgmesh.ddl_local = on;"
                   " ALTER PUBLICATION pgmesh_t SET (publish_generated_columns = stored)")
        published = psql(node, "SELECT pubgencols FROM pg_publication WHERE pubname = 'pgmesh_t'").stdout
        assert " s\n" in published, published
    router, config = await _started(tmp_path, made)
    try:
        psql(a, "INSERT INTO items (id, name, price) VALUES (1, 'one', 5)")
        psql(b, "INSERT INTO items (id, name, price, note) SELECT i, 'item ' || i, i, 'x' FROM"
                " generate_series(2, 500) i")
        psql(a, "UPDATE items SET price = price + 1 WHERE id <= 10")
        await wait_identical(made.nodes)
        assert _streaming(config), _status(config)["links"]
        rows = psql(b, "SELECT price, price_x2 FROM items WHERE id = 1").stdout
        assert "6 |       12" in rows, rows
    finally:
        await router.stop()


async def test_keyless_table_with_a_generated_column(mesh: MeshFactory, tmp_path: Path) -> None:
    """A table without a key (init makes it REPLICA IDENTITY FULL) and with a generated column: a node's
    own deletes are recorded as tombstones (its recorder keyed them by every column, the generated one
    too, which the decoded stream does not carry: none was written, silently), and rows deleted, updated
    and inserted again on three nodes end the same everywhere."""
    made = await mesh(nodes=3, schema="CREATE TABLE moves (at int, qty int,"
                                      " qty_x2 int GENERATED ALWAYS AS (qty * 2) STORED);")
    a, b, c = made.nodes
    router, config = await _started(tmp_path, made)
    try:
        psql(a, "INSERT INTO moves SELECT i, i FROM generate_series(1, 10) i")
        await wait_identical(made.nodes)
        deleted = psql(b, "DELETE FROM moves WHERE at <= 3", check=False)
        if "Replica identity must not contain unpublished generated columns" in deleted.stderr:
            # PostgreSQL 18 refuses every DELETE and UPDATE of a REPLICA IDENTITY FULL table whose
            # generated column the publication leaves out (init made it FULL): open, see the report
            pytest.xfail("18: a keyless table with a generated column refuses DELETE/UPDATE under FULL")
        assert deleted.returncode == 0, deleted.stderr
        psql(c, "UPDATE moves SET qty = 100 WHERE at = 9")
        psql(a, "INSERT INTO moves VALUES (1, 1)")
        await wait_identical(made.nodes)

        def recorded() -> bool:
            return any(r["node"] == "b" and r["tombstones"] == 3 for r in _status(config)["recorders"])

        await wait_for(recorded, "node b's own 3 deletes recorded as tombstones", 30)
        assert _streaming(config)
    finally:
        await router.stop()
