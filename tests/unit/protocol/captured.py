"""Loading the captured streams in tests/unit/protocol/data/ (written by tests/unit/protocol/capture.py)."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

from protocol.lsn import parse_lsn
from protocol.messages import Message, PgOutputMessage
from protocol.pgoutput import Decoder
from protocol.transactions import Transaction, TransactionAssembler

DATA = Path(__file__).parent / "data"
CAPTURES = ("text_v1", "binary_v1", "text_v2_stream", "binary_v2_stream")  # PostgreSQL 15, whole scenario
# PostgreSQL 18, proto_version 4, the streamed transactions only: streaming 'parallel' and 'on'
V4_CAPTURES = ("text_v4_parallel", "text_v4_on")


@dataclass(frozen=True)
class Frame:
    wal_start: int
    payload: bytes


@dataclass(frozen=True)
class Capture:
    name: str
    server_version: str
    proto_version: int
    binary: bool
    streaming: bool
    frames: tuple[Frame, ...]
    abort_info: bool = False  # streaming 'parallel': Stream Abort carries the abort's LSN and time


@functools.cache
def load(name: str) -> Capture:
    doc = json.loads((DATA / f"{name}.json").read_text())
    frames = tuple(Frame(parse_lsn(f["wal_start"]), bytes.fromhex(f["payload"])) for f in doc["frames"])
    opts = doc["options"]
    return Capture(
        name, doc["server_version"], opts["proto_version"], opts["binary"], opts["streaming"], frames,
        opts.get("streaming_mode") == "parallel",
    )


@functools.cache
def messages(name: str) -> tuple[PgOutputMessage, ...]:
    capture = load(name)
    decoder = Decoder(abort_info=capture.abort_info)
    return tuple(decoder.decode(f.payload, f.wal_start) for f in capture.frames)


@functools.cache
def assembled(name: str) -> tuple[Transaction | Message, ...]:
    assembler = TransactionAssembler()
    out: list[Transaction | Message] = []
    for frame, message in zip(load(name).frames, messages(name), strict=True):
        done = assembler.feed(message, frame.wal_start, len(frame.payload))
        if done is not None:
            assert isinstance(done, (Transaction, Message))  # no bound: nothing spills
            out.append(done)
    assert assembler.idle
    return tuple(out)
