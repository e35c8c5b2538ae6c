"""One memory ledger per node: every program on the node reserves its memory against the device's budget here.

A program reserves a job's static bytes (weights, buffers, optimizer state; training also its activations' peak as
rounds allocate them) before it allocates them, and releases them when the job is released, evicted or the program
closes. A job may hold parts beside its own holding, each reserved and released alone (serving: one KV cache per
request, ``part`` naming the request); releasing the job releases them all. A reservation that does not fit is
refused with ``MemoryBudgetError`` naming what holds the memory, after the pressure hooks had their chance to free
some.

Policy (who gives way):

* Reservations are first come, first served; nothing is taken from a job in use.
* A program may register a pressure hook (``on_pressure``). When a reservation does not fit, or a job's holding
  cannot grow (``grow``: a training round's activations), the ledger asks the hooks of this process, in registration
  order, to free the shortfall, then tries once more. Training's hook drops its idle jobs (not in a round), idlest
  first, never the job asking; serving registers none: a serving stage is in use as long as it is held, until its
  ServeRelease. So a serving (or any other) program's reservation makes idle training jobs give way, and so do a
  new training job and a round's activations (idle stages of finished jobs stay held until then).
* Only this process's hooks are asked: a reservation held by another process on the node (another worker service)
  is never taken away; it counts against the budget until its holder releases it or dies.
* Planners see it: statuses carry the bytes reserved on the node, and the serving coordinator plans a new job on
  each device's budget less them (``unreserved``), so it places stages where they fit beside the running jobs.

Mechanism: a JSON file in the node's health folder (``Settings.health_dir``, a per-user folder on the host where
services already stamp their heartbeats), named by node and hub, under an exclusive ``fcntl.flock`` on a lock file
beside it. Every service of the node in every process reads and rewrites it in one locked transaction. Chosen over a
ledger the node-agent owns (programs reserving by request to it): that would need new messages and a round trip on
every reservation, and a worker whose node-agent is down or restarting could not reserve at all; the file needs no
network exposure, no new topic and no other service running. The node-agent and the worker services only read it
to report the reserved bytes in their statuses (the cluster view takes the most any live service of the node
reports). Services of one node that run in separate containers (``compose.yaml`` gives each its own ``/tmp``) share
it only when one volume is mounted at the health folder for them; the stage-worker hosts every built-in program, so
one node's programs meet in one process today. One ``MemoryLedger`` object per node and file is kept per process
(``node_ledger``), so every program and worker service in a process shares it.

A crashed process's reservations do not leak: each holding carries its holder (a per-process id, host and pid) and
a lease that the holder renews while it holds anything (a thread, every ``LEASE_S / 3``); a holding whose lease ran
out, or whose holder is a process of this host that no longer exists, is dropped by the next transaction.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from edgeswarm.errors import MemoryBudgetError

if TYPE_CHECKING:
    from edgeswarm.messages.cluster import ClusterView
    from edgeswarm.values.profiles import ClusterProfile

log = logging.getLogger(__name__)

MIB = 1 << 20
LEASE_S = 30.0  # a holding not renewed for this long (its process died or hangs) is dropped
MAX_HOLDINGS = 1024  # holdings the file keeps; past it the oldest leases go first (a runaway holder's)

Key = tuple[str, str]  # (program, job id)
PartKey = tuple[str, str, str]  # (program, job id, part): one holding
# A pressure hook: (bytes needed, why, the job id asking in the hook's own program or None) -> bytes it freed.
PressureHook = Callable[[int, str, "str | None"], int]


class Holding(BaseModel):
    """One reservation: ``nbytes`` of the node's budget held by job ``job_id`` of ``program`` (its ``part``: "" the
    job's own holding) in process ``holder`` (``pid`` on ``host``) until ``lease_until`` (Unix seconds) unless
    renewed. ``what`` names it for people."""

    model_config = ConfigDict(extra="forbid")

    program: str = Field(max_length=64)
    job_id: str = Field(max_length=256)
    part: str = Field(default="", max_length=64)
    holder: str = Field(max_length=128)
    host: str = Field(max_length=255)
    pid: int
    service: str = Field(default="", max_length=64)
    nbytes: int = Field(ge=0)
    what: str = Field(max_length=512)
    lease_until: float

    @property
    def key(self) -> PartKey:
        return (self.program, self.job_id, self.part)

    @property
    def job(self) -> Key:
        return (self.program, self.job_id)


class LedgerFile(BaseModel):
    """The ledger file's content."""

    model_config = ConfigDict(extra="forbid")

    holdings: list[Holding] = Field(default_factory=list, max_length=MAX_HOLDINGS)


def ledger_path(health_dir: Path, node: str, hub_url: str) -> Path:
    """The ledger file of ``node`` on the hub at ``hub_url`` (two clusters on one host never share one)."""
    hub = hashlib.sha256(hub_url.encode()).hexdigest()[:12]
    return health_dir / f"memory-{node}-{hub}.json"


