"""What `pgmesh status` and the admin surface report of a running router: links, sources, warnings.

Plain data (msgspec structs), built by router.service.supervisor.Router.status and encoded as JSON by the
admin surface and the CLI. Owns nothing else.
"""

from __future__ import annotations

import msgspec

from router.cluster.clocks import NodeClock

__all__ = ["LinkStatus", "LogStatus", "RecorderStatus", "RetainedWal", "SourceStatus", "StatusReport",
           "SynchronousStatus", "VerifyStatus"]


class LinkStatus(msgspec.Struct, frozen=True):
    source: str
    target: str
    state: str
    applied_lsn: str
    flushed_lsn: str
    last_commit_time: str | None
    lag_bytes: int | None  # None: unknown (no position to count from; `pgmesh status` without a router)
    lag_seconds: float | None  # None: unknown (`pgmesh status` without a router)
    queued: int
    applied_transactions: int
    applied_rows: int
    retries: int
    last_error: str | None
    # the source position up to which the target has flushed everything it needs (a barrier's wait;
    # the slot may be confirmed further on the router log's account)
    synced_lsn: str = "0/0"


class RetainedWal(msgspec.Struct, frozen=True):
    """What a node's pgmesh slot keeps of its WAL (router.service.monitor reads it every status tick)."""

    bytes: int  # from the slot's restart_lsn to the node's WAL end
    wal_status: str | None  # PostgreSQL's: reserved, extended, unreserved (about to lose WAL), lost
    safe_wal_size: int | None  # bytes that can still be written before the slot loses WAL; None: no limit


class LogStatus(msgspec.Struct, frozen=True):
    """The router's log of a source (router.stream.log.store, docs/scale.md)."""

    bytes: int  # on disk
    cap_bytes: int
    state: str  # "appending"; "full" (at its cap: links that fall behind re-read the source, WAL held)
    first_lsn: str  # its oldest transaction's end ("0/0": empty)
    end_lsn: str
    durable_lsn: str  # the source position it holds on disk: the slot may be confirmed that far
    readers: list[str]  # the targets reading it now (they fell behind)


class SynchronousStatus(msgspec.Struct, frozen=True):
    """A node with synchronous = k > 0 (docs/synchronous.md): its commits wait for k targets."""

    k: int
    applying: list[str]  # its targets applying now (the link running, the node answering)
    satisfied: bool  # at least k of them: else every commit on the node waits
    flushed_lsn: str  # what the router reports flushed to the node (k targets applied it, the slot safe)


class SourceStatus(msgspec.Struct, frozen=True):
    node: str
    state: str
    received_lsn: str
    confirmed_lsn: str
    transactions: int
    echoes: int  # applied transactions that came back (15: decoded, then dropped)
    applied_notes: int  # 16+: pgmesh.applied messages in their place (echoes are never sent)
    reconnects: int
    last_error: str | None
    retained: RetainedWal | None = None  # what pgmesh's slot on the node keeps of its WAL, as last read
    log: LogStatus | None = None  # the router's log of this source (None: [log] enabled = false)
    synchronous: SynchronousStatus | None = None  # None: asynchronous (synchronous = 0)


class RecorderStatus(msgspec.Struct, frozen=True):
    """One node's tombstone recorder (router.apply.recorder)."""

    node: str
    recorded_lsn: str  # durably recorded up to here
    tombstones: int  # written since the router started
    late_decisions: int
    last_error: str | None


class LeaseNode(msgspec.Struct, frozen=True):
    """A node's lease row as this router last read or wrote it (router.service.lease)."""

    holder: str | None
    term: int
    expires_in_s: float  # by the node's clock; negative: expired


class LeaseStatus(msgspec.Struct, frozen=True):
    """[ha]: this router's role (active or standby), its name in the lease, the term it holds (0: none),
    for how long its lease is valid, why it is what it is, and each node's row (docs/ha.md)."""

    role: str
    holder: str
    term: int
    valid_for_s: float
    why: str
    nodes: dict[str, LeaseNode]


