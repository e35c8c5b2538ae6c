"""A fork server for a local cluster's services: one process imports edgeswarm, every registered service and torch
once, then forks a child per service.

Why: a service started as ``python -m edgeswarm service NAME`` spends 0.6 s of CPU importing edgeswarm and 1 to 1.5 s
more importing torch before it does anything; a cluster of 4 devices is 19 such processes, about 30 s of CPU that a
2-core machine needs 15 s to get through. A forked child shares the server's imported modules (copy-on-write pages) and
starts in milliseconds.

A child is what ``edgeswarm service NAME`` would be: its argument list (``/proc/PID/cmdline``, what ``ps`` and
``chaos`` read, is rewritten to it), its environment (replaced whole, so ``EDGESWARM_*`` settings are read from it
exactly as from a fresh process's; ``/proc/PID/environ`` is rewritten to it too), its network namespace when the
request names one (``ip netns exec``'s, without its private mount of ``/sys``, which no service reads), stdin
from /dev/null, stdout and stderr appended to its log, signal handlers as Python installs them, ``random`` and
numpy reseeded from the operating system (a fresh interpreter seeds them so; torch's default generator starts from
its fixed seed in both), and it exits as an interpreter does (threads joined, ``atexit`` run, output flushed; the
interpreter is not torn down, see ``_leave``). What differs: it is the server's child, not the launcher's, so it dies
with the server (SIGTERM, as a service of the launcher dies with it), the server dies with the launcher, and
``EDGESWARM_DIE_WITH_PARENT`` is rewritten to name the server.

The launcher and the server speak JSON lines over the server's stdin and stdout: a ``SpawnRequest`` in, a
``Spawned`` (or ``SpawnFailed``) out, and an ``Exited`` out whenever a child ends. A process that sets
``LD_PRELOAD`` (the netns clock skew's libfaketime) cannot be forked from a server that was not started with it:
callers start those with ``subprocess`` as before.
"""

from __future__ import annotations

import atexit
import ctypes
import gc
import logging
import os
import queue
import select
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import IO, Literal, NoReturn

from pydantic import BaseModel, Field, TypeAdapter, ValidationError

from edgeswarm.devices.compute import sharing_cores
from edgeswarm.errors import EdgeswarmError
from edgeswarm.procfs import stat_fields

log = logging.getLogger(__name__)

DIE_WITH_PARENT_ENV = "EDGESWARM_DIE_WITH_PARENT"
# How long the first spawn may wait for the server to import everything (about 3 s of CPU), on a loaded machine.
START_TIMEOUT_S = 120.0
# A child whose end the server could not report (the server itself died): its exit status is unknown.
UNKNOWN_STATUS = 255
_MAX_LINE = 16 * 1024 * 1024
# Spare bytes on the server's command line, which each child overwrites with its own (``_retitle``).
TITLE_ROOM = 512
# Spare bytes in the server's environment, which each child overwrites with its own (``_rewrite_environ``): a
# service's is 3 to 5 KiB.
ENV_ROOM = 32 * 1024
_ROOM_VARIABLE = "EDGESWARM_FORKSERVER_ROOM"
NETNS_DIR = Path("/run/netns")  # where ``ip netns add`` pins a namespace, by name
_CLONE_NEWNET = 0x40000000


class ForkServerError(EdgeswarmError):
    """The fork server did not start, died, or refused a spawn; the message says which and where its log is."""


class SpawnRequest(BaseModel):
    """Start a child: ``edgeswarm service SERVICE``, ``env`` as its whole environment, ``log_path`` the file its
    stdout and stderr are appended to."""

    type: Literal["spawn"] = "spawn"
    service: str = Field(min_length=1, max_length=128)
    env: dict[str, str]
    log_path: str
    netns: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_.-]{1,64}$")


class Spawned(BaseModel):
    type: Literal["spawned"] = "spawned"
    pid: int


class SpawnFailed(BaseModel):
    type: Literal["failed"] = "failed"
    error: str


class Exited(BaseModel):
    """A child ended: ``status`` as ``subprocess`` reports it (the exit code, or minus the signal that killed it)."""

    type: Literal["exited"] = "exited"
    pid: int
    status: int


_Reply: TypeAdapter[Spawned | SpawnFailed | Exited] = TypeAdapter(Spawned | SpawnFailed | Exited)


