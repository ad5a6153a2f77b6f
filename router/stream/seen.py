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

__all__ = ["HISTORY_MAX", "Seen", "SeenVersions", "origin_nodes"]

Seen = tuple[tuple[str, int], ...]

HISTORY_MAX: Final = 65_536  # vectors kept for rewinds (one per echo that changed it): a few MB at most


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
        if node is None:
            return
        time = echo.commit_time
        latest = self._latest
        before = latest.get(node)
        if before is not None and time <= before:
            return  # a commit time out of commit order (or one seen before): nothing newer
        latest[node] = time
        self._dirty = True
        history = self._history
        history.append((echo.commit_lsn, node, before))
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
