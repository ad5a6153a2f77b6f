"""The Spark session the sync jobs run on.

Owns: building a SparkSession for a master (task retries through `local[N,F]` / `spark.task.maxFailures`,
no UI, a small driver, quiet logs, workers on this very Python), handing it to one job at a time, keeping
it between jobs only inside `reuse_spark()`, and stopping it together with its JVM.

Must not: import pyspark at module level (importing this module costs nothing; the JVM starts only when
a job asks for a session), know anything about PostgreSQL, or leave a JVM running in the router process
after a job unless asked to (`reuse_spark`).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import importlib
import logging
import os
import re
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Final

from router.errors import PgmeshError

__all__ = ["DEFAULT_CONF", "local_parallelism", "reuse_spark", "spark_session", "stop_spark", "with_retries"]

logger = logging.getLogger(__name__)

DEFAULT_CONF: Final[Mapping[str, str]] = {
    "spark.app.name": "pgmesh-sync",
    "spark.ui.enabled": "false",
    "spark.ui.showConsoleProgress": "false",
    "spark.driver.memory": "512m",
    "spark.python.worker.reuse": "true",
}
LOCAL_CONF: Final[Mapping[str, str]] = {
    "spark.driver.host": "127.0.0.1",
    "spark.driver.bindAddress": "127.0.0.1",
}
LOG_LEVEL: Final = "ERROR"
# The driver JVM only schedules (rows never pass through it): the client compiler and the serial
# collector start it about a third faster on a small machine (measured: 16-24 s -> 11-13 s, 2 busy cores).
DRIVER_JAVA_OPTIONS: Final = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"
# Spark's default log4j profile logs WARN and up to the console from the JVM's first second (hostname,
# native-hadoop library...): this one logs errors only. Written to a file once per process.
LOG4J2_PROPERTIES: Final = """\
rootLogger.level = error
rootLogger.appenderRef.stderr.ref = console
appender.console.type = Console
appender.console.name = console
appender.console.target = SYSTEM_ERR
appender.console.layout.type = PatternLayout
appender.console.layout.pattern = %d{yy/MM/dd HH:mm:ss} %p %c{1}: %m%n%ex
logger.repl.name = org.apache.spark.repl.Main
logger.repl.level = error
logger.gateway.name = org.apache.spark.api.python.PythonGatewayServer
logger.gateway.level = error
# A failed task attempt is reported by the job's error (router.cluster.copy.initial turns it into a
# PgmeshError);
# Spark's executor would also log each attempt's whole Python traceback.
logger.executor.name = org.apache.spark.executor.Executor
logger.executor.level = fatal
"""
JVM_STOP_TIMEOUT_S: Final = 15.0

_LOCAL_MASTER = re.compile(r"^local(?:\[\s*(\*|\d+)\s*(?:,\s*(\d+)\s*)?\])?$")
# The directory holding the `router` package: Spark's Python workers must be able to import it.
_SOURCE_ROOT: Final = str(Path(__file__).resolve().parent.parent.parent)


def with_retries(master: str, max_task_failures: int) -> str:
    """`master` with Spark's local retry syntax: local -> local[1,F], local[N] / local[*] -> local[N,F].

    In local mode Spark ignores `spark.task.maxFailures` and retries a task only when the master says
    `local[N,F]` (F attempts in all). A local master that already names F, and any non-local master
    (which honours spark.task.maxFailures), is returned unchanged.
    """
    if max_task_failures < 1:
        raise ValueError(f"max_task_failures must be >= 1, not {max_task_failures}")
    match = _LOCAL_MASTER.match(master.strip())
    if match is None:
        return master
    cores, failures = match.group(1) or "1", match.group(2)
    if failures is not None:
        return f"local[{cores},{failures}]"
    return f"local[{cores},{max_task_failures}]"


def local_parallelism(master: str) -> int | None:
    """Cores a local master runs tasks on (local[*] = this machine's); None for other masters."""
    match = _LOCAL_MASTER.match(master.strip())
    if match is None:
        return None
    cores = match.group(1) or "1"
    return (os.cpu_count() or 1) if cores == "*" else int(cores)


class _State:
    __slots__ = ("key", "reuse_depth", "session")

    def __init__(self) -> None:
        self.session: Any = None
        self.key: tuple[str, tuple[tuple[str, str], ...]] | None = None
        self.reuse_depth = 0


_lock = threading.RLock()
_state = _State()
_log4j2_file: str | None = None


@contextlib.contextmanager
def spark_session(
    master: str,
    conf: Mapping[str, str] | None = None,
    *,
    max_task_failures: int = 4,
    worker_modules: Sequence[str] = (),
) -> Iterator[Any]:
    """A SparkSession for one job; jobs run one at a time (others wait here).

    A new session first runs one small job that imports `worker_modules` on every core: the Python
    workers start (and load those modules) before the real job, and a worker that cannot import them
    fails here with a clear error. Reuses the running session when it was built with the same master
    and conf inside `reuse_spark()`; otherwise the session (and its JVM) is stopped when the job ends.
    """
    effective = with_retries(master, max_task_failures)
    merged = {**DEFAULT_CONF, "spark.task.maxFailures": str(max_task_failures)}
    if local_parallelism(effective) is not None:
        merged.update(LOCAL_CONF)
    merged.update(conf or {})
    key = (effective, tuple(sorted(merged.items())))
    with _lock:
        if _state.session is not None and _state.key != key:
            _stop_locked()
        if _state.session is None:
            _state.session = _start(effective, merged)
            _state.key = key
            try:
                _warm_up(_state.session, worker_modules)
            except BaseException:
                _stop_locked()
                raise
        try:
            yield _state.session
        finally:
            if _state.reuse_depth == 0:
                _stop_locked()


@contextlib.contextmanager
def reuse_spark() -> Iterator[None]:
    """Keep the session (and JVM) running between jobs inside this block; stop it at the end.

    For tests and for batches of jobs; a single join does not need it.
    """
    with _lock:
        _state.reuse_depth += 1
    try:
        yield
    finally:
        with _lock:
            _state.reuse_depth -= 1
            if _state.reuse_depth == 0:
                _stop_locked()


def stop_spark() -> None:
    """Stop the session, if any, and the JVM behind it."""
    with _lock:
        _stop_locked()


def _start(master: str, conf: Mapping[str, str]) -> Any:
    try:
        from pyspark.sql import SparkSession
    except ImportError as exc:
        raise PgmeshError(f"pyspark cannot be imported ({exc})",
                          hint="install pgmesh with its sync extra: pip install 'pgmesh[sync]'") from None

    # The context reads these from the environment: local workers must run this interpreter (this venv,
    # with psycopg and the router package), not whatever `python3` is on PATH.
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    if local_parallelism(master) is not None:
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    logging.getLogger("py4j").setLevel(logging.WARNING)  # py4j logs every closed connection at INFO
    python_path = os.pathsep.join(p for p in (_SOURCE_ROOT, os.environ.get("PYTHONPATH", "")) if p)
    builder = SparkSession.builder.master(master).config("spark.executorEnv.PYTHONPATH", python_path)
    if "spark.driver.extraJavaOptions" not in conf:
        options = f"-Dlog4j2.configurationFile={_log4j2()} {DRIVER_JAVA_OPTIONS}"
        builder = builder.config("spark.driver.extraJavaOptions", options)
    for name, value in conf.items():
        builder = builder.config(name, value)
    logger.info("starting Spark (master %s)", master)
    try:
        session = builder.getOrCreate()
    except Exception as exc:
        first = next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
        raise PgmeshError(f"Spark did not start (master {master}): {first[:300]}",
                          hint="Spark needs Java 17+ (java on PATH or JAVA_HOME)") from None
    session.sparkContext.setLogLevel(LOG_LEVEL)
    return session


def _warm_up(session: Any, modules: Sequence[str]) -> None:
    sc = session.sparkContext
    slots = max(1, int(sc.defaultParallelism))
    try:
        sc.parallelize(range(slots), slots).map(functools.partial(import_modules, tuple(modules))).collect()
    except Exception as exc:
        first = next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
        raise PgmeshError(
            f"Spark's Python workers cannot start or import {', '.join(modules) or 'pyspark'}: {first[:300]}",
            hint=f"workers run {sys.executable}; it must have pgmesh, psycopg and pyspark installed",
        ) from None


def import_modules(modules: Sequence[str], _item: object = None) -> int:
    """Run on a worker by the warm-up job: import `modules` there."""
    for name in modules:
        importlib.import_module(name)
    return os.getpid()


def _log4j2() -> str:
    global _log4j2_file
    if _log4j2_file is None or not os.path.exists(_log4j2_file):
        fd, path = tempfile.mkstemp(prefix="pgmesh-log4j2-", suffix=".properties")
        with os.fdopen(fd, "w") as out:
            out.write(LOG4J2_PROPERTIES)
        atexit.register(_remove, path)
        _log4j2_file = path
    return _log4j2_file


def _remove(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


def _stop_locked() -> None:
    session, _state.session, _state.key = _state.session, None, None
    if session is None:
        return
    logger.info("stopping Spark")
    try:
        session.stop()
    finally:
        _stop_jvm()


def _stop_jvm() -> None:
    """End the JVM pyspark launched (SparkSession.stop leaves it running, idle, for the next session)."""
    from pyspark import SparkContext

    gateway = SparkContext._gateway
    if gateway is None:
        return
    SparkContext._gateway = None
    SparkContext._jvm = None
    proc: subprocess.Popen[bytes] | None = getattr(gateway, "proc", None)
    try:
        gateway.shutdown()
    except Exception:  # the JVM may already be gone; we only want it to be
        logger.debug("py4j gateway shutdown failed", exc_info=True)
    if proc is None:
        return
    with contextlib.suppress(OSError):
        if proc.stdin is not None:
            proc.stdin.close()  # the gateway server exits when its stdin closes
    try:
        proc.wait(JVM_STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(JVM_STOP_TIMEOUT_S)
