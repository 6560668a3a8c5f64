"""One run per folder: the driver holds `.<name>.lock` beside its run folder `<name>` from its first step to its
last (beside it, not in it: `--force` moves an earlier run's folder aside under the lock).

The lock is created atomically (O_CREAT | O_EXCL) and names its holder: host, pid, the process's start time (so a
reused pid is not mistaken for the holder) and, once its local Ray cluster is up, that cluster's session folder and
process ids. A driver refreshes the file's mtime every HEARTBEAT_S. A lock whose holder is gone is taken over: on the
same host when the pid no longer runs that process, from any host when the heartbeat is older than STALE_S. A killed
driver's local Ray cluster outlives it by a minute or more (its dashboard agent holding the metrics port), so the run
that takes over its lock stops those processes first. Anyone who can write the parent folder can write a lock, so a
listed pid is stopped only where the process proves it is that cluster's: it runs as this user since the recorded
start time, and its command line or one of its open files is in the recorded session folder, which Ray names after
the process that started it (`session_<time>_<pid>`: the dead holder, whose pid must no longer run); the lock file
and the session folder belong to this user. Any other listed pid is left alone, with a warning that says why.

A run folder at a URI (`s3://...`) is written from a staging folder on each host, so a lock there guards only one host:
`RemoteLease` holds `.<name>.lock.json` beside the folder in the store itself, refreshed every HEARTBEAT_S and taken
over once STALE_S old (at once on the holder's host when its process is gone). Object stores create nothing atomically: the lease is written, then read back after RACE_S,
and the run whose lease is not the one read back stands down (stores with read-after-write consistency, as S3, GCS
and Azure are, resolve two starts this way unless one's read and write are more than RACE_S apart).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import tempfile
import threading
import time
import warnings
from pathlib import Path

HEARTBEAT_S = 10.0
STALE_S = 60.0  # six missed heartbeats
RACE_S = 2.0  # a lease written to a store is read back after this long
STOP_WAIT_S = 10.0  # a dead run's Ray processes, SIGKILLed, are waited for this long at most


class RunLockedError(RuntimeError):
    """Another live run holds the folder."""


def _stat(path: str | Path) -> list[str]:
    """A /proc `stat` file's fields after the command name: [0] the state, [1] the parent, [6] the flags, [19] the
    start time (OSError where it cannot be read)."""
    return Path(path).read_text().rsplit(")", 1)[1].split()


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (Linux), None where it does not run or cannot be read."""
    try:
        return _stat(f"/proc/{pid}/stat")[19]
    except (OSError, IndexError):
        return None


def _runs(pid: int) -> bool:
    """One of the process's threads has not exited. A zombie (exited, not yet reaped) holds no port, but a killed
    process's first thread turns zombie while the others still unwind, and the last of them closes its files (its
    ports): each thread is read."""
    try:
        threads = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return False
    for thread in threads:
        try:
            if _stat(f"/proc/{pid}/task/{thread}/stat")[0] not in ("Z", "X"):
                return True
        except (OSError, IndexError):
            continue  # exited since it was listed
    return False


def _exiting(pid: int) -> bool:
    """A process of this user that is ending: its first thread has exited (a zombie), or its memory is released (an
    empty command line, which a running user process never has; kernel threads, which always have one, are not)."""
    PF_KTHREAD = 0x00200000
    try:
        fields = _stat(f"/proc/{pid}/stat")
        if os.stat(f"/proc/{pid}").st_uid != os.getuid() or int(fields[6]) & PF_KTHREAD:
            return False
        return fields[0] in ("Z", "X") or Path(f"/proc/{pid}/cmdline").read_bytes() == b""
    except (OSError, IndexError, ValueError):
        return False