class VerifyStatus(msgspec.Struct, frozen=True):
    """Continuous verification ([verify], router.service.verify): how often, the last full pass (its end as
    ISO time, None before the first, and how long it took), the tables it compared, and the rows each node
    holds apart from the others per table as last found (only tables that differ)."""

    interval_s: float
    passes: int  # full passes since the router started
    last_pass_end: str | None
    last_pass_seconds: float | None
    tables: int
    divergent: dict[str, dict[str, int]]  # table -> node -> rows
    divergent_keys: dict[str, int] = msgspec.field(default_factory=dict)  # table -> keys (rows) that differ
    first_keys: dict[str, list[str]] = msgspec.field(default_factory=dict)  # table -> its first keys
    skipped: list[str] = msgspec.field(default_factory=list)  # tables not compared, with why
    reading: str | None = None  # the table a pass reads now (None: between passes)
    last_error: str | None = None  # why the last pass stopped short
    repaired: dict[str, int] = msgspec.field(default_factory=dict)  # table -> keys auto_repair fixed

    def describe(self) -> str:
        """`pgmesh status`'s line."""
        every = f"{self.interval_s / 60:g} min" if self.interval_s >= 60 else f"{self.interval_s:g} s"
        text = f"verify: every {every}; " + (
            f"last full pass ended {self.last_pass_end} ({self.last_pass_seconds:.1f} s, {self.tables}"
            " table(s))" if self.last_pass_end is not None else "no full pass yet")
        if self.divergent:
            tables = "; ".join(
                f"{t} {self.divergent_keys.get(t, 0)} key(s), rows apart: "
                + ", ".join(f"{n} {c}" for n, c in sorted(nodes.items()))
                + (f", first: {', '.join(self.first_keys[t])}" if self.first_keys.get(t) else "")
                for t, nodes in sorted(self.divergent.items()))
            text += f": DIVERGENT ROWS: {tables} (`pgmesh compare` shows them, `pgmesh repair` fixes them)"
        else:
            text += ": 0 divergent rows"
        if self.repaired:
            fixed = ", ".join(f"{t} {n} key(s)" for t, n in self.repaired.items())
            text += f"; repaired by auto_repair: {fixed}"
        if self.reading is not None:
            text += f"; now reading {self.reading}"
        if self.skipped:
            text += f"; not compared: {'; '.join(self.skipped)}"
        return text + (f"; last pass stopped short: {self.last_error}" if self.last_error else "")


class StatusReport(msgspec.Struct, frozen=True):
    cluster: str
    running: bool
    links: list[LinkStatus]
    sources: list[SourceStatus]
    divergence: list[str] = msgspec.field(default_factory=list)  # allow_divergence: the settings it accepts
    schema_drift: list[str] = msgspec.field(default_factory=list)  # router.ddl.drift: tables that differ
    clocks: list[NodeClock] = msgspec.field(default_factory=list)  # router.cluster.clocks: offsets
    recorders: list[RecorderStatus] = msgspec.field(default_factory=list)  # router.apply.recorder
    # the topology: nodes that receive only (router.cluster.receive); the others send to every node
    receive_only: list[str] = msgspec.field(default_factory=list)
    lease: LeaseStatus | None = None  # [ha] (router.service.lease)
    # receive-only nodes that hold part of the data (router.cluster.partial): what they hold
    partial: dict[str, str] = msgspec.field(default_factory=dict)
    # node -> table -> inserts lost to key collisions there since the router started (router.apply.link)
    lost_inserts: dict[str, dict[str, int]] = msgspec.field(default_factory=dict)
    verify: VerifyStatus | None = None  # [verify] (router.service.verify); None: off, or a standby
    # node -> table -> changes pending in pgmesh.quarantine there (router.apply.quarantine), as the links
    # into it last read or wrote them
    quarantined: dict[str, dict[str, int]] = msgspec.field(default_factory=dict)
