"""The resident worker of the VNN-COMP scripts: the verifier's imports paid once, not per instance.

``prepare_instance.sh`` starts (or finds) a worker for its engine; ``run_instance.sh`` hands it the
instance; the worker forks a process for it, which runs the command exactly as a fresh interpreter
would (its arguments, working folder, environment, stdin/stdout/stderr: the client's own, passed
over the socket) and ends. So nothing of one instance survives into the next, and the fixed cost of
an instance is a fork instead of importing torch, auto_LiRPA and α,β-CROWN::

    python -m complete_verifier_ext.worker start ENGINE     # prepare: start one unless it runs
    python -m complete_verifier_ext.worker run ENGINE ENTRY ARGS...   # run: warm, else cold
    python -m complete_verifier_ext.worker stop ENGINE

``ENGINE`` is ``native`` or ``abcrown`` (α,β-CROWN imported too); ``ENTRY`` is ``cli`` (the
``abcrown`` command) or ``vnncomp`` (``abcrown_plugin.vnncomp``). One worker per engine, Python,
package source and α,β-CROWN checkout: its socket is named by their fingerprint, so a worker of
older code is never used (it ends on its own). ``run`` falls back to the cold command (``exec``,
the same arguments) when no worker answers, and when the worker dies before the instance ends (the
instance's clock still counts from ``run_instance.sh``'s start). One instance at a time; a worker
ends after ``CVE_WORKER_IDLE_S`` seconds (default 600) without one, or on ``stop``. When the client
goes (the harness killed ``run_instance.sh``), the instance's process group is killed.

The worker runs no torch operation itself, so that ranks can be forked from an instance's process
(``launch.run``'s ``fork``: no OpenMP pool exists to be lost in a fork); with ``parallel.exact_memory``
they are spawned fresh under ``EXACT_MEMORY_ENV`` as in a cold run (that heap setting, read at a
process's start, would slow every instance if the worker had it). Set ``CVE_WORKER=off`` to
always start cold; ``CVE_WORKER_DIR`` names the socket folder (default the temporary folder).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import MappingProxyType

ENGINES = ("native", "abcrown")
ENTRIES = MappingProxyType(
    {"cli": "complete_verifier_ext.cli", "vnncomp": "complete_verifier_ext.abcrown_plugin.vnncomp"}
)
_PACKAGE = Path(__file__).resolve().parent


def fingerprint(engine: str) -> str:
    """What a worker must share with its client: the interpreter, this package's source (its newest
    file), the engine and, for ``abcrown``, the checkout."""
    newest = max(p.stat().st_mtime_ns for p in _PACKAGE.rglob("*.py"))
    checkout = os.path.realpath(os.environ.get("ABCROWN_PATH", "")) if engine == "abcrown" else ""
    python = os.path.realpath(sys.executable)  # python, python3 and python3.11 are one interpreter
    text = "\0".join([python, str(_PACKAGE), str(newest), engine, checkout, str(os.getuid())])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def socket_path(engine: str) -> Path:
    """The engine's socket: in ``CVE_WORKER_DIR`` (default the temporary folder), or, where that path
    is longer than a Unix socket's name may be (108 bytes), under a short name in the temporary folder
    derived from it."""
    folder = os.environ.get("CVE_WORKER_DIR") or tempfile.gettempdir()
    path = Path(folder) / f"cve-worker-{engine}-{fingerprint(engine)}.sock"
    if len(os.fsencode(path)) < 100:
        return path
    short = hashlib.sha256(os.fsencode(path)).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / f"cve-worker-{short}.sock"


def _enabled() -> bool:
    return os.environ.get("CVE_WORKER", "on").lower() not in ("off", "0", "no", "false")


# ---------------------------------------------------------------------------------------------------------
# The client
# ---------------------------------------------------------------------------------------------------------
def _connect(engine: str, timeout: float | None = 2.0) -> socket.socket | None:
    if not _enabled():
        return None
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.settimeout(timeout)
    try:
        conn.connect(str(socket_path(engine)))
    except OSError:
        conn.close()
        return None
    return conn


def _message(request: dict) -> bytes:
    """A request on the socket: its length (8 bytes), then its JSON (the client keeps its end open:
    its closing is how the worker learns that the client is gone)."""
    data = json.dumps(request).encode()
    return len(data).to_bytes(8, "big") + data


def _ask(engine: str, op: str) -> dict | None:
    conn = _connect(engine)
    if conn is None:
        return None
    with conn:
        try:
            conn.sendall(_message({"op": op}))
            return json.loads(conn.recv(4096) or b"null")
        except (OSError, ValueError):
            return None


def alive(engine: str) -> bool:
    """Whether a worker for ``engine`` (of this code) answers."""
    return bool(_ask(engine, "ping"))


def start(engine: str, wait_s: float = 120.0) -> bool:
    """Start a worker for ``engine`` unless one answers; wait until it does. Returns whether it does."""
    if not _enabled() or alive(engine):
        return _enabled()
    path = socket_path(engine)
    log = open(path.with_suffix(".log"), "ab")
    env = dict(os.environ)
    env.pop("CVE_CLOCK_START", None)
    env.pop("CVE_DEADLINE", None)
    cmd = [sys.executable, "-m", "complete_verifier_ext.worker", "serve", engine]
    subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env, start_new_session=True)
    log.close()
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if alive(engine):
            return True
        time.sleep(0.05)
    return False


def stop(engine: str) -> bool:
    return _ask(engine, "stop") is not None


def run(engine: str, entry: str, argv: list[str]) -> int:
    """The instance on the warm worker (its exit code), else the cold command in this process."""
    cold = [sys.executable, "-m", ENTRIES[entry], *argv]
    conn = _connect(engine, timeout=None)
    if conn is None:
        os.execv(sys.executable, cold)
    request = {"op": "run", "entry": entry, "argv": argv, "cwd": os.getcwd(), "env": dict(os.environ)}
    with conn:
        try:
            socket.send_fds(conn, [_message(request)], [0, 1, 2])
            reply = conn.makefile("r").read().split()
        except OSError:
            reply = []
    if len(reply) == 2 and reply[0] == "exit":
        return int(reply[1])
    print("the resident worker ended before the instance did: starting it cold", file=sys.stderr)
    os.execv(sys.executable, cold)
    return 1  # not reached


# ---------------------------------------------------------------------------------------------------------
# The worker
# ---------------------------------------------------------------------------------------------------------
def _warm(engine: str) -> None:
    """Everything an instance imports, imported once (no torch operation runs)."""
    from . import abcrown_plugin, cli, verify  # noqa: F401

    if engine == "abcrown":
        abcrown_plugin.warm()


def serve(engine: str) -> None:
    """Listen on the engine's socket until idle for ``CVE_WORKER_IDLE_S`` seconds or stopped."""
    idle_s = float(os.environ.get("CVE_WORKER_IDLE_S", "600"))
    _warm(engine)
    path = socket_path(engine)
    if alive(engine):
        return  # another worker won the race
    path.unlink(missing_ok=True)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(4)
    last = time.monotonic()  # of the last instance (a ping does not keep a worker alive)
    try:
        while (left := idle_s - (time.monotonic() - last)) > 0:
            listener.settimeout(left)
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                return
            with conn:
                conn.settimeout(None)
                op = _serve_one(conn)
            if op == "stop":
                return
            if op == "run":
                last = time.monotonic()
    finally:
        listener.close()
        path.unlink(missing_ok=True)


