"""The container's health check: exit 0 when the router's admin listener answers GET /healthz with 200.

Owns: one request to $PGMESH_HEALTH_URL (default http://127.0.0.1:8787/healthz, the container's
`[admin] listen` on loopback), made from inside the container (or pod), so the slim image needs no curl.
`--listening`: exit 0 on any HTTP answer (a liveness probe: a node down makes /healthz 503, and
restarting the router would not bring the node back).
An https URL (a listener beyond loopback has TLS, docs/admin.md) is checked against
$PGMESH_HEALTH_CAFILE when set (the listener's `tls_cert`), else not verified: it reads nothing secret.
Must not: import pgmesh (it runs beside the router, not in it) or wait longer than its timeout.
On failure it prints the router's reason (the body of the 503: which node or link is unhealthy).
"""

from __future__ import annotations

import os
import ssl
import sys
import urllib.error
import urllib.request

DEFAULT_URL = "http://127.0.0.1:8787/healthz"


def _context(url: str) -> ssl.SSLContext | None:
    if not url.startswith("https:"):
        return None
    cafile = os.environ.get("PGMESH_HEALTH_CAFILE")
    if cafile:
        context = ssl.create_default_context(cafile=cafile)
        context.check_hostname = False  # the router's own certificate is the only one trusted
        return context
    return ssl._create_unverified_context()


def main(argv: list[str]) -> int:
    listening = "--listening" in argv
    url = os.environ.get("PGMESH_HEALTH_URL") or DEFAULT_URL
    timeout = float(os.environ.get("PGMESH_HEALTH_TIMEOUT", "3"))
    try:
        with urllib.request.urlopen(url, timeout=timeout, context=_context(url)) as resp:
            return 0 if resp.status == 200 else 1
    except urllib.error.HTTPError as exc:  # 503: the router says why
        if listening:
            return 0
        print(exc.read().decode("utf-8", "replace").strip() or f"HTTP {exc.code}", file=sys.stderr)
        return 1
    except (OSError, ValueError) as exc:
        print(f"no answer from the router's admin listener: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
