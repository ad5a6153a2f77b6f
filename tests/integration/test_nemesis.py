"""The randomized fault run (bench/nemesis.py) for 75 s with a fixed seed: 3 nodes behind proxies and under
libfaketime, an active and a standby router, ledger and set writers on every node, and every kind of fault
at least once (the nemesis deals each kind once per shuffled round): SIGKILL and SIGSTOP (past its lease)
of the active router, an immediate stop of a node, a node's link cut, a node's clock stepped.

At the end every acknowledged insert is on every node exactly once (a keyless table too), the ledgers are
whole and equal, `pgmesh compare` exits 0, one router is active, no woken router wrote. 2 to 3 minutes
here (75 s of faults, the set-up, convergence and the checks). `python -m bench.faults --nemesis
--minutes 30` is the full run.
"""

from __future__ import annotations

import pytest

from bench.nemesis import ACTIONS, run

pytestmark = pytest.mark.slow

SEED = 38


async def test_a_short_nemesis_run_loses_duplicates_and_diverges_nothing() -> None:
    outcome, workdir = await run(1.25, SEED)  # (in the system's temp dir: the servers run as postgres)
    report = outcome.render("test")
    assert outcome.ok, report
    assert {f.kind for f in outcome.faults} == set(ACTIONS), report
    assert not any(n.startswith("skipped") for f in outcome.faults for n in f.notes), report
    assert not workdir.exists()
