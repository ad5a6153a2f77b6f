"""Throw-away TLS certificates made with the openssl command line: a CA, a server certificate for
127.0.0.1 and localhost, a client certificate, and a second CA that signed none of them.

Owns making the files (PEM, EC P-256 keys, valid two days). Must not: start or configure a server
(the TLS tests do), or keep anything outside the directory it is given.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class Certs:
    ca: Path
    other_ca: Path  # signed nothing here: a client trusting it must refuse the server
    server_crt: Path
    server_key: Path
    client_crt: Path
    client_key: Path


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=30)


def _ca(name: str, cwd: Path) -> None:
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", f"{name}.key", "-out", f"{name}.crt", "-days", "2",
             "-subj", f"/CN=pgmesh test {name}", cwd=cwd)


def _signed(name: str, subject: str, ext: str, cwd: Path) -> None:
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", subject, cwd=cwd)
    (cwd / f"{name}.ext").write_text(ext)
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
             "-out", f"{name}.crt", "-days", "2", "-extfile", f"{name}.ext", cwd=cwd)
    (cwd / f"{name}.key").chmod(0o600)


def make_certs(directory: Path, client_user: str = "postgres") -> Certs:
    """A CA, a server certificate (SAN 127.0.0.1 and localhost), a client certificate for `client_user`
    (its CN, as pg_hba's `cert` method matches it), and an unrelated CA, in `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    _ca("ca", directory)
    _ca("other", directory)
    _signed("server", "/CN=localhost", "subjectAltName=IP:127.0.0.1,DNS:localhost\n"
            "extendedKeyUsage=serverAuth\n", directory)
    _signed("client", f"/CN={client_user}", "extendedKeyUsage=clientAuth\n", directory)
    return Certs(directory / "ca.crt", directory / "other.crt", directory / "server.crt",
                 directory / "server.key", directory / "client.crt", directory / "client.key")
