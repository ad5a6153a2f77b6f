"""The container's health check: exit 0 when the router's admin listener answers GET /healthz with 200.

Owns: one request to $PGMESH_HEALTH_URL (default http://127.0.0.1:8787/healthz, the container's
`[admin] listen`), made from inside the container, so the slim image needs no curl.
Must not: import pgmesh (it runs beside the router, not in it) or wait longer than its timeout.
On failure it prints the router's reason (the body of the 503: which node or link is unhealthy).
"""

from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request

DEFAULT_URL = "http://127.0.0.1:8787/healthz"


def main() -> int:
    url = os.environ.get("PGMESH_HEALTH_URL") or DEFAULT_URL
    try:
        with urllib.request.urlopen(url, timeout=float(os.environ.get("PGMESH_HEALTH_TIMEOUT", "3"))) as resp:
            return 0 if resp.status == 200 else 1
    except urllib.error.HTTPError as exc:  # 503: the router says why
        print(exc.read().decode("utf-8", "replace").strip() or f"HTTP {exc.code}", file=sys.stderr)
        return 1
    except (OSError, ValueError) as exc:
        print(f"no answer from the router's admin listener: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
