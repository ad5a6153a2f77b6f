"""Per-link durable positions, and the position each source's slot may be confirmed to.

A link is (source -> target). The fan-out tells a link's tracker what it handed to the link's queue
(`enqueued`) and what the source stream has passed in total (`seen`, echoes and filtered transactions
included); the target's replication origin tells what is flushed there (`flushed`). A link's durable
position is `flushed` while anything handed to it is not yet flushed (or while it is detached and must
re-read), and the source's whole passed position once everything handed to it is flushed. A source's
slot is confirmed to the minimum durable position over its links: never past what some target has not
durably applied, unless the router's log of the source (router.stream.log) holds it durably: a link whose
flushed position is past the log's `since`, into a target the log was started for (not a node that joined
since), lacks nothing the log does not hold, so it counts as durable up to the log's durable position. A
link reading from the log (`log_from` set) takes nothing from memory until it catches up. Pure
bookkeeping: no I/O, no clock.

Synchronous replication (docs/synchronous.md): a source with `synchronous` = k > 0 reports as flushed
(`flush_position`) only what k of its targets have durably applied themselves (the k-th highest of
their own synced positions: the router's log never counts toward k), and never past `confirmable()`
(invariant 1 as ever: every link, the log counted).
"""

from __future__ import annotations

from typing import Final

__all__ = ["BARRIER_POSITION_SQL", "LinkProgress", "SourceProgress"]

# A node's position for a barrier: a logical message's (its prefix is for nobody), not
# `pg_current_wal_lsn()`. Every commit before it is before it in the node's stream, and the router passes
# its transaction as seen (router.stream.fanout: nothing for a target) as soon as the stream brings it, so
# a link whose source is idle reaches it at once, where the WAL end is known only when the server next
# says where its WAL ends. Transactional: its commit flushes the WAL (a non-transactional one waits, on
# 15 and 16, for some other commit to flush it before the walsender may send it). Run it in a session of
# its own, autocommit: it commits at once.
BARRIER_PREFIX: Final = "pgmesh.barrier"
BARRIER_POSITION_SQL: Final = (
    f"SELECT (pg_catalog.pg_logical_emit_message(true, '{BARRIER_PREFIX}', '') - '0/0')::bigint"
)


class LinkProgress:
    """What one link has been given and what its target has made durable."""

    __slots__ = ("applied", "enqueued", "flushed", "has_until", "log_from", "missed_until", "receiving",
                 "source", "target")

    def __init__(self, source: str, target: str, flushed: int = 0) -> None:
        self.source = source
        self.target = target
        self.flushed = flushed  # pg_replication_origin_progress(origin, true) on the target
        self.applied = flushed  # end LSN of the last transaction committed there (maybe not flushed yet)
        self.enqueued = flushed  # end LSN of the last transaction handed to the link's queue
        # Set while the link lacks transactions the source has already passed (it was detached):
        # the source position it must get back to by re-reading. None when it has everything.
        self.missed_until: int | None = None
        self.receiving = True  # whether the fan-out hands it transactions
        # Set while it reads the source's log (router.stream.log.store) instead of the fan-out's hand-outs:
        # the
        # position after which the log gives it transactions. None: it takes them from memory.
        self.log_from: int | None = None
        # What it was given from a log that stopped growing, before it was detached to re-read the rest
        # from the source: a re-read starts after this (0: nothing)
        self.has_until = 0

    @property
    def detached(self) -> bool:
        return not self.receiving

    def on_flushed(self, lsn: int) -> None:
        self.flushed = max(self.flushed, lsn)
        self.applied = max(self.applied, self.flushed)

    def on_applied(self, lsn: int) -> None:
        self.applied = max(self.applied, lsn)

    def restart_at(self, lsn: int) -> bool:
        """The target's own word on (re)connect: its origin is at `lsn`.

        Lower than what we believed applied means the target lost commits it had not flushed (a crash
        with synchronous_commit off): everything handed to the link since must be re-read. Returns
        True when that happened (the caller then drops what it still holds for the link).
        """
        if lsn >= self.applied:
            self.applied = lsn
            return False
        self.applied = lsn
        self.flushed = min(self.flushed, lsn)
        self.log_from = None
        self.has_until = 0
        self.receiving = False
        self.missed_until = max(self.missed_until or 0, self.enqueued)
        return True

    def wants(self, end_lsn: int) -> bool:
        """Whether a transaction ending at `end_lsn` still has to be handed to this link."""
        return self.receiving and self.log_from is None and end_lsn > self.enqueued

    def detach(self, seen: int) -> None:
        """Stop handing it transactions: it will re-read everything after `applied`."""
        self.receiving = False
        self.missed_until = max(self.missed_until or 0, seen)

    def reattach(self, seen: int) -> None:
        """The source re-reads from at most `applied`: hand it transactions again from there.

        It missed everything the source passed while it was detached: it is whole again only once the
        re-read reaches `seen`, the source's position now.
        """
        self.receiving = True
        self.enqueued = max(self.applied, self.has_until)
        self.has_until = 0
        self.missed_until = max(self.missed_until or 0, seen)
        if self.enqueued >= self.missed_until:
            self.missed_until = None

    def passed(self, end_lsn: int) -> None:
        """The fan-out has handled the source up to `end_lsn` (for a re-reading link: caught up?)."""
        if self.receiving and self.missed_until is not None and end_lsn >= self.missed_until:
            self.missed_until = None

    def read_log(self, after: int) -> None:
        """Take transactions from the source's log after `after` (it has everything up to there)."""
        self.receiving = True
        self.missed_until = None
        self.has_until = 0
        self.log_from = after
        self.enqueued = after

    def caught_up(self, end: int) -> None:
        """It read the log to its end (`end`): from now on the fan-out hands it transactions."""
        self.log_from = None
        self.enqueued = max(self.enqueued, end)

    def log_ended(self, end: int, seen: int) -> None:
        """It read to the end (`end`) of a log that no longer grows: the rest comes from re-reading the
        source (detached until then)."""
        self.log_from = None
        self.has_until = end
        self.detach(seen)

    def resume_position(self) -> int:
        """Where a re-read for it must start: after what it applied or was given from the log."""
        return max(self.applied, self.has_until)

    def synced(self, seen: int) -> int:
        """The source position up to which the target has flushed everything it needs (`seen`: the
        source's position passed): what a barrier waits for, whatever the log holds."""
        if self.missed_until is not None or self.log_from is not None or self.enqueued > self.flushed:
            return self.flushed
        return max(self.flushed, seen)

    def durable(self, seen: int, log_since: int | None = None, log_durable: int = 0) -> int:
        """Position the source may be confirmed to on this link's account (with the source's log, if
        it has one: continuous after `log_since`, on disk up to `log_durable`)."""
        own = self.synced(seen)
        if log_since is not None and self.flushed >= log_since and log_durable > own:
            return log_durable
        return own


