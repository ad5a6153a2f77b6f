"""Sequential or concurrent: whether a remote change was made on top of the local row's version. Pure.

A remote change from node S meets a local row whose version `(commit time, node N)` came from another
node than S. If S had already applied N's version (or a newer one of N's) when it committed the change,
the two writes were sequential, not concurrent: S wrote on top of that version, and the meeting is no
conflict. What S had applied travels with the change: `Transaction.seen`, the newest commit time per node
that S had applied when the transaction committed there (set by the router's fan-out from S's own
stream, router.stream.seen).

Why applying the remote change then decides exactly as `last_update_wins` would (docs/conflicts.md
"Only concurrent writes are conflicts"): the applier never applies a version on S before S's clock has
passed its commit time (the future-commit guard), and S committed its change after it applied N's
version, so the change's commit time is later than every time in `seen`, hence later than the local
row's: `last_update_wins` applies it too. `sequential` also checks that directly when given the remote
commit time (a skewed clock, or equal microseconds, then falls back to the resolver). So the label
changes which meetings are recorded as conflicts, never what any node ends with.

No I/O here; the target's SQL may evaluate the same predicate.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["sequential"]


def sequential(
    local_node: str,
    local_commit_time: int | None,
    seen: Sequence[tuple[str, int]],
    *,
    remote_commit_time: int | None = None,
) -> bool:
    """True when the remote change's source had already applied a version of `local_node` at least as
    new as the local row's (`local_commit_time <= seen[local_node]`, times in µs since 2000-01-01):
    the remote change was written on top of it, and applying it is no conflict.

    `seen` is the remote transaction's `Transaction.seen` ((node, µs) pairs; `()`: not known). With
    `remote_commit_time`, also only when that is later than the local row's, so that the answer is one
    `last_update_wins` agrees with whatever the clocks did (docs/conflicts.md). An unknown local commit
    time (frozen, or from before pgmesh) is never judged sequential here: the resolver's rule for it
    already decides. False when nothing is known: the meeting is then a conflict, as before.
    """
    if local_commit_time is None:
        return False
    if remote_commit_time is not None and remote_commit_time <= local_commit_time:
        return False
    for node, time in seen:
        if node == local_node:
            return local_commit_time <= time
    return False
