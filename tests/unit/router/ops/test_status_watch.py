"""`pgmesh status --watch`: the report again every S seconds, `--count` times (here with every node down,
as the command sees a cluster whose nodes refuse: each report says so)."""

from __future__ import annotations

import io
import json

from router.config.model import parse_config
from router.ops.control import cmd_status
from router.testing.mesh import free_port

CONFIG = """
[cluster]
name = "w"
[[nodes]]
name = "a"
dsn = "host=127.0.0.1 port={a} dbname=x connect_timeout=2"
[[nodes]]
name = "b"
dsn = "host=127.0.0.1 port={b} dbname=x connect_timeout=2"
[admin]
listen = "127.0.0.1:{admin}"
"""


async def test_watch_prints_the_report_count_times() -> None:
    config = parse_config(CONFIG.format(a=free_port(), b=free_port(), admin=free_port()))
    out = io.StringIO()
    assert await cmd_status(config, as_json=False, out=out, watch=0.2, count=2) == 0
    text = out.getvalue()
    assert text.count("cluster w: router NOT running") == 2 and "\x1b[2J" not in text  # not a terminal
    out = io.StringIO()
    assert await cmd_status(config, as_json=True, out=out, watch=0.2, count=3) == 0
    reports = [json.loads(line) for line in out.getvalue().splitlines()]
    assert len(reports) == 3 and all(r["running"] is False for r in reports)
