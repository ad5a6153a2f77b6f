"""What a source node had applied from each other node: the vector the fan-out stamps on its transactions.

A node's logical stream carries, in the node's commit order, the transactions the router applied there
from other nodes (echoes): `Transaction.origin` names the replication origin they were applied under
(`Config.origin_name(node)`, `pgmesh_<cluster>_<node>`; a streamed transaction applied before its commit
may carry `Config.early_origin_name(node)`, `pgmeshearly_<cluster>_<node>`, the origin of its first
change), and their `commit_time` is the origin node's commit time (the applier sets it with
`pg_replication_origin_xact_setup`; logical decoding reports a commit's origin timestamp in its place).
`SeenVersions.note` takes each echo in stream order and keeps, per node, the newest commit time applied
here so far; `snapshot` is that vector as (node, µs) pairs sorted by node: one tuple object, shared by
every transaction stamped until the next echo changes it. A transaction of the source stamped with it
committed after every echo noted before it (the stream is in commit order), so the node had applied
those versions, or decided against them, when it committed (router.conflicts.causality uses it).

A node whose stream leaves echoes out (pgoutput's `origin 'none'`, PostgreSQL 16+) never shows them:
there each applier ends a batch with a non-transactional message of its own, without the origin
(APPLIED_PREFIX, router.apply.link.LinkSession.applied_note), which comes in the stream after the
batch's commits and before any later commit of the node (`note_applied`). It knows per batch, not per
transaction: less, never more.

Known less, never more: `()` or a missing node means "not known", and a version not known to be seen
counts as concurrent (a conflict decided by the resolver, as before). So the vector starts empty when
the router starts (it is not persisted); a source rewound to re-read from an older position gets the
vector as it stood there (`rewind`: kept per echo from the confirmed position on, at most
`HISTORY_MAX` of them; further back it restarts empty). Echoes of the node's own transactions cannot
happen (no link goes from a node to itself), and origins of other replicators are not pgmesh nodes:
neither enters the vector; transactions from before pgmesh carry no origin.

Pure: no I/O, no clock. Must not decide anything (router.conflicts.causality does, for the target).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
from typing import Final

from protocol.transactions import Transaction

__all__ = ["APPLIED_PREFIX", "HISTORY_MAX", "Seen", "SeenVersions", "applied_content", "origin_nodes"]

Seen = tuple[tuple[str, int], ...]

HISTORY_MAX: Final = 65_536  # changes kept for rewinds (one per echo that changed the vector): a few MB

# A non-transactional logical message an applier emits on its target after a batch, without the
# origin, where the target's own stream leaves echoes out (origin 'none', PostgreSQL 16+): "<source
# node>|<newest commit time of it applied so far, µs>". In the target's stream it stands for the echoes
# of that batch (`SeenVersions.note_applied`).
APPLIED_PREFIX: Final = "pgmesh.applied"


def applied_content(node: str, commit_time: int) -> str:
    """The content of an APPLIED_PREFIX message."""
    return f"{node}|{commit_time}"


def origin_nodes(nodes: Iterable[str], origin_name: str, early_origin_name: str) -> dict[str, str]:
    """origin name -> node, for `nodes`, from the names `Config.origin_name("")` and
    `Config.early_origin_name("")` give (each a prefix the node name completes)."""
    out: dict[str, str] = {}
    for node in nodes:
        out[origin_name + node] = node
        out[early_origin_name + node] = node
    return out


class SeenVersions:
    """The per-node newest commit times applied on one source node, as its stream tells them."""

    __slots__ = ("_dirty", "_forgotten", "_history", "_latest", "_nodes", "_snapshot")

    def __init__(self, origins: Mapping[str, str], *, own: str | None = None) -> None:
        """`origins`: replication origin name -> node name (`origin_nodes`); origins of `own` (the
        source node itself) are left out."""
        self._nodes = {origin: node for origin, node in origins.items() if node != own}
        self._latest: dict[str, int] = {}
        self._snapshot: Seen = ()
        self._dirty = False  # `_latest` changed since `_snapshot` was made
        # (commit LSN of an echo that changed the vector, its node, the node's time before it), oldest
        # first: a rewind undoes them. Undone, an echo counts again when it is read again.
        self._history: deque[tuple[int, str, int | None]] = deque()
        self._forgotten = -1  # the newest commit LSN of an echo no longer in `_history`

    @property
    def snapshot(self) -> Seen:
        """The vector, sorted by node: one tuple object until an echo changes it (made when asked for:
        a stream of echoes alone never needs it)."""
        if self._dirty:
            self._snapshot = tuple(sorted(self._latest.items()))
            self._dirty = False
        return self._snapshot

    def note(self, echo: Transaction, confirmed: int = 0) -> None:
        """An echo handed out by the source, in stream order. `confirmed`: the source's confirmed
        position (no rewind goes below it: what came before it is forgotten but the last change)."""
        node = self._nodes.get(echo.origin or "")
        if node is not None:
            self._note(node, echo.commit_time, echo.commit_lsn, confirmed)

    def note_applied(self, lsn: int, content: bytes, confirmed: int = 0) -> None:
        """An APPLIED_PREFIX message at `lsn` in the source's stream, in stream order: every transaction
        it names was committed on the source before it, as if their echoes had come. A malformed one or
        one naming no other node is passed over (it can only make the vector know less)."""
        node, _, time = content.decode(errors="replace").rpartition("|")
        if node in self._nodes.values() and time.isdigit():
            self._note(node, int(time), lsn, confirmed)

    def _note(self, node: str, time: int, lsn: int, confirmed: int) -> None:
        latest = self._latest
        before = latest.get(node)
        if before is not None and time <= before:
            return  # a commit time out of commit order (or one seen before): nothing newer
        latest[node] = time
        self._dirty = True
        history = self._history
        history.append((lsn, node, before))
        while len(history) > 1 and history[1][0] < confirmed:
            self._forgotten = history.popleft()[0]
        if len(history) > HISTORY_MAX:
            self._forgotten = history.popleft()[0]

    def rewind(self, lsn: int) -> None:
        """The source hands everything out again from `lsn` (transactions whose commit LSN is at or
        after it): back to the vector of the echoes before it (empty when they are not known)."""
        history = self._history
        latest = self._latest
        if lsn <= self._forgotten:  # an echo at or after it is forgotten: not known
            history.clear()
            latest.clear()
            self._forgotten = -1
        while history and history[-1][0] >= lsn:
            _, node, before = history.pop()
            if before is None:
                del latest[node]
            else:
                latest[node] = before
        self._dirty = True
