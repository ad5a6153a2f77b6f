"""The `pgmesh` command line: parses arguments and calls into the router. No logic lives here."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from collections.abc import Coroutine, Sequence
from typing import Any

from router.errors import PgmeshError

__all__ = ["main"]

logger = logging.getLogger(__name__)


def _run(coro: Coroutine[Any, Any, int]) -> int:
    """Run a coroutine on uvloop (the router's event loop), falling back to asyncio's own."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a runtime dependency
        return asyncio.run(coro)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(coro)


def _cmd_demo(args: argparse.Namespace) -> int:
    from router.ops.demo import run_demo

    return _run(run_demo(seconds=args.seconds, keep=args.keep))


def _config(args: argparse.Namespace) -> Any:
    from router.config.model import load_config

    return load_config(args.config)


def _cmd_init(args: argparse.Namespace) -> int:
    if args.node and not args.print_sql:
        print("pgmesh init: --node goes with --print-sql (init itself installs every node)", file=sys.stderr)
        return 2
    if args.print_sql:
        from router.cluster.script import print_sql

        async def script() -> int:
            sys.stdout.write(await print_sql(_config(args), role=args.role or "", node=args.node or ""))
            return 0

        return _run(script())
    if args.check:
        from router.cluster.grants import check_run_role

        async def check() -> int:
            report = await check_run_role(_config(args))
            print(report.render())
            return 0 if report.ok else 1

        return _run(check())
    from router.ops.control import cmd_init

    return _run(cmd_init(_config(args)))


def _cmd_run(args: argparse.Namespace) -> int:
    from router.ops.control import cmd_run

    return _run(cmd_run(_config(args), reload=lambda: _config(args)))


def _cmd_status(args: argparse.Namespace) -> int:
    from router.ops.control import cmd_status

    return _run(cmd_status(_config(args), as_json=args.json, watch=args.watch, count=args.count))


def _cmd_pause(args: argparse.Namespace) -> int:
    from router.ops.control import cmd_pause

    return _run(cmd_pause(_config(args), args.target, source=args.source))


def _cmd_resume(args: argparse.Namespace) -> int:
    from router.ops.control import cmd_resume

    return _run(cmd_resume(_config(args), args.target, source=args.source))


def _cmd_skip(args: argparse.Namespace) -> int:
    from router.ops.skip import cmd_skip

    return _run(cmd_skip(_config(args), args.source, args.target, args.lsn))


def _cmd_sequences(args: argparse.Namespace) -> int:
    from router.ops.control import cmd_sequences

    return _run(
        cmd_sequences(
            _config(args),
            args.action,
            mode=getattr(args, "mode", None),
            tables=getattr(args, "tables", ()),
            as_json=getattr(args, "json", False),
        )
    )


def _cmd_conflicts(args: argparse.Namespace) -> int:
    from router.ops.control import cmd_conflicts

    return _run(cmd_conflicts(_config(args), since=args.since, as_json=args.json, limit=args.limit))


def _cmd_quarantine(args: argparse.Namespace) -> int:
    from router.ops.quarantine import cmd_quarantine

    return _run(cmd_quarantine(_config(args), args.action, node=args.node, ids=args.id or (),
                               table=args.table, key=args.key, every=args.all, as_json=args.json))


def _cmd_ddl(args: argparse.Namespace) -> int:
    from router.ops.ddl import cmd_ddl

    return _run(cmd_ddl(_config(args), args.sql, node=args.node, wait=args.wait, limit=args.timeout))


def _cmd_compare(args: argparse.Namespace) -> int:
    from router.ops.compare.job import cmd_compare

    return _run(cmd_compare(_config(args), args.tables, as_json=args.json, limit=args.timeout))


def _cmd_push(args: argparse.Namespace) -> int:
    from router.cluster.copy.push import cmd_push

    return _run(cmd_push(_config(args), args.table, args.source, args.target, args.query))


def _cmd_tail(args: argparse.Namespace) -> int:
    from router.ops.tail import cmd_tail

    return _run(cmd_tail(_config(args), args.node, as_json=args.json, limit=args.limit))


def _cmd_repair(args: argparse.Namespace) -> int:
    from router.ops.compare.repair import cmd_repair

    config = _config(args)
    return _run(cmd_repair(config, args.tables, source=args.source, as_json=args.json, limit=args.timeout,
                           dry_run=args.dry_run))


def _cmd_join(args: argparse.Namespace) -> int:
    from router.ops.join import cmd_join

    return _run(cmd_join(_config(args), args.node, donor=args.donor, force=args.force))


def _cmd_part(args: argparse.Namespace) -> int:
    from router.ops.part import cmd_part

    return _run(cmd_part(_config(args), args.node, clean=args.clean))


def _with_config(sub: Any, name: str, help_text: str) -> argparse.ArgumentParser:
    command: argparse.ArgumentParser = sub.add_parser(name, help=help_text)
    command.add_argument("--config", required=True, metavar="PATH", help="the cluster's config.toml")
    return command


def _version() -> str:
    """The installed package's version (what `pip show pgmesh` says)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("pgmesh")
    except PackageNotFoundError:  # pragma: no cover - run from a checkout that was never installed
        return "unknown (not installed)"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pgmesh", description="Active-active replication for stock PostgreSQL 15+."
    )
    parser.add_argument("--log-level", default=None,
                        help="DEBUG, INFO, WARNING, ERROR (default: INFO for `run`, WARNING otherwise)")
    parser.add_argument("--version", action="version", version=f"pgmesh {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo = sub.add_parser("demo", help="throw-away local nodes, live decoded changes, a final check")
    demo.add_argument("--seconds", type=float, default=10.0, help="how long to write (default 10)")
    demo.add_argument("--keep", action="store_true", help="keep the nodes' directories afterwards")
    demo.set_defaults(func=_cmd_demo)
    init = _with_config(sub, "init", "check every node and install what pgmesh needs")
    how = init.add_mutually_exclusive_group()
    how.add_argument("--print-sql", action="store_true", help="print, per node, the SQL init would run and"
                     " the GRANTs for the run role (for a DBA to run); change nothing")
    how.add_argument("--check", action="store_true", help="as the config's role: every object of pgmesh and"
                     " every privilege `pgmesh run` needs, on every node (docs/security.md)")
    init.add_argument("--role", metavar="ROLE", help="with --print-sql: the role that will run the router"
                      " (default: the one the config connects as)")
    init.add_argument("--node", metavar="NODE", help="with --print-sql: only this node's script")
    init.set_defaults(func=_cmd_init)
    _with_config(sub, "run", "run the router (SIGTERM / Ctrl-C stops it cleanly)").set_defaults(func=_cmd_run)
    status = _with_config(sub, "status", "one row per link: state, position, lag, last error")
    status.add_argument("--json", action="store_true", help="machine-readable output")
    status.add_argument("--watch", type=float, nargs="?", const=2.0, default=None, metavar="S",
                        help="refresh in place every S seconds (default 2) until interrupted")
    status.add_argument("--count", type=int, default=None, metavar="N", help="with --watch: stop after N")
    status.set_defaults(func=_cmd_status)
    sequences = _with_config(sub, "sequences", "ids no two nodes hand out: show or convert sequences")
    actions = sequences.add_subparsers(dest="action", required=True, metavar="ACTION")
    show = actions.add_parser("status", help="per node: each sequence-backed column and its mode")
    show.add_argument("--json", action="store_true", help="machine-readable output")
    convert = actions.add_parser("convert", help="make the columns snowflake or step/offset on every node")
    convert.add_argument("--mode", choices=("snowflake", "step"), help="default: [sequences] mode")
    convert.add_argument("tables", nargs="*", metavar="TABLE", help="default: every replicated table")
    sequences.set_defaults(func=_cmd_sequences)
    conflicts = _with_config(sub, "conflicts", "the conflicts every node recorded, newest last")
    conflicts.add_argument("--since", metavar="WHEN", help="ISO timestamp, or an age: 10m, 2h, 1d")
    conflicts.add_argument("--json", action="store_true", help="one JSON object per line")
    conflicts.add_argument("--limit", type=int, default=100, metavar="N", help="newest N (default 100)")
    conflicts.set_defaults(func=_cmd_conflicts)
    quarantine = _with_config(sub, "quarantine", "changes a node refused, set aside: list, replay, discard")
    quarantine.add_argument("action", choices=("list", "replay", "discard"),
                            help="replay: each chosen key's pending entries, in order; discard: recorded")
    quarantine.add_argument("--node", metavar="NODE", help="only this node's entries (default: every node)")
    quarantine.add_argument("--id", type=int, action="append", metavar="N", help="this entry (repeatable);"
                            " replay takes its key's pending entries")
    quarantine.add_argument("--table", metavar="TABLE", help="only this table's entries (schema.table)")
    quarantine.add_argument("--key", metavar="KEY", help="a one-column key's value, or the key as JSON")
    quarantine.add_argument("--all", action="store_true", help="list: resolved entries too")
    quarantine.add_argument("--json", action="store_true", help="list: one JSON object per line")
    quarantine.set_defaults(func=_cmd_quarantine)
    ddl = _with_config(sub, "ddl", "run a DDL statement on one node; pgmesh replays it on every other node")
    ddl.add_argument("sql", metavar="SQL", help="the statement")
    ddl.add_argument("--node", metavar="NODE", help="where to run it (default: the first node)")
    ddl.add_argument("--wait", action="store_true",
                     help="replication barrier: first wait until every link has caught up, then until"
                     " the statement reached every node (needs `pgmesh run`)")
    ddl.add_argument("--timeout", type=float, default=300.0, metavar="S", help="barrier limit (default 300)")
    ddl.set_defaults(func=_cmd_ddl)
    compare = _with_config(
        sub, "compare", "every node's replicated rows against every other's (1: differ, 4: not all compared)")
    compare.add_argument("tables", nargs="*", metavar="TABLE", help="default: every replicated table")
    compare.add_argument("--json", action="store_true", help="machine-readable output")
    compare.add_argument("--timeout", type=float, default=300.0, metavar="S",
                         help="how long a recheck waits for the links to catch up (default 300)")
    compare.set_defaults(func=_cmd_compare)
    push = _with_config(sub, "push", "copy a table's rows (or a query's) from one node into another, live")
    push.add_argument("table", metavar="TABLE")
    push.add_argument("--from", dest="source", required=True, metavar="NODE", help="the node to read")
    push.add_argument("--to", dest="target", required=True, metavar="NODE", help="the node to write")
    push.add_argument("--query", metavar="SQL", help="push this query's rows (named as the table's columns)")
    push.set_defaults(func=_cmd_push)
    tail = _with_config(sub, "tail", "print a node's transactions, decoded, as they commit (for debugging)")
    tail.add_argument("node", metavar="NODE", help="the node to follow")
    tail.add_argument("--json", action="store_true", help="one JSON object a line")
    tail.add_argument("--limit", type=int, default=None, metavar="N", help="stop after N transactions")
    tail.set_defaults(func=_cmd_tail)
    repair = _with_config(sub, "repair", "compare, then write each difference's winning row where it differs")
    repair.add_argument("tables", nargs="*", metavar="TABLE", help="default: every replicated table")
    repair.add_argument("--from", dest="source", metavar="NODE",
                        help="this node's rows win (default: the cluster's conflict rules)")
    repair.add_argument("--json", action="store_true", help="machine-readable output")
    repair.add_argument("--dry-run", action="store_true",
                        help="print the plan (per table: keys, winners, rows per node) and write nothing")
    repair.add_argument("--timeout", type=float, default=300.0, metavar="S",
                        help="how long a recheck waits for the links to catch up (default 300)")
    repair.set_defaults(func=_cmd_repair)
    join = _with_config(sub, "join", "copy a donor into a new (empty) node listed in the config")
    join.add_argument("node", metavar="NODE", help="the new node, as named in the config")
    join.add_argument("--from", dest="donor", metavar="DONOR", help="the node to copy (default: first other)")
    join.add_argument("--force", action="store_true", help="drop the new node's schemas if it holds tables")
    join.set_defaults(func=_cmd_join)
    part = _with_config(sub, "part", "the cluster forgets a node; its database stays usable on its own")
    part.add_argument("node", metavar="NODE", help="the node to part")
    part.add_argument("--clean", action="store_true", help="also remove pgmesh's objects from that node")
    part.set_defaults(func=_cmd_part)
    for name, func, verb in (("pause", _cmd_pause, "stop"), ("resume", _cmd_resume, "restart")):
        command = _with_config(sub, name, f"{verb} applying: every link, or those into a node or from one")
        command.add_argument("--target", metavar="NODE", help="only links into this node (default: all)")
        command.add_argument("--source", metavar="NODE", help="only links from this node (default: all)")
        command.set_defaults(func=func)
    skip = _with_config(sub, "skip", "leave out the one transaction a link is stuck on (by its LSN)")
    skip.add_argument("--source", required=True, metavar="NODE", help="the link's source node")
    skip.add_argument("--target", required=True, metavar="NODE", help="the node that leaves it out")
    skip.add_argument("--lsn", required=True, metavar="X/Y",
                      help="the LSN the transaction ends at, as the link's error and `pgmesh status` show it")
    skip.set_defaults(func=_cmd_skip)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    # the router says when it starts, stops, holds and releases: INFO unless asked otherwise
    level = args.log_level or ("INFO" if args.command == "run" else "WARNING")
    logging.basicConfig(
        level=getattr(logging, str(level).upper(), logging.WARNING),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        code = int(args.func(args))
        sys.stdout.flush()  # a reader gone away shows here, not as an "Exception ignored" at exit
        return code
    except PgmeshError as exc:
        print(f"pgmesh: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        return _reader_gone()
    except KeyboardInterrupt:
        return 130


def _reader_gone() -> int:
    """stdout's reader closed early (`pgmesh status | head -1`): end quietly, with the exit code of a
    command killed by SIGPIPE (141, as `cat` gives). What is still buffered goes to /dev/null, so the
    interpreter's last flush cannot fail again; SIGPIPE itself stays ignored (the router's sockets)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, sys.stdout.fileno())
        finally:
            os.close(devnull)
    except (OSError, ValueError):  # stdout is not a file descriptor (an embedding caller's object)
        pass
    return 128 + signal.SIGPIPE


if __name__ == "__main__":
    sys.exit(main())
