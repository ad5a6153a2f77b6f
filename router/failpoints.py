"""Named fail points: the few places where races live, which a test can arm to raise or to stall there.

A point is one line at its place, guarded so that an unarmed point costs a module attribute read and the
truth of an empty dict: `if failpoints.ARMED: await failpoints.hit("apply.before_commit")` (in synchronous
code, `failpoints.hit_now(...)`, which can only raise or kill). `POINTS` names every point and where it is.

A test in the router's process arms a point (`arm`) to
- raise: the exception it gives, or `FAILED` (a connection reset, which the router treats as a lost
  session and retries), as if the statement there had failed;
- stall: the returned `Armed.reached` is set when the point is reached, and the code waits there until
  the test sets the event it gave (`go`), so the test drives whatever it needs in between;
- kill: end the process at once (`os._exit`, as SIGKILL would), for a router run as a subprocess.
A point fires `times` times (once by default) after letting `after` hits pass, then passes freely again;
`disarm()` (a test's teardown) forgets every point. A router started as a subprocess is armed by the
environment, read once at import: `PGMESH_FAILPOINTS="log.segment_switch=kill@1,apply.batch_sent=raise"`
(`name=raise|kill`, `@N` letting N hits pass first; nothing there can set an event, so no stall), and
only with `PGMESH_TESTING=1` beside it: without it nothing is armed and `pgmesh run` refuses to start
(`environment_refusal`), so a variable left in a production environment cannot make a router fail.

Must not: import anything of pgmesh, do I/O, or be armed outside tests.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Final

__all__ = [
    "ARMED", "ENV", "FAILED", "POINTS", "SYNCHRONOUS", "TESTING_ENV", "Armed", "arm", "disarm",
    "environment_refusal", "from_environment", "hit", "hit_now",
]

logger = logging.getLogger(__name__)

# Every point, and where it is (a point not listed here cannot be armed: a typo fails the test at once).
POINTS: Final[dict[str, str]] = {
    "apply.before_commit": "router.apply.careful.transaction: the origin's set-up sent, its COMMIT not yet"
    " (on PostgreSQL 16+ a rollback here moves the origin: router.progress.applied)",
    "apply.batch_sent": "router.apply.applier: a batch sent to the target, its result not read yet",
    "log.segment_switch": "router.stream.log.store: a switch from a full segment, the new segment file"
    " created, its header not written (not a log's first segment; synchronous: raise or kill only)",
    "join.after_snapshot": "router.ops.join: the join's snapshot and positions taken, the router"
    " released, the copy not started (the new node's stream starts from those positions)",
    "source.spilling": "router.stream.source: a batch read in the middle of a transaction that spilled"
    " (a plain one was handed out to the appliers at its first spill), its commit not read yet",
}
SYNCHRONOUS: Final = frozenset({"log.segment_switch"})  # `hit_now` points: they cannot stall
FAILED: Final = "raise"  # `arm(name, error=FAILED)`: a ConnectionResetError naming the point
ENV: Final = "PGMESH_FAILPOINTS"
TESTING_ENV: Final = "PGMESH_TESTING"  # "1" beside ENV: this process is a test's


class Armed:
    """One armed point: what it does, how often, and whether (how often) it was reached."""

    __slots__ = ("after", "error", "go", "hits", "kill", "name", "reached", "times")

    def __init__(self, name: str, *, error: BaseException | str | None, go: asyncio.Event | None,
                 kill: bool, times: int, after: int) -> None:
        self.name = name
        self.error = error
        self.go = go
        self.kill = kill
        self.times = times
        self.after = after
        self.hits = 0  # every time the point was reached while armed, fired or not
        self.reached = asyncio.Event() if go is not None else None

    def firing(self) -> bool:
        """Count a hit; whether this one fires."""
        self.hits += 1
        return self.after < self.hits <= self.after + self.times

    def exception(self) -> BaseException | None:
        if self.error is None:
            return None
        if isinstance(self.error, str):
            return ConnectionResetError(f"fail point {self.name}")
        return self.error

    async def wait_reached(self, limit: float) -> None:
        """Return once a stalled point was reached (TimeoutError after `limit` seconds)."""
        if self.reached is None:
            raise ValueError(f"fail point {self.name} does not stall")
        await asyncio.wait_for(self.reached.wait(), limit)


# The armed points by name: empty unless a test armed one (the guard every point reads first).
ARMED: dict[str, Armed] = {}


def arm(
    name: str, *, error: BaseException | str | None = None, stall: asyncio.Event | None = None,
    kill: bool = False, times: int = 1, after: int = 0,
) -> Armed:
    """Arm `name` to raise `error` (an exception, or FAILED), or to stall until `stall` is set, or to
    `kill` the process; it fires `times` times after `after` hits. Returns the armed point (its `hits`,
    and `reached` for a stall)."""
    if name not in POINTS:
        raise ValueError(f"no fail point {name!r} (known: {', '.join(sorted(POINTS))})")
    if sum((error is not None, stall is not None, kill)) != 1:
        raise ValueError("a fail point raises, stalls or kills: give exactly one of error, stall, kill")
    if stall is not None and name in SYNCHRONOUS:
        raise ValueError(f"fail point {name} is in synchronous code: it can raise or kill, not stall")
    armed = Armed(name, error=error, go=stall, kill=kill, times=times, after=after)
    ARMED[name] = armed
    return armed


def disarm(name: str | None = None) -> None:
    """Forget the point `name`, or every point."""
    if name is None:
        ARMED.clear()
    else:
        ARMED.pop(name, None)


def _fire(armed: Armed) -> BaseException | None:
    """What an armed point does that needs no waiting: kill, or the exception to raise."""
    logger.warning("fail point %s fired (hit %d)", armed.name, armed.hits)
    if armed.kill:
        os._exit(137)  # as SIGKILL: nothing flushed, nothing cleaned up
    return armed.exception()


async def hit(name: str) -> None:
    """The point `name` in asynchronous code (call it only when ARMED is not empty)."""
    armed = ARMED.get(name)
    if armed is None or not armed.firing():
        return
    exc = _fire(armed)
    if exc is not None:
        raise exc
    if armed.reached is not None and armed.go is not None:
        armed.reached.set()
        await armed.go.wait()


def hit_now(name: str) -> None:
    """The point `name` in synchronous code (call it only when ARMED is not empty): raise or kill."""
    armed = ARMED.get(name)
    if armed is not None and armed.firing() and (exc := _fire(armed)) is not None:
        raise exc


def from_environment(text: str) -> dict[str, Armed]:
    """Points armed by `PGMESH_FAILPOINTS`'s text (see the module docstring)."""
    found: dict[str, Armed] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, action = item.partition("=")
        action, _, skip = action.partition("@")
        if name not in POINTS or action not in ("raise", "kill") or not (skip or "0").isdigit():
            raise ValueError(f"{ENV}: cannot read {item!r} (name=raise|kill[@N])")
        found[name] = Armed(name, error=FAILED if action == "raise" else None, go=None,
                            kill=action == "kill", times=1, after=int(skip or 0))
    return found


def environment_refusal() -> str | None:
    """Why `pgmesh run` must not start here: fail points in its environment outside a test; else None."""
    if os.environ.get(ENV, "").strip() and os.environ.get(TESTING_ENV) != "1":
        return (f"{ENV} is set ({os.environ[ENV].strip()!r}): fail points make the router fail on purpose,"
                f" for tests only; unset it (a test's router also sets {TESTING_ENV}=1)")
    return None


if os.environ.get(TESTING_ENV) == "1":
    ARMED.update(from_environment(os.environ.get(ENV, "")))