def _alive(pid: int, started: str | None) -> bool:
    if started is not None and Path("/proc").is_dir():
        return _start_time(pid) == started
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class RunLock:
    def __init__(self, folder: Path, record: dict):
        self.folder = Path(folder)
        self.path = self.folder.parent / f".{self.folder.name}.lock"
        self.record = record
        self._stop = threading.Event()
        self._beat = threading.Thread(target=self._heartbeat, name="run-lock-heartbeat", daemon=True)

    @classmethod
    def acquire(cls, folder: str | Path, purpose: str) -> RunLock:
        """Hold `folder` for this process, taking over a dead holder's lock; RunLockedError naming a live one."""
        folder = Path(folder).resolve()
        folder.parent.mkdir(parents=True, exist_ok=True)
        pid = os.getpid()
        record = {"host": socket.gethostname(), "pid": pid, "started": _start_time(pid), "purpose": purpose,
                  "since": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "ray_processes": []}
        lock = cls(folder, record)
        for _ in range(3):  # a dead holder's lock is removed, then the create is tried again
            try:
                handle = os.open(lock.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                lock._take_over_if_dead()
                continue
            with os.fdopen(handle, "w") as out:
                json.dump(record, out)
            lock._beat.start()
            return lock
        raise RunLockedError(f"{lock.path}: could not be claimed (another run keeps creating it)")

    def _take_over_if_dead(self) -> None:
        try:
            held = json.loads(self.path.read_text())
            age = time.time() - self.path.stat().st_mtime
        except FileNotFoundError:
            return  # released meanwhile
        except (OSError, ValueError):
            held, age = {}, STALE_S + 1  # a lock cut short as it was written: judged by age alone
        same_host = held.get("host") == socket.gethostname()
        if same_host and isinstance(held.get("pid"), int):
            dead = not _alive(held["pid"], held.get("started"))
        else:
            dead = age > STALE_S
        if not dead:
            where = f"pid {held.get('pid')} on {held.get('host')}" if held else "another process"
            raise RunLockedError(
                f"{self.folder} is in use by another run ({held.get('purpose', 'lt-opd')}, {where}, since {held.get('since', '?')}):"
                " one run per folder; wait for it, stop it, or set checkpoint.dir to another folder"
            )
        if same_host:
            self._stop_ray_of(held)
        self.path.unlink(missing_ok=True)

    def _stop_ray_of(self, held: dict) -> None:
        """The dead driver's local Ray cluster: each recorded process that proves it is that cluster's (see the
        module) is SIGKILLed, and waited for, so its ports are free for this run. A recorded process of this user
        already exiting (the node processes die with the driver) can no longer prove it, its command line and files
        gone: where the lock and session are trusted, it is waited for, not signalled."""
        session = held.get("ray_session")
        if not isinstance(session, str) or not Path(session).name.startswith("session_") or not session.endswith(f"_{held.get('pid')}"):
            session = None  # not a session folder the dead holder started: no process can prove it belongs to it
        elif _runs(held["pid"]) or not _owned_by_me(self.path) or not _owned_by_me(Path(session)):
            session = None  # its driver lives (a lock claiming otherwise lies), or the lock or the session is another user's
        alive, exiting = {}, {}
        for entry in held.get("ray_processes") or []:
            pid, started = entry if isinstance(entry, list) and len(entry) == 2 else (None, None)
            if not isinstance(pid, int) or not isinstance(started, str) or _start_time(pid) != started:
                continue  # gone, or the pid now runs another process
            if session is not None and _exiting(pid):
                exiting[pid] = started
            elif session is not None and _in_session(pid, session):
                alive[pid] = started
            else:
                warnings.warn(f"{self.path} names pid {pid}, which is not a process of the dead run's Ray cluster "
                              f"(session {session or 'not recorded'}): left running", stacklevel=2)
        for pid in alive:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        waited = {**alive, **exiting}
        running = lambda: [pid for pid, started in waited.items() if _start_time(pid) == started and _runs(pid)]  # noqa: E731
        deadline = time.monotonic() + STOP_WAIT_S
        while running() and time.monotonic() < deadline:
            time.sleep(0.1)
        if still := running():
            warnings.warn(f"the dead run's Ray processes {still} (session {session}) still run {STOP_WAIT_S:.0f} s after"
                          " SIGKILL: a port they hold stays taken until they end", stacklevel=2)

    def record_ray(self) -> None:
        """Add this process's local Ray cluster to the lock, for a successor: the node's processes (GCS, raylet,
        monitors) and their children now (the dashboard agent, which holds the metrics port and outlives a killed
        raylet by a minute), each with its start time."""
        import ray

        node = getattr(ray._private.worker, "_global_node", None)  # set only where this process started the cluster
        if node is None:
            return
        pids = [info.process.pid for infos in node.all_processes.values() for info in infos if info.process is not None]
        self.record["ray_session"] = node.get_session_dir_path()
        self.record["ray_processes"] = [[pid, started] for pid in pids + _children(pids) if (started := _start_time(pid)) is not None]
        handle, staged = tempfile.mkstemp(prefix=self.path.name, suffix=".tmp", dir=self.path.parent)  # a new file: never a planted link
        with os.fdopen(handle, "w") as out:
            json.dump(self.record, out)
        os.chmod(staged, 0o644)
        os.replace(staged, self.path)

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                os.utime(self.path)
            except OSError:
                return

    def release(self) -> None:
        self._stop.set()
        try:
            if json.loads(self.path.read_text()).get("pid") == os.getpid():
                self.path.unlink()
        except (OSError, ValueError):
            pass


class RemoteLease:
    """One run per URI folder across hosts: `.<name>.lock.json` beside the folder in the store (see the module)."""

    def __init__(self, storage, record: dict):
        from pathlib import PurePosixPath

        self.storage = storage
        base = PurePosixPath(storage.base)
        self.path = str(base.parent / f".{base.name}.lock.json")
        self.where = storage.describe()
        self.record = {**record, "token": f"{record['host']}:{record['pid']}:{time.time_ns()}"}
        self._stop = threading.Event()
        self._beat = threading.Thread(target=self._heartbeat, name="run-lease-heartbeat", daemon=True)

    @classmethod
    def acquire(cls, storage, purpose: str) -> RemoteLease:
        """Hold the URI folder of `storage` (a RunStorage) for this process; RunLockedError naming a live holder."""
        pid = os.getpid()
        lease = cls(storage, {"host": socket.gethostname(), "pid": pid, "started": _start_time(pid), "purpose": purpose,
                              "since": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
        held = lease._read()
        if held is not None and lease._holder_lives(held):
            raise lease._in_use(held)
        lease._write()
        time.sleep(RACE_S)
        held = lease._read()
        if held is None or held.get("token") != lease.record["token"]:
            raise lease._in_use(held or {})
        lease._beat.start()
        return lease

    @staticmethod
    def _holder_lives(held: dict) -> bool:
        """On this host: its process runs (a killed driver's lease is taken over at once); elsewhere: it beats."""
        if held.get("host") == socket.gethostname() and isinstance(held.get("pid"), int):
            return _alive(held["pid"], held.get("started"))
        return time.time() - held.get("beat", 0.0) <= STALE_S

    def _in_use(self, held: dict) -> RunLockedError:
        return RunLockedError(
            f"{self.where} is in use by another run ({held.get('purpose', 'lt-opd')}, pid {held.get('pid')} on {held.get('host')},"
            f" since {held.get('since', '?')}): one run per folder; wait for it, stop it, or set checkpoint.dir to another folder"
        )

    def _read(self) -> dict | None:
        try:
            with self.storage.fs.open_input_stream(self.path) as stream:
                return json.loads(stream.read().decode())
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return {"beat": 0.0}  # unreadable: judged stale

    def _write(self) -> None:
        self.record["beat"] = time.time()
        with self.storage.fs.open_output_stream(self.path) as stream:
            stream.write(json.dumps(self.record).encode())

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                self._write()
            except OSError:
                return

    def release(self) -> None:
        self._stop.set()
        if self._beat.is_alive():
            self._beat.join()  # no beat rewrites the lease after it is deleted
        try:
            if (self._read() or {}).get("token") == self.record["token"]:
                self.storage.fs.delete_file(self.path)
        except OSError:
            pass


def _in_session(pid: int, session: str) -> bool:
    """The process runs as this user and names the Ray session folder `session` in an argument or an open file (Ray's
    node processes take it on their command lines; its agents, which rename themselves, hold its log files open)."""
    inside = lambda path: path == session or path.startswith(session + "/")  # noqa: E731
    try:
        if os.stat(f"/proc/{pid}").st_uid != os.getuid():
            return False
        arguments = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
        if any(inside(argument.split("=", 1)[-1]) for argument in arguments):
            return True
        return any(inside(_link(f"/proc/{pid}/fd/{fd}")) for fd in os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return False


def _owned_by_me(path: Path) -> bool:
    try:
        return path.lstat().st_uid == os.getuid()
    except OSError:
        return False


def _link(path: str) -> str:
    try:
        return os.readlink(path)
    except OSError:  # closed since it was listed
        return ""


def _children(parents: list[int]) -> list[int]:
    """The processes whose parent is one of `parents` (Linux /proc; none elsewhere)."""
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            if int(_stat(entry / "stat")[1]) in parents:
                found.append(int(entry.name))
        except (OSError, ValueError, IndexError):
            continue
    return found
