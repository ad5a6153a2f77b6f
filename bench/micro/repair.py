"""`pgmesh repair` at speed (issue 38 item 4): `--diffs` differing keys on a `--rows`-row table, 3 nodes.

Three nodes a, b, c, each loaded with the same `--rows` rows (pgbench_accounts' shape: bigint key, two
ints, a char(84) filler) before pgmesh is installed (identical, not replicated), then pgmesh and the
router (a process of its own). `--diffs` keys are then made to differ, in sessions replication does not
carry (a replication origin of their own), spread over `--txns` transactions per kind (each winning
version is one transaction of the repair on each node, as the apply path writes one per source
transaction), four kinds in equal parts:

- changed: updated on b (b's row is newer: written on a and c);
- deleted after a change: updated on c, then deleted on a as the router applies a deletion (replica
  role: the tombstone trigger records it; a's tombstone is newer: deleted on b and c, not resurrected);
- changed after a deletion: deleted on a (with its tombstone), then updated on b (b's row is newer than
  the tombstone: written on a and c);
- missing: deleted on c with no record of it (copied back to c, with the hint to consider `--from c`).

Tombstones stay for `[conflicts] tombstone_keep` (1 h by default) after the horizon, so the deleted
kinds are told from lost rows as in a live cluster whose difference is found within that time (by
continuous verification, or a compare); a deletion whose tombstone is gone is one repair cannot tell from
a lost row (it copies the row back and hints at `--from`).

Measured, wall clock: `pgmesh compare` finding them (exactly?), then `pgmesh repair` as a user runs it
(the CLI in a process of its own, its progress on stderr; its own compare included), its keys/s, and
a last compare (0 differences?) and the expected rows checked on every node. Target (issue 38): 50,000
keys on a 1M-row table in <= 30 s on this machine. The figure is for the whole cluster of 3 nodes (each
key read on all three, written on one or two of them).

    .venv/bin/python -m bench.micro.repair [--rows 1000000] [--diffs 50000] [--txns 50] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psycopg

from bench.faults import Cluster
from bench.micro import emit
from router.cluster.install import init_cluster
from router.config.model import parse_config
from router.ops.compare.job import compare_cluster
from router.testing.localnodes import LocalNode, LocalNodeSet
from router.testing.mesh import execute, fetch

SCHEMA = "CREATE TABLE acc (aid bigint PRIMARY KEY, bid int NOT NULL, abalance int NOT NULL, filler char(84))"
LOAD = "INSERT INTO acc SELECT g, (g - 1) / 100000 + 1, 0, '' FROM generate_series(1, %s) g"
REPO = Path(__file__).resolve().parents[2]


async def unreplicated(
    node: LocalNode, statement: str, chunks: list[list[int]], *, tombstone: bool = False
) -> None:
    """`statement` (its parameter: the keys) once per chunk, each its own transaction the router does not
    carry; `tombstone`: in the replica role, so a deletion is recorded as a replicated one is."""
    async with await psycopg.AsyncConnection.connect(node.dsn(), autocommit=True) as conn:
        await conn.execute("SELECT pg_replication_origin_create('bench_local') WHERE NOT EXISTS"
                           " (SELECT 1 FROM pg_replication_origin WHERE roname = 'bench_local')")
        await conn.execute("SELECT pg_replication_origin_session_setup('bench_local')")
        for chunk in chunks:
            async with conn.transaction():
                if tombstone:
                    await conn.execute("SET LOCAL session_replication_role = replica")
                await conn.execute(statement.encode(), [chunk])


def _chunks(keys: list[int], txns: int) -> list[list[int]]:
    size = max(1, -(-len(keys) // max(1, txns)))
    return [keys[i:i + size] for i in range(0, len(keys), size)]


async def diverge(nodes: list[LocalNode], rows: int, diffs: int, txns: int) -> dict[str, list[int]]:
    """Make `diffs` keys differ, four kinds in equal parts (the module docstring); the keys of each."""
    a, b, c = nodes
    step = max(1, rows // diffs)
    keys = list(range(3, rows, step))[:diffs]
    kinds = {name: keys[i::4] for i, name in enumerate(("changed", "deleted", "revived", "missing"))}
    update = "UPDATE acc SET abalance = abalance + 1 WHERE aid = ANY(%s)"
    delete = "DELETE FROM acc WHERE aid = ANY(%s)"
    await unreplicated(b, update, _chunks(kinds["changed"], txns))
    await unreplicated(c, update, _chunks(kinds["deleted"], txns))
    await unreplicated(a, delete, _chunks(kinds["deleted"], txns), tombstone=True)
    await unreplicated(a, delete, _chunks(kinds["revived"], txns), tombstone=True)
    await unreplicated(b, update, _chunks(kinds["revived"], txns))
    await unreplicated(c, delete, _chunks(kinds["missing"], txns))
    return kinds


async def expected(nodes: list[LocalNode], rows: int, kinds: dict[str, list[int]]) -> list[str]:
    """What is wrong on each node after the repair (nothing, if it did its job)."""
    wrong = []
    for node in nodes:
        (count,) = (await fetch(node.dsn(), "SELECT count(*) FROM acc"))[0]
        if count != rows - len(kinds["deleted"]):
            wrong.append(f"{node.name}: {count} rows, expected {rows - len(kinds['deleted'])}")
        got = await fetch(node.dsn(), "SELECT count(*) FROM acc WHERE aid = ANY(%s) AND abalance = 1",
                          [kinds["changed"] + kinds["revived"]])
        if got[0][0] != len(kinds["changed"]) + len(kinds["revived"]):
            wrong.append(f"{node.name}: {got[0][0]} changed rows")
    return wrong


def repair_cli(config_path: Path, out_dir: Path) -> tuple[float, int, dict[str, object], list[str]]:
    """`pgmesh repair --json` in a process of its own: seconds, exit code, its report, its stderr lines."""
    began = time.monotonic()
    with (out_dir / "repair.json").open("wb") as stdout, (out_dir / "repair.err").open("wb") as stderr:
        code = subprocess.run(
            [sys.executable, "-m", "router", "repair", "--config", str(config_path), "--json"],
            stdout=stdout, stderr=stderr, cwd=REPO, check=False,
        ).returncode
    seconds = time.monotonic() - began
    report = json.loads((out_dir / "repair.json").read_text() or "{}")
    return seconds, code, report, (out_dir / "repair.err").read_text().splitlines()


async def run(rows: int, diffs: int, txns: int) -> str:
    workdir = Path(tempfile.mkdtemp(prefix="pgmesh-repair-"))
    os.chmod(workdir, 0o755)
    with LocalNodeSet(["a", "b", "c"], base_dir=workdir) as nodes:
        cluster = Cluster(nodes, workdir)
        began = time.monotonic()

        async def load(node: LocalNode) -> None:
            await execute(node.dsn(), SCHEMA)
            await execute(node.dsn(), LOAD, params=[rows])
            await execute(node.dsn(), "VACUUM ANALYZE acc")

        await asyncio.gather(*(load(n) for n in nodes))
        load_s = time.monotonic() - began
        config = parse_config(cluster.config_path.read_text())
        report, _ = await init_cluster(config)
        assert report.ok, report.render()
        cluster.start_router()
        try:
            kinds = await diverge(list(nodes), rows, diffs, txns)
            found = await compare_cluster(config)
            want = {f"({k})" for keys in kinds.values() for k in keys}
            exact = {d.key for d in found.differences} == want
            repair_s, code, repaired, progress = await asyncio.to_thread(
                repair_cli, cluster.config_path, workdir)
            after = await compare_cluster(config)
            wrong = await expected(list(nodes), rows, kinds)
        finally:
            cluster.stop_router()
    compared = repaired.get("compared", {})
    compare_in_repair = float(compared.get("seconds", 0.0)) if isinstance(compared, dict) else 0.0
    fixes = repaired.get("fixes", [])
    written = sum(len(f["written"]) for f in fixes) if isinstance(fixes, list) else 0
    keys_s = diffs / repair_s if repair_s else 0.0
    shown = [line for line in progress if line.startswith(("repair:", "hint:"))]
    lines = [
        f"repair of {diffs:,} differing keys on 3 nodes x {rows:,} rows"
        f" (`python -m bench.micro.repair --rows {rows} --diffs {diffs} --txns {txns}`; each kind made in"
        f" {txns} transaction(s)); loading took {load_s:.0f} s\n",
        "| what | seconds |",
        "|---|--:|",
        f"| compare finding them (exactly: {'yes' if exact else 'NO'}; {len(found.differences):,} found)"
        f" | {found.seconds:.1f} |",
        f"| **`pgmesh repair`** (the CLI, its compare included: {compare_in_repair:.1f} s; exit code {code};"
        f" rows written: {written:,}; {keys_s:,.0f} keys/s) | **{repair_s:.1f}** |",
        f"| repair alone (decided and written) | {repair_s - compare_in_repair:.1f} |",
        f"| compare after: {len(after.differences)} difference(s); rows as expected on every node:"
        f" {'yes' if not wrong else 'NO: ' + '; '.join(wrong)} | {after.seconds:.1f} |",
        "",
        "stderr of `pgmesh repair` (progress every second, hints, summary):",
        "",
        *(f"    {line}" for line in shown[:40]),
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.micro.repair", description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--diffs", type=int, default=50_000)
    parser.add_argument("--txns", type=int, default=50,
                        help="transactions each kind of difference is made in")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    emit(asyncio.run(run(args.rows, args.diffs, args.txns)), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