class MemoryLedger:
    """The memory reservations of one node (see the module's docstring). ``path`` None keeps them in this process
    only. ``budget_bytes`` is the device's memory budget; ``clock`` gives Unix seconds."""

    def __init__(self, node: str, budget_bytes: int, path: Path | None = None, *, lease_s: float = LEASE_S,
                 clock: Callable[[], float] = time.time, holder: str | None = None) -> None:
        self.node, self.budget_bytes, self.path, self.lease_s, self._clock = node, budget_bytes, path, lease_s, clock
        self.holder = holder or uuid.uuid4().hex[:12]
        self._host, self._pid = socket.gethostname(), os.getpid()
        self._lock = threading.RLock()  # this process's transactions, one at a time
        self._mine: dict[PartKey, Holding] = {}
        self._hooks: list[tuple[str, PressureHook]] = []
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None

    # --- programs -----------------------------------------------------------------------------------

    def on_pressure(self, program: str, hook: PressureHook) -> None:
        """Register ``program``'s pressure hook: asked to free bytes when a reservation does not fit."""
        with self._lock:
            self._hooks.append((program, hook))

    def off_pressure(self, hook: PressureHook) -> None:
        """Forget ``hook`` (its program closed)."""
        with self._lock:
            self._hooks = [(owner, h) for owner, h in self._hooks if h != hook]

    def reserve(self, program: str, job_id: str, nbytes: int, *, what: str, refusal: str = "",
                service: str = "", part: str = "") -> None:
        """Hold ``nbytes`` for job ``job_id`` of ``program`` (its ``part``; replacing what that holding held), asking
        the pressure hooks to free room when it does not fit. Raises MemoryBudgetError starting with ``refusal``
        (default: ``what`` needs so much) and naming the holders when it still does not."""
        holders = self._hold((program, job_id, part), nbytes, what,
                             lambda _old: self._holding(program, job_id, nbytes, what, service, part))
        if holders is None:
            return
        listing = "; ".join(f"{h.what} holds {h.nbytes / MIB:.1f} MiB"
                            for h in sorted(holders, key=lambda h: -h.nbytes))
        raise MemoryBudgetError(
            f"{refusal or f'{what} needs {nbytes / MIB:.1f} MiB'}, but {_total(holders) / MIB:.1f} MiB of the memory "
            f"budget of {self.budget_bytes / MIB:.1f} MiB on {self.node} are held by jobs that cannot give way: "
            f"{listing}")

    def grow(self, program: str, job_id: str, nbytes: int) -> bool:
        """Raise job ``job_id``'s holding to ``nbytes`` if that fits beside every other holding, asking the pressure
        hooks to free the shortfall first (never from ``job_id`` itself: its caller is in the middle of its work);
        whether it did. A job holding nothing gets a holding."""
        what = f"{program} job {job_id}"

        def raised(old: Holding | None) -> Holding:
            return (old.model_copy(update={"nbytes": max(nbytes, old.nbytes)}) if old else
                    self._holding(program, job_id, nbytes, what, ""))

        return self._hold((program, job_id, ""), nbytes, what, raised) is None

    def _hold(self, key: PartKey, nbytes: int, what: str, make: Callable[[Holding | None], Holding]
              ) -> list[Holding] | None:
        """Set holding ``key`` to ``make(its old holding)`` if ``nbytes`` fit beside every other holding, asking the
        pressure hooks once for the shortfall when they do not: None when it is held, else the other holdings."""
        for attempt in range(2):
            with self._transaction() as others:
                used = _total(others) + _total(h for k, h in self._mine.items() if k != key)
                if used + nbytes <= self.budget_bytes:
                    self._mine[key] = make(self._mine.get(key))
                    return None
                holders = [h for h in (*others, *self._mine.values()) if h.key != key]
            if attempt == 0 and self._relieve(used + nbytes - self.budget_bytes, key[0], key[1], what) == 0:
                break
        return holders

    def release(self, program: str, job_id: str, part: str | None = None) -> None:
        """Give back what job ``job_id`` of ``program`` holds: its ``part``, or (None) its own holding and every part
        (nothing when it holds nothing)."""
        with self._lock:
            keys = [k for k in self._mine if k[:2] == (program, job_id) and part in (None, k[2])]
            if not keys:
                return
            with self._transaction():
                for key in keys:
                    self._mine.pop(key, None)

    def held_by(self, program: str, job_id: str) -> int:
        """The bytes job ``job_id`` of ``program`` holds in this process (its own holding; not its parts)."""
        with self._lock:
            held = self._mine.get((program, job_id, ""))
            return held.nbytes if held else 0

    def reserved_bytes(self, exclude: Key | None = None) -> int:
        """The bytes every live holding on the node holds, less ``exclude``'s (the job's, parts and all)."""
        return _total(h for h in self.holdings() if h.job != exclude or h.holder != self.holder)

    def holdings(self) -> list[Holding]:
        """Every live holding on the node (other processes' too), this process's last. Only reads the file."""
        with self._transaction(write=False) as others:
            return [*others, *self._mine.values()]

    def close(self) -> None:
        """Release everything this process holds and stop renewing."""
        self._stop.set()
        with self._lock:
            if self._mine:
                with self._transaction():
                    self._mine.clear()

    # --- the file -----------------------------------------------------------------------------------

    def _holding(self, program: str, job_id: str, nbytes: int, what: str, service: str, part: str = "") -> Holding:
        if self.path is not None and self._renewer is None:
            self._renewer = threading.Thread(target=self._renew, name="ledger-lease", daemon=True)
            self._renewer.start()
        return Holding(program=program, job_id=job_id[:256], part=part[:64], holder=self.holder, host=self._host,
                       pid=self._pid, service=service, nbytes=nbytes, what=what[:512],
                       lease_until=self._clock() + self.lease_s)

    def _relieve(self, need: int, program: str, job_id: str, what: str) -> int:
        """Ask the pressure hooks to free ``need`` bytes for ``what``; returns the bytes they freed."""
        with self._lock:
            hooks = list(self._hooks)
        freed = 0
        for owner, hook in hooks:
            if freed >= need:
                break
            try:
                freed += hook(need - freed, f"{what} needs the memory", job_id if owner == program else None)
            except Exception:  # noqa: BLE001 - a broken hook must not break every program's reservations
                log.exception("the memory pressure hook of %s failed", owner)
        return freed

    @contextlib.contextmanager
    def _transaction(self, write: bool = True) -> Iterator[list[Holding]]:
        """Hold the ledger (this process's lock, and the file's), yielding the live holdings of other processes;
        on leaving, write them back with this process's own, renewed (unless ``write`` is False: a look only)."""
        with self._lock:
            if self.path is None:
                yield []
                return
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path.with_suffix(".lock"), "a") as lock_file:
                fcntl.flock(lock_file, fcntl.LOCK_EX)
                try:
                    others = self._read()
                    yield others
                    if not write:
                        return
                    now = self._clock()
                    for key, held in self._mine.items():
                        self._mine[key] = held.model_copy(update={"lease_until": now + self.lease_s})
                    self._write([*others, *self._mine.values()])
                finally:
                    fcntl.flock(lock_file, fcntl.LOCK_UN)

    def _read(self) -> list[Holding]:
        assert self.path is not None
        try:
            content = LedgerFile.model_validate_json(self.path.read_bytes())
        except FileNotFoundError:
            return []
        except (ValidationError, OSError) as exc:
            log.error("the memory ledger %s is unreadable; starting it afresh: %s", self.path, exc)
            return []
        now = self._clock()
        return [h for h in content.holdings if h.holder != self.holder and h.lease_until > now and self._alive(h)]

    def _alive(self, held: Holding) -> bool:
        """Whether ``held``'s process may still exist (only a process of this host can be looked up)."""
        if held.host != self._host:
            return True
        try:
            os.kill(held.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True

    def _write(self, holdings: list[Holding]) -> None:
        assert self.path is not None
        holdings = sorted(holdings, key=lambda h: h.lease_until)[-MAX_HOLDINGS:]
        tmp = self.path.with_suffix(f".{self._pid}.tmp")
        tmp.write_text(LedgerFile(holdings=holdings).model_dump_json())
        os.replace(tmp, self.path)

    def _renew(self) -> None:
        while not self._stop.wait(self.lease_s / 3):
            try:
                with self._lock:
                    if self._mine:
                        with self._transaction():
                            pass
            except OSError as exc:
                log.error("renewing the memory ledger's leases failed: %s", exc)


def _total(holdings: object) -> int:
    return sum(h.nbytes for h in holdings)  # type: ignore[attr-defined]


_ledgers: dict[tuple[str, Path | None], MemoryLedger] = {}
_ledgers_lock = threading.Lock()


def node_ledger(node: str, budget_bytes: int, path: Path | None) -> MemoryLedger:
    """This process's ledger of ``node`` kept in ``path``: one object per node and file, shared by every program and
    worker service of the process."""
    with _ledgers_lock:
        ledger = _ledgers.get((node, path))
        if ledger is None or ledger._stop.is_set():
            ledger = _ledgers[(node, path)] = MemoryLedger(node, budget_bytes, path)
        return ledger


def read_reserved(path: Path) -> tuple[int, list[Holding]]:
    """The bytes reserved on a node and its live holdings, read from its ledger file (for status): 0 and none when
    there is no file."""
    reader = MemoryLedger("", 0, path, holder="reader")
    held = reader.holdings()
    return _total(held), held


def unreserved(cluster: ClusterProfile, view: ClusterView) -> ClusterProfile:
    """``cluster`` with each device's memory budget less what its node's ledger holds for other jobs (``view``'s
    ``reserved_memory_bytes``), so a plan places stages where they fit beside the jobs already running: a new job's
    plan, made before it holds anything, sees every other job's memory taken."""
    reserved = {n.node: n.reserved_memory_bytes for n in view.nodes}
    devices = [e.model_copy(update={"device": e.device.model_copy(update={
        "memory_budget_bytes": max(0, e.device.memory_budget_bytes - reserved.get(e.device.node, 0))})})
        for e in cluster.devices]
    return cluster.model_copy(update={"devices": devices})
