"""The logical message a DDL command travels in: what the capture trigger writes and the applier reads.

The capture trigger (`router.ddl.capture`) writes one transactional logical message per DDL statement,
with prefix `pgmesh.ddl` (`DDL_PREFIX`, named low in router.stream.items: the fan-out hands such a
transaction on) and as content the JSON of a `DdlCommand`: the statement's text,
the session's search_path, role and command tag. Decoded at its exact place in the source's commit
order, it is replayed there by the applier (`router.apply.applier`). Owns that format, telling whether a
transaction carries such a message (`has_ddl`: a lookup in the prefixes the transaction carries, also
when part of it was spilled to disk), decoding it (`ddl_command`) and its one-line rendering for errors
(`describe_command`).

Must not: run or apply DDL, talk to a node, or know how the message is written (that is the capture's
SQL).
"""

from __future__ import annotations

import json

import msgspec

from protocol.messages import Message
from protocol.transactions import Transaction
from router.stream.items import DDL_PREFIX

__all__ = ["DDL_PREFIX", "DdlCommand", "ddl_command", "describe_command", "has_ddl"]


class DdlCommand(msgspec.Struct, frozen=True):
    """What the capture trigger records of one command (the message's JSON content)."""

    sql: str
    search_path: str
    role: str
    tag: str


def has_ddl(txn: Transaction) -> bool:
    """Whether `txn` carries a DDL command, in memory or in its spilled part (`Transaction.prefixes`)."""
    return DDL_PREFIX in txn.prefixes


def ddl_command(message: Message) -> DdlCommand:
    return msgspec.json.decode(message.content, type=DdlCommand)


def describe_command(command: DdlCommand, limit: int = 200) -> str:
    text = " ".join(command.sql.split())
    return json.dumps(text if len(text) <= limit else text[:limit] + "...")

