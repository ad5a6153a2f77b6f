"""The fail point mechanism (router.failpoints): arming, raising, stalling, counting, the environment."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from router import failpoints

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(autouse=True)
def clean() -> Iterator[None]:
    failpoints.disarm()
    yield
    failpoints.disarm()


async def test_an_unarmed_point_passes_and_nothing_is_armed() -> None:
    assert not failpoints.ARMED  # the guard every point reads first
    await failpoints.hit("apply.before_commit")
    failpoints.hit_now("log.segment_switch")


async def test_an_armed_point_raises_the_given_exception_once() -> None:
    armed = failpoints.arm("apply.batch_sent", error=RuntimeError("boom"))
    await failpoints.hit("apply.before_commit")  # another point: passes
    with pytest.raises(RuntimeError, match="boom"):
        await failpoints.hit("apply.batch_sent")
    await failpoints.hit("apply.batch_sent")  # once by default: then it passes
    assert armed.hits == 2


async def test_the_fixed_failure_is_a_lost_connection_naming_the_point() -> None:
    failpoints.arm("apply.before_commit", error=failpoints.FAILED)
    with pytest.raises(ConnectionResetError, match=r"fail point apply\.before_commit"):
        await failpoints.hit("apply.before_commit")


async def test_after_and_times_choose_which_hits_fire() -> None:
    failpoints.arm("log.segment_switch", error=failpoints.FAILED, after=2, times=2)
    fired = []
    for _ in range(6):
        try:
            failpoints.hit_now("log.segment_switch")
            fired.append(False)
        except ConnectionResetError:
            fired.append(True)
    assert fired == [False, False, True, True, False, False]


async def test_a_stall_says_it_was_reached_and_waits_for_the_test() -> None:
    go = asyncio.Event()
    armed = failpoints.arm("join.after_snapshot", stall=go)
    task = asyncio.create_task(failpoints.hit("join.after_snapshot"))
    await armed.wait_reached(5)
    assert not task.done()  # held there until the test lets it go
    go.set()
    await asyncio.wait_for(task, 5)
    await asyncio.wait_for(failpoints.hit("join.after_snapshot"), 5)  # fired once: passes now


async def test_waiting_for_a_stall_that_is_never_reached_is_bounded() -> None:
    armed = failpoints.arm("apply.batch_sent", stall=asyncio.Event())
    with pytest.raises(TimeoutError):
        await armed.wait_reached(0.01)


def test_arming_refuses_unknown_points_and_unclear_actions() -> None:
    with pytest.raises(ValueError, match=r"no fail point 'apply\.befor_commit'"):
        failpoints.arm("apply.befor_commit", error=failpoints.FAILED)
    with pytest.raises(ValueError, match="exactly one"):
        failpoints.arm("apply.batch_sent")
    with pytest.raises(ValueError, match="exactly one"):
        failpoints.arm("apply.batch_sent", error=failpoints.FAILED, kill=True)
    with pytest.raises(ValueError, match="synchronous"):
        failpoints.arm("log.segment_switch", stall=asyncio.Event())
    assert not failpoints.ARMED


def test_disarm_one_or_all() -> None:
    failpoints.arm("apply.batch_sent", error=failpoints.FAILED)
    failpoints.arm("apply.before_commit", error=failpoints.FAILED)
    failpoints.disarm("apply.batch_sent")
    assert set(failpoints.ARMED) == {"apply.before_commit"}
    failpoints.disarm()
    assert not failpoints.ARMED


def test_the_environment_arms_raise_and_kill() -> None:
    found = failpoints.from_environment(" log.segment_switch=kill@1, apply.batch_sent=raise ")
    assert set(found) == {"log.segment_switch", "apply.batch_sent"}
    assert found["log.segment_switch"].kill and found["log.segment_switch"].after == 1
    assert isinstance(found["apply.batch_sent"].exception(), ConnectionResetError)
    assert failpoints.from_environment("") == {}
    for wrong in ("nowhere=raise", "apply.batch_sent=stall", "apply.batch_sent=raise@x", "apply.batch_sent"):
        with pytest.raises(ValueError, match=failpoints.ENV):
            failpoints.from_environment(wrong)


def test_a_killing_point_ends_the_process_as_sigkill_would() -> None:
    code = ("from router import failpoints\n"
            "failpoints.hit_now('log.segment_switch')\n"
            "failpoints.hit_now('log.segment_switch')\n"
            "print('not reached')\n")
    env = {**os.environ, failpoints.ENV: "log.segment_switch=kill@1", failpoints.TESTING_ENV: "1"}
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, timeout=60,
                          check=False)
    assert done.returncode == 137 and b"not reached" not in done.stdout
    assert b"fail point log.segment_switch fired (hit 2)" in done.stderr


def test_every_point_is_in_the_code_once() -> None:
    """Each named point sits at one place in router/ (a point nobody can reach would arm in vain)."""
    sources = [p.read_text() for p in (ROOT / "router").rglob("*.py") if p.name != "failpoints.py"]
    for name in failpoints.POINTS:
        calls = sum(s.count(f'failpoints.hit("{name}")') + s.count(f'failpoints.hit_now("{name}")')
                    for s in sources)
        assert calls == 1, (name, calls)


def test_points_in_the_environment_outside_a_test_arm_nothing_and_the_router_refuses_to_start() -> None:
    code = ("from router import failpoints\n"
            "print(sorted(failpoints.ARMED))\n"
            "print(failpoints.environment_refusal())\n")
    env = {k: v for k, v in os.environ.items() if k != failpoints.TESTING_ENV}
    env[failpoints.ENV] = "log.segment_switch=kill@1"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, timeout=60,
                          check=True, text=True)
    armed, refusal = done.stdout.splitlines()
    assert armed == "[]"
    assert "PGMESH_FAILPOINTS is set" in refusal and "for tests only" in refusal
    env[failpoints.TESTING_ENV] = "1"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, timeout=60,
                          check=True, text=True)
    assert done.stdout.splitlines() == ["['log.segment_switch']", "None"]
