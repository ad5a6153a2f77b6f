"""What a source asks each server for (`router.stream.items.negotiate`), without a server.

The highest proto_version both sides speak (15: 2, 16+: 4), streaming 'parallel' where 4 allows it,
`origin 'none'` on 16+ only, and binary values only where every target runs the source's major version
(`binary_formats_match`). Then a source fed proto_version 4 frames decodes them as it was told at the
start of the stream.
"""

from __future__ import annotations

import pytest

from protocol.messages import Insert
from protocol.transactions import Transaction
from router.stream.items import (
    SourceOptions,
    StreamSettings,
    binary_formats_match,
    highest_proto_version,
    negotiate,
)
from tests.unit.protocol.captured import V4_CAPTURES, assembled
from tests.unit.router.stream.test_source_frames import feed_all, frames_of, new_source

PG15, PG16, PG17, PG18 = 150020, 160010, 170006, 180006


@pytest.mark.parametrize(("version", "proto"), [(PG15, 2), (PG16, 4), (PG17, 4), (PG18, 4)])
def test_highest_proto_version(version: int, proto: int) -> None:
    assert highest_proto_version(version) == proto


def test_binary_only_when_every_target_runs_the_source_major() -> None:
    assert binary_formats_match(PG18, [180002, 180006])
    assert binary_formats_match(PG15, [150003])
    assert binary_formats_match(PG15, [])  # no targets named: nothing to match
    assert not binary_formats_match(PG18, [PG15])
    assert not binary_formats_match(PG15, [PG18])
    assert not binary_formats_match(PG18, [180001, PG17])  # one target of another major is enough


def test_negotiate_on_each_version() -> None:
    options = SourceOptions(origin_none=True)
    assert negotiate(options, PG15) == StreamSettings(2, "on", True, True, False)
    assert negotiate(options, PG18) == StreamSettings(4, "parallel", True, True, True)
    assert negotiate(options, PG18).abort_info and not negotiate(options, PG15).abort_info
    assert negotiate(SourceOptions(parallel_streaming=False), PG16).streaming == "on"
    assert negotiate(SourceOptions(streaming=False), PG18).streaming == "off"
    assert negotiate(SourceOptions(proto_version=1), PG18) == StreamSettings(1, "off", True, True, False)
    assert negotiate(SourceOptions(proto_version=2), PG18).streaming == "on"  # as asked: no 'parallel' in 2


@pytest.mark.parametrize(
    ("source", "targets", "binary"),
    [(PG15, (PG18,), False), (PG18, (PG15,), False), (PG18, (180002,), True), (PG15, (150003, 150020), True)],
)
def test_negotiate_binary_by_the_targets(source: int, targets: tuple[int, ...], binary: bool) -> None:
    assert negotiate(SourceOptions(binary=True, target_versions=targets), source).binary is binary
    assert not negotiate(SourceOptions(binary=False, target_versions=targets), source).binary  # never unasked


def test_option_list() -> None:
    settings = StreamSettings(4, "parallel", False, True, True)
    assert settings.option_list(["p1", 'we"ird']) == (
        """(proto_version '4', publication_names '"p1","we""ird"', origin 'none', messages 'true',"""
        " streaming 'parallel')"
    )
    assert StreamSettings(2, "on", True, False, False).option_list(["p"]) == (
        """(proto_version '2', publication_names '"p"', binary 'true', streaming 'true')"""
    )
    assert StreamSettings(1, "off", False, False, False).option_list(["p"]) == (
        """(proto_version '1', publication_names '"p"')"""
    )


@pytest.mark.parametrize("capture", V4_CAPTURES)
def test_a_source_decodes_proto_4_as_the_stream_was_started(capture: str) -> None:
    source = new_source()
    source.on_stream_start(negotiate(SourceOptions(parallel_streaming=capture.endswith("parallel")), PG18))
    source.restart()  # a reconnect keeps what the stream was started with
    out = feed_all(source, frames_of(capture))
    assert out == list(assembled(capture))
    txns = [t for t in out if isinstance(t, Transaction)]
    assert [sum(isinstance(c, Insert) for c in t.changes) for t in txns] == [1500, 1010]