def preload() -> None:
    """Import what the built-in services and workloads import, so that children find it imported. Only modules: no
    registry is read (a plug-in installed while the server runs is found by the children that need it)."""
    import importlib

    # A process's first torch.optim optimizer imports torch._dynamo (about 2 s of CPU): imported here, it is not paid
    # in a device's first training round. (The digits data set is read without importing scikit-learn.)
    import torch  # noqa: F401  # the heaviest import by far; stage-workers and profilers all need it
    import torch._dynamo  # noqa: F401

    import edgeswarm.cli.service  # noqa: F401
    from edgeswarm.service_registry import BUILT_IN
    from edgeswarm.workloads import BUILTIN

    for target in [*(entry.target for entry in BUILT_IN.values()), *BUILTIN.values()]:
        importlib.import_module(target.split(":", 1)[0])


# ---------------------------------------------------------------------------------------------------------------------
# The server's side.

def serve(launcher_pid: int) -> None:
    """The server's loop: read requests on stdin, fork, report children's ends on stdout, until stdin closes.

    In a child this function never returns: the child runs ``edgeswarm`` and exits (``_leave``)."""
    # A Ctrl-C in the launcher's terminal reaches the whole process group; the launcher decides what stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with(launcher_pid)
    preload()
    # Out of the collector's sight: a child's collections then never write to (and so copy) the server's objects.
    gc.freeze()
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    os.set_blocking(wake_r, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    stdin, stdout = sys.stdin.fileno(), sys.stdout.fileno()
    buffered = b""
    while True:
        readable, _, _ = select.select([stdin, wake_r], [], [])
        if wake_r in readable:
            while _drain(wake_r):
                pass
        _report_exits(stdout)
        if stdin not in readable:
            continue
        chunk = os.read(stdin, 1 << 16)
        if not chunk:
            return  # the launcher closed its end (or died): children were stopped, or get SIGTERM as we go
        buffered += chunk
        while b"\n" in buffered:
            line, buffered = buffered.split(b"\n", 1)
            try:
                request = SpawnRequest.model_validate_json(line)
            except ValidationError as exc:
                _write(stdout, SpawnFailed(error=f"not a spawn request: {exc.errors()[0]['msg']}"))
                continue
            _write(stdout, _fork(request, stdin, stdout, (wake_r, wake_w)))
        if len(buffered) > _MAX_LINE:
            raise SystemExit("a request line over 16 MiB: not our launcher")


def _drain(fd: int) -> bool:
    try:
        return bool(os.read(fd, 4096))
    except BlockingIOError:
        return False


def _report_exits(stdout: int) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _write(stdout, Exited(pid=pid, status=os.waitstatus_to_exitcode(status)))


def _write(fd: int, reply: BaseModel) -> None:
    data = (reply.model_dump_json() + "\n").encode()
    while data:
        data = data[os.write(fd, data):]


def _fork(request: SpawnRequest, stdin: int, stdout: int, wake: tuple[int, int]) -> BaseModel:
    """Fork a child for ``request``: ``Spawned``, or ``SpawnFailed`` when its log cannot be opened or fork failed.
    Never returns in the child."""
    try:
        # Opened here, so that a log the child could not write is this request's failure, not a silent child.
        out = os.open(request.log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    except OSError as exc:
        return SpawnFailed(error=f"cannot open its log {request.log_path}: {exc.strerror}")
    server = os.getpid()
    try:
        pid = os.fork()
    except OSError as exc:
        os.close(out)
        return SpawnFailed(error=f"fork failed: {exc.strerror}")
    if pid == 0:
        _become(request, server, stdin, stdout, out, wake)
    os.close(out)
    return Spawned(pid=pid)


def _become(request: SpawnRequest, server: int, stdin: int, stdout: int, out: int,
            wake: tuple[int, int]) -> NoReturn:
    """In the child: look like a fresh ``edgeswarm service`` process, run the service, exit with its status."""
    _die_with(server)
    args = ["service", request.service]
    _retitle([sys.executable, "-m", "edgeswarm", *args])
    signal.set_wakeup_fd(-1)
    for fd in wake:
        os.close(fd)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, stdin)
    os.close(devnull)
    os.dup2(out, stdout)
    os.dup2(out, sys.stderr.fileno())
    os.close(out)
    if request.netns is not None:
        try:
            _enter_netns(request.netns)
        except OSError as exc:
            print(f"cannot enter network namespace {request.netns}: {exc}", file=sys.stderr)
            _leave(1)
    env = dict(request.env)
    if DIE_WITH_PARENT_ENV in env:  # what ``edgeswarm service`` checks: its parent is the server now
        env[DIE_WITH_PARENT_ENV] = str(server)
    os.environ.clear()  # unsets each: the C library's environment then points into the area no more
    os.environ.update(env)
    _rewrite_environ(env)
    _reseed()
    import edgeswarm
    from edgeswarm.cli.service import service_process

    # As ``python -m edgeswarm`` sets it.
    sys.argv = [str(Path(edgeswarm.__file__).parent / "__main__.py"), *args]
    try:
        status = service_process(request.service)
    except SystemExit as exc:
        status = _exit_status(exc.code)
    except BaseException:  # noqa: BLE001 - what the interpreter would do with it: print it, exit 1
        traceback.print_exc()
        status = 1
    _leave(status)


def _exit_status(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _leave(status: int) -> NoReturn:
    """Exit as the interpreter does (other threads joined, ``atexit`` run, output flushed), without tearing the
    interpreter down: that drops a reference to every object the server imported, which copies each of their shared
    pages into this child (0.8 s of CPU with torch imported, measured), for nothing."""
    main = threading.main_thread()
    for thread in threading.enumerate():
        if thread is not main and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(status)


def _retitle(argv: list[str]) -> None:
    """Write ``argv`` over this process's argument area, so that ``/proc/PID/cmdline`` (``ps``, and ``chaos``, which
    checks a pid is still the service it names before signalling it) shows the service, not the server. The server
    was started with ``TITLE_ROOM`` spare bytes for it; a longer one is cut short."""
    fields = stat_fields("self")
    if fields is None or len(fields) < 47:
        return
    start, end = int(fields[45]), int(fields[46])  # arg_start and arg_end: fields 48 and 49 of proc(5)
    room = end - start
    title = b"\0".join(a.encode() for a in argv)[:room - 1]
    ctypes.memmove(start, title.ljust(room, b"\0"), room)


def _rewrite_environ(env: dict[str, str]) -> None:
    """Write ``env`` over this process's environment area, so that ``/proc/PID/environ`` (what an operator and the
    netns tests read) shows the child's environment, not the server's. The server was started with ``ENV_ROOM`` spare
    bytes for it; entries past the room are left out (and said so on stderr)."""
    fields = stat_fields("self")
    if fields is None or len(fields) < 49:
        return
    start, end = int(fields[47]), int(fields[48])  # env_start and env_end: fields 50 and 51 of proc(5)
    room = end - start
    data, shown = b"", 0
    for key, value in env.items():
        entry = f"{key}={value}".encode(errors="surrogateescape") + b"\0"
        if len(data) + len(entry) > room:
            break
        data, shown = data + entry, shown + 1
    if shown < len(env):
        print(f"/proc/{os.getpid()}/environ shows {shown} of this service's {len(env)} environment variables "
              f"(the fork server kept {room} bytes for them)", file=sys.stderr)
    ctypes.memmove(start, data.ljust(room, b"\0"), room)


def _enter_netns(name: str) -> None:
    """Move this (single-threaded, just forked) process into the network namespace ``ip netns`` pinned as ``name``.
    Raises OSError when there is none or the kernel refuses."""
    fd = os.open(NETNS_DIR / name, os.O_RDONLY | os.O_CLOEXEC)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))
    finally:
        os.close(fd)


