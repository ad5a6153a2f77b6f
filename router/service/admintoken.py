"""The admin listener's token: what a request that changes state (POST /pause, /resume, /hold, /release)
must carry as `Authorization: Bearer <token>` (router.service.admin).

Where it comes from, first found: `$PGMESH_ADMIN_TOKEN`; the file `[admin] token_file`; else the file
`admin.token` in the cluster's state directory (beside the router's logs: `$PGMESH_STATE_DIR`, else
`$XDG_STATE_HOME/pgmesh`, else `~/.local/state/pgmesh`, then `/<cluster>`), which the router creates at
start when it is missing: random, mode 0600, so only the router's user (and root) can read it. The
command line (`pgmesh pause`, `resume`, `join`, `part`, the barrier) reads the same place, so on the
router's host nothing needs configuring; a web page in the operator's browser can read none of it.

Must not: log or print the token, or put it into an error message.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path
from typing import Final

from router.config.model import Config
from router.errors import ConfigError

__all__ = ["TOKEN_ENV", "client_token", "router_token", "token_path"]

TOKEN_ENV: Final = "PGMESH_ADMIN_TOKEN"
_FILE: Final = "admin.token"


def token_path(config: Config) -> Path:
    """The token file: `[admin] token_file`, else `admin.token` in the cluster's state directory."""
    if config.admin.token_file:
        return Path(config.admin.token_file).expanduser()
    return config.log_directory("_").parent / _FILE


def _read(path: Path) -> str | None:
    try:
        text = path.read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ConfigError(f"cannot read the admin token file {path}: {exc.strerror or exc}") from None
    if not text:
        raise ConfigError(f"the admin token file {path} is empty")
    return text


def client_token(config: Config) -> str | None:
    """The token a command sends (None: none to be found; the router then refuses what needs one)."""
    from_env = os.environ.get(TOKEN_ENV, "").strip()
    if from_env:
        return from_env
    with contextlib.suppress(ConfigError):
        return _read(token_path(config))
    return None


def router_token(config: Config) -> str:
    """The router's token: the environment's, the configured file's, or the default file's, made now (mode
    0600) when there is none."""
    from_env = os.environ.get(TOKEN_ENV, "").strip()
    if from_env:
        return from_env
    path = token_path(config)
    found = _read(path)
    if found is not None:
        return found
    if config.admin.token_file:
        raise ConfigError(f"admin.token_file: {path} does not exist (create it, or leave token_file out)")
    path.parent.mkdir(parents=True, exist_ok=True)
    token = secrets.token_urlsafe(32)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:  # another router of the cluster made it meanwhile: take that one
        again = _read(path)
        assert again is not None
        return again
    with os.fdopen(fd, "w", encoding="utf-8") as out:
        out.write(token + "\n")
    return token