def _serve_one(conn: socket.socket) -> str | None:
    """One request; returns its op."""
    data, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
    size = int.from_bytes(data[:8], "big") if len(data) >= 8 else 0
    while len(data) < 8 + size:
        chunk = conn.recv(1 << 16)
        if not chunk:
            break
        data += chunk
    try:
        request = json.loads(data[8 : 8 + size])
    except ValueError:
        request = {}
    op = request.get("op")
    if op in ("ping", "stop"):
        conn.sendall(json.dumps({"pid": os.getpid()}).encode())
        return op
    if op != "run" or len(fds) != 3:
        return None
    pid = os.fork()
    if pid == 0:
        _instance(request, fds)
    for fd in fds:
        os.close(fd)
    code = _wait(pid, conn)
    with contextlib.suppress(OSError):  # the client may be gone
        conn.sendall(f"exit {code}\n".encode())
    return op


def _wait(pid: int, conn: socket.socket) -> int:
    """The instance's exit code; if the client goes first, the instance's process group is killed."""
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        readable, _, _ = select.select([conn], [], [], 0.05)
        if readable and not conn.recv(1):  # the client is gone
            return _kill_group(pid)


def _kill_group(pid: int) -> int:
    """SIGTERM to the instance's process group, SIGKILL after 3 s; its exit code."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, sig)
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                return os.waitstatus_to_exitcode(status)
            time.sleep(0.05)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def _instance(request: dict, fds: list[int]) -> None:
    """In the forked process: the command as a fresh interpreter would run it; never returns."""
    code = 1
    try:
        os.setsid()  # its own process group: the ranks it starts go with it
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        sys.stdin = open(0, closefd=False)
        sys.stdout = open(1, "w", closefd=False)
        sys.stderr = open(2, "w", closefd=False)
        os.chdir(request["cwd"])
        from .parallel.launch import WARM_ENV

        os.environ.clear()
        os.environ.update(request["env"])
        os.environ[WARM_ENV] = "1"
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        from . import clock
        from .errors import end_cleanly_on_signals

        clock.restart()  # the instance's clock: CVE_CLOCK_START, else now
        end_cleanly_on_signals()
        argv = request["argv"]
        sys.argv = [ENTRIES[request["entry"]], *argv]
        if request["entry"] == "cli":
            from . import cli

            code = cli.main(argv, started=clock.started_monotonic())
        else:
            from .abcrown_plugin import vnncomp_main

            code = vnncomp_main(argv)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:  # a bug: its traceback, on the client's stderr
        import traceback

        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code)


def main(argv: list[str]) -> int:
    usage = "usage: python -m complete_verifier_ext.worker start|stop|serve ENGINE | run ENGINE ENTRY ARGS..."
    if len(argv) < 2 or argv[1] not in ENGINES or argv[0] not in ("start", "stop", "serve", "run"):
        print(usage, file=sys.stderr)
        return 2
    op, engine = argv[0], argv[1]
    if op == "run":
        if len(argv) < 3 or argv[2] not in ENTRIES:
            print(usage, file=sys.stderr)
            return 2
        return run(engine, argv[2], argv[3:])
    if op == "serve":
        serve(engine)
        return 0
    if op == "start":
        return 0 if start(engine) else 1
    return 0 if stop(engine) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