def _reseed() -> None:
    import random

    random.seed()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()


def _die_with(parent: int) -> None:
    """SIGTERM this process when ``parent`` dies (Linux); exit at once if it already has."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:
        raise SystemExit(1)


# ---------------------------------------------------------------------------------------------------------------------
# The launcher's side.

class ForkedProcess:
    """A child of the fork server, with the part of ``subprocess.Popen``'s interface a launcher uses."""

    def __init__(self, server: ForkServer, pid: int) -> None:
        self._server = server
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        """The exit status once the child ended, else None."""
        with self._server.changed:
            self._server.settle_orphan(self)
            return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Wait up to ``timeout`` seconds (None: for ever) for the child to end; its exit status. Raises
        ``subprocess.TimeoutExpired`` when it is still running then."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._server.changed:
            while True:
                self._server.settle_orphan(self)
                if self.returncode is not None:
                    return self.returncode
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
                self._server.changed.wait(0.5 if left is None else min(left, 0.5))

    def send_signal(self, sig: int) -> None:
        """Send ``sig`` unless the child is known to have ended (its pid may be another process's by now)."""
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """A running fork server (see the module docstring); ``spawn`` starts a child, ``close`` ends the server.

    ``log_path``: where the server's own errors go."""

    def __init__(self, log_path: Path) -> None:
        self.log_path = log_path
        self.changed = threading.Condition()
        self._children: dict[int, ForkedProcess] = {}
        self._replies: queue.Queue[ForkedProcess | SpawnFailed | None] = queue.Queue()
        self._spawn_lock = threading.Lock()
        self._alive = True
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as err:
            self._process = subprocess.Popen(
                [sys.executable, "-m", "edgeswarm.local.forkserver", str(os.getpid()), " " * TITLE_ROOM],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                env={**sharing_cores(os.environ), _ROOM_VARIABLE: " " * ENV_ROOM})
        assert self._process.stdin is not None and self._process.stdout is not None
        self._requests: IO[bytes] = self._process.stdin
        self._reader = threading.Thread(target=self._read, args=(self._process.stdout,), daemon=True,
                                        name="forkserver-reader")
        self._reader.start()

    @property
    def pid(self) -> int:
        return self._process.pid

    def spawn(self, service: str, env: dict[str, str], log_path: Path, *, netns: str | None = None) -> ForkedProcess:
        """Fork a child running ``edgeswarm service SERVICE`` with environment ``env`` (in network namespace
        ``netns``, an ``ip netns`` name, when given), its output appended to ``log_path``. Raises ForkServerError when
        the server is gone or the fork failed; a namespace that cannot be entered ends the child with status 1."""
        request = SpawnRequest(service=service, env=env, log_path=str(log_path), netns=netns)
        with self._spawn_lock:
            try:
                self._requests.write((request.model_dump_json() + "\n").encode())
                self._requests.flush()
            except (BrokenPipeError, ValueError):
                raise ForkServerError(f"the fork server (pid {self.pid}) is gone; see {self.log_path}") from None
            try:
                reply = self._replies.get(timeout=START_TIMEOUT_S)
            except queue.Empty:
                raise ForkServerError(f"the fork server (pid {self.pid}) did not answer within "
                                      f"{START_TIMEOUT_S:.0f} s; see {self.log_path}") from None
        if reply is None:
            raise ForkServerError(f"the fork server (pid {self.pid}) exited; see {self.log_path}")
        if isinstance(reply, SpawnFailed):
            raise ForkServerError(f"the fork server could not start the {service} service: {reply.error}")
        return reply

    def settle_orphan(self, child: ForkedProcess) -> None:
        """With ``changed`` held: once the server is gone, a child it never reported is ended when its pid is."""
        if child.returncode is not None or self._alive:
            return
        try:
            os.kill(child.pid, 0)
        except ProcessLookupError:
            child.returncode = UNKNOWN_STATUS

    def _read(self, replies: IO[bytes]) -> None:
        for line in replies:
            try:
                reply = _Reply.validate_json(line)
            except ValueError:
                log.warning("the fork server wrote %r, not a reply; ignored", line[:200])
                continue
            if isinstance(reply, SpawnFailed):
                self._replies.put(reply)
                continue
            with self.changed:
                if isinstance(reply, Spawned):
                    # Registered here, before any end of it is read, so that an Exited always finds its child.
                    self._children[reply.pid] = ForkedProcess(self, reply.pid)
                    self._replies.put(self._children[reply.pid])
                    continue
                child = self._children.pop(reply.pid, None)
                if child is not None:
                    child.returncode = reply.status
                self.changed.notify_all()
        with self.changed:
            self._alive = False
            self.changed.notify_all()
        self._replies.put(None)

    def close(self, timeout_s: float = 5.0) -> None:
        """End the server: close its requests (it exits at once; children still running get SIGTERM as it does),
        wait up to ``timeout_s`` seconds, then kill it."""
        try:
            self._requests.close()
        except OSError:
            pass
        try:
            self._process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait(timeout_s)
        self._reader.join(timeout_s)


if __name__ == "__main__":
    serve(int(sys.argv[1]))
