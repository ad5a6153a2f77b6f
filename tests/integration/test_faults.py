"""The fault suite (bench/faults.py) at its small size: each fault on fresh nodes, then the invariants.

Every scenario must converge with nothing lost or duplicated, every ledger balanced, the router's RSS and
the live nodes' retained WAL within bounds. `python -m bench.faults` runs them at full size (a 60 s cut, a
2 minute SIGSTOP, a million-row transaction) and writes the report in bench/results/faults.md.
"""

from __future__ import annotations

import pytest

from bench.faults import SCENARIOS, SMALL, render, run_scenario

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("fault", sorted(SCENARIOS))
async def test_fault(fault: str) -> None:
    result = await run_scenario(fault, SMALL)
    assert result.ok, render([result], SMALL)
