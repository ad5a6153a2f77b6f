"""One question each, beside its native anchor: `python -m bench.micro.<name>`.

- `decode`: the source and decoder against `pg_recvlogical`.
- `compiled`: the decoder compiled with mypyc (`protocol/_native/`) against pure Python, same bytes.
- `apply`: apply throughput and lag A -> B against native logical replication (the suite's workloads).
- `guards`: the target's cost per TPC-B transaction by conflict-guard variant.
- `conflicts`: apply throughput with 10% conflicting transactions beside none.
- `hotkeys`: three nodes writing the same 200 keys at full speed: time to identical rows, apply rate per link.
- `writecost`: a node's own writes with pgmesh against a plain node (DELETE, pgbench), and an INSERT's
  way to the other node with and without tombstones in its table.
- `spill`: one huge transaction through the source at several memory bounds.
- `join`: the initial copy of a joining node against native tablesync and `pg_dump | psql`.
- `deadnode`: a node stopped while the two others write GBs of WAL: what the live nodes' slots keep (the
  router's log holds the rest), and the time to converge once it is back.
- `compare`: `pgmesh compare` and `pgmesh repair` against one hash pass over the table on each node.
- `repair`: `pgmesh repair` of 50,000 differing keys of four kinds (tombstones included) on 3 x 1M rows.
- `verify`: continuous verification: how soon a hidden difference in a 1M-row table is reported, and
  TPC-B's throughput with it on against off.
- `quarantine`: apply with a change the target refuses set aside (`on_refused = "quarantine"`), and what a
  whole-transaction quarantine would have set aside of the same transactions.

Owns `emit` (a report printed, and appended to a file if asked). Must not: define a system or a workload
the suite also runs (those are `bench.harness`'s; `apply` reports a slice of them).
"""

from __future__ import annotations

from pathlib import Path


def emit(text: str, out: Path | None) -> None:
    """Print a report, and append it to `out` when given."""
    print(text)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        with out.open("a") as f:
            f.write(text + "\n")
