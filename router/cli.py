"""The `pgmesh` command line: parses arguments and calls into the router. No logic lives here."""

from __future__ import annotations

import argparse
import asyncio
import logging
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
    from router.demo import run_demo

    return _run(run_demo(seconds=args.seconds, keep=args.keep))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pgmesh", description="Active-active replication for stock PostgreSQL 15+."
    )
    parser.add_argument("--log-level", default="WARNING", help="DEBUG, INFO, WARNING (default), ERROR")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo = sub.add_parser("demo", help="throw-away local nodes, live decoded changes, a final check")
    demo.add_argument("--seconds", type=float, default=8.0, help="how long to write (default 8)")
    demo.add_argument("--keep", action="store_true", help="keep the nodes' directories afterwards")
    demo.set_defaults(func=_cmd_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, str(args.log_level).upper(), logging.WARNING),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return int(args.func(args))
    except PgmeshError as exc:
        print(f"pgmesh: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