class SourceProgress:
    """All links out of one source, and its tombstone recorder (router.apply.recorder): a link from
    the source to itself that takes only the source's own transactions with deletes. The source is
    confirmed only past what the recorder has durably recorded, as past what every link has applied."""

    __slots__ = ("_all", "links", "log_durable", "log_since", "log_targets", "recorder", "seen", "source",
                 "synchronous")

    def __init__(self, source: str, links: list[LinkProgress], recorder: LinkProgress | None = None,
                 synchronous: int = 0) -> None:
        self.source = source
        self.synchronous = synchronous  # k: how many targets must have applied a commit (0: asynchronous)
        self.links = links
        self.recorder = recorder
        # what the source's confirmation waits for (made once: on_seen runs for every transaction)
        self._all = links if recorder is None else [*links, recorder]
        self.seen = min((link.flushed for link in self._all), default=0)
        self.log_since: int | None = None  # the source's log (router.stream.log.store): set by its fan-out
        self.log_durable = 0
        self.log_targets: frozenset[str] | None = None  # whom the log holds them for (None: everyone)

    def start_position(self, log_end: int | None = None) -> int:
        """Where to (re)start reading the source: the least durable link (or the recorder). A link that
        reads the log (`log_from` set) needs the source only after the log's end `log_end`."""
        return min(
            (max(link.flushed, log_end) if link.log_from is not None and log_end is not None else link.flushed
             for link in self._all),
            default=0,
        )

    def confirmable(self) -> int:
        since, durable, targets = self.log_since, self.log_durable, self.log_targets
        out = min((link.durable(self.seen, since if targets is None or link.target in targets else None,
                                durable) for link in self.links), default=self.seen)
        if self.recorder is not None:  # the recorder never reads the log: its own position only
            out = min(out, self.recorder.durable(self.seen))
        return out

    def applied_by(self, k: int) -> int:
        """The source position up to which at least `k` targets have flushed everything themselves (the
        k-th highest of their synced positions; the log not counted). 0 when fewer than `k` links."""
        if k <= 0:
            return self.seen
        own = sorted((link.synced(self.seen) for link in self.links), reverse=True)
        return own[k - 1] if k <= len(own) else 0

    def flush_position(self) -> int:
        """The position the source's slot may be reported flushed to: `confirmable()`, and with
        `synchronous` = k > 0 never past what k targets have applied themselves (`applied_by`)."""
        out = self.confirmable()
        return min(out, self.applied_by(self.synchronous)) if self.synchronous > 0 else out

    def synced(self) -> int:
        """The source position up to which every target has flushed everything (the log not counted)."""
        return min((link.synced(self.seen) for link in self.links), default=self.seen)

    def logging(self) -> list[LinkProgress]:
        """The links reading the source's log now."""
        return [link for link in self.links if link.log_from is not None]

    def on_seen(self, end_lsn: int) -> None:
        if end_lsn > self.seen:
            self.seen = end_lsn
        for link in self._all:
            if link.missed_until is not None:  # (once per transaction: no call for a link that is whole)
                link.passed(end_lsn)

    def rewind_position(self) -> int | None:
        """Where to re-read from so that every detached link gets what it missed (None: no need)."""
        detached = [link.applied for link in self.links if link.detached]
        return min(detached) if detached else None
