"""One run per folder: the lock beside the run folder, refused while its holder lives, taken over when it is dead
(its local Ray cluster's processes stopped first), or when another host's holder stopped beating."""

import json
from pathlib import Path
import os
import socket
import subprocess
import sys
import time

import pytest
from conftest import wait_until

from lt_opd_ray.runtime.run_lock import STALE_S, RunLock, RunLockedError


def running_its_command(process: subprocess.Popen) -> bool:
    """The child has exec'd its own command line (the lock recognises a Ray process by it), not still the fork of pytest."""
    return b"time.sleep(120)" in Path(f"/proc/{process.pid}/cmdline").read_bytes()


HOLD = "import sys, time; from lt_opd_ray.runtime.run_lock import RunLock; RunLock.acquire(sys.argv[1], 'holder'); print('held', flush=True); time.sleep(120)"


def test_a_live_holder_is_named_and_a_dead_one_is_taken_over(tmp_path):
    folder = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(folder)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunLockedError, match=rf"{folder} is in use by another run \(holder, pid {holder.pid} on "):
            RunLock.acquire(folder, "second")
    finally:
        holder.kill()
        holder.wait()
        holder.stdout.close()
    lock = RunLock.acquire(folder, "after the kill")  # same host, the pid gone: taken over at once
    assert json.loads(lock.path.read_text())["pid"] == os.getpid()
    lock.release()
    assert not lock.path.exists()


def test_taking_over_stops_the_dead_drivers_ray_processes_and_only_those(tmp_path):
    """A listed process is stopped only where it proves it is the dead run's Ray cluster: the recorded start time, and
    the recorded session folder (named after the dead driver's pid, as Ray names it) in its command line (Ray's node
    processes) or among its open files (its agents). A process the lock merely lists, as a planted lock would list
    one, is left running with a warning saying why; so is a pid now running another process, and every listed pid when
    the session folder is not one the dead driver started."""
    from lt_opd_ray.runtime.run_lock import _start_time

    folder = tmp_path / "run"
    dead_pid = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True).stdout)
    session = tmp_path / "ray" / f"session_2026-12-05_02-48-46_055166_{dead_pid}"
    (session / "logs").mkdir(parents=True)
    sleep = [sys.executable, "-c", "import time; time.sleep(120)"]
    node_process = subprocess.Popen([*sleep, f"--session-dir={session}"])  # as gcs_server, raylet, log_monitor
    with open(session / "logs" / "raylet.out", "w") as log:
        agent = subprocess.Popen(sleep, stdout=log)  # as the dashboard agent: its log open, its command line its own
    unrelated = subprocess.Popen(sleep)  # the user's own process, named by the lock
    reused = subprocess.Popen([*sleep, f"--session-dir={session}"])  # its pid recorded with another start time
    processes = (node_process, agent, unrelated, reused)
    try:
        assert wait_until(lambda: all(running_its_command(p) for p in processes))
        listed = [[p.pid, _start_time(p.pid)] for p in (node_process, agent, unrelated)] + [[reused.pid, "1"]]

        def take_over(session_folder: str, holder: int = dead_pid) -> list:
            record = {"host": socket.gethostname(), "pid": holder, "started": "0", "ray_session": session_folder, "ray_processes": listed}
            (tmp_path / ".run.lock").write_text(json.dumps(record))
            with pytest.warns(UserWarning) as warned:
                RunLock.acquire(folder, "resume").release()
            return [str(w.message) for w in warned]

        # a session folder another process started (a planted lock naming a live run's cluster): nothing is stopped
        other = str(session.with_name(f"session_2026-12-05_02-48-46_055166_{os.getpid()}"))
        assert len(take_over(other)) == 3 and all(p.poll() is None for p in processes)
        # a lock naming a live driver (its start time wrong, so the lock looks abandoned) and that driver's own session:
        # the session's driver runs, so nothing of its cluster is stopped
        Path(other).mkdir()
        live_run = subprocess.Popen([*sleep, f"--session-dir={other}"])  # a process of the live driver's cluster
        processes += (live_run,)
        assert wait_until(lambda: running_its_command(live_run))
        listed.append([live_run.pid, _start_time(live_run.pid)])
        assert len(take_over(other, holder=os.getpid())) == 4 and all(p.poll() is None for p in processes)
        listed.pop()
        (message,) = take_over(str(session))
        assert message == (f"{tmp_path / '.run.lock'} names pid {unrelated.pid}, which is not a process of the dead run's Ray "
                           f"cluster (session {session}): left running")
        assert node_process.wait(timeout=10) == -9 and agent.wait(timeout=10) == -9
        assert unrelated.poll() is None and reused.poll() is None
    finally:
        for process in processes:
            process.kill()
            process.wait()


def test_another_hosts_lock_holds_while_it_beats_and_is_taken_over_once_stale(tmp_path):
    folder = tmp_path / "run"
    path = tmp_path / ".run.lock"
    path.write_text(json.dumps({"host": "elsewhere", "pid": 1, "purpose": "lt-opd train big", "since": "then"}))
    with pytest.raises(RunLockedError, match="pid 1 on elsewhere"):
        RunLock.acquire(folder, "here")
    old = time.time() - STALE_S - 5
    os.utime(path, (old, old))
    RunLock.acquire(folder, "here").release()


def test_a_uri_folder_is_held_across_hosts_by_a_lease_in_the_store(tmp_path, monkeypatch):
    """Two hosts stage one `file://` folder in their own staging folders (a local lock each): the lease beside the
    folder in the store refuses the second while the first beats, is removed on release, is taken over once stale,
    a killed driver's (this host, pid gone) at once, and of two written within RACE_S the one read back holds."""
    import lt_opd_ray.runtime.run_lock as run_lock
    from lt_opd_ray.core.storage import RunStorage
    from lt_opd_ray.runtime.run_lock import RemoteLease

    monkeypatch.setattr(run_lock, "RACE_S", 0.5)
    (tmp_path / "store").mkdir()
    uri, path = f"file://{tmp_path}/store/run", tmp_path / "store" / ".run.lock.json"
    host = lambda name: RunStorage(uri, tmp_path / name)  # noqa: E731
    first = RemoteLease.acquire(host("host-a"), "lt-opd train big")
    with pytest.raises(RunLockedError, match=rf"store/run is in use by another run \(lt-opd train big, pid {os.getpid()} on "):
        RemoteLease.acquire(host("host-b"), "second")
    first.release()
    assert not path.exists()

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True).stdout.strip()
    path.write_text(json.dumps({"host": socket.gethostname(), "pid": int(dead), "token": "killed", "beat": time.time()}))
    RemoteLease.acquire(host("host-a"), "resume after a kill").release()  # this host, its pid gone: beating or not

    path.write_text(json.dumps({"host": "elsewhere", "pid": 1, "token": "theirs", "beat": time.time() - STALE_S - 5}))
    RemoteLease.acquire(host("host-b"), "after a stale holder").release()

    class AnotherHostWritesMeanwhile:
        """run_lock's clock, but its wait of RACE_S is when another host's lease lands (after this one's write)."""

        def __getattr__(self, name):
            return getattr(time, name)

        def sleep(self, seconds):
            assert seconds == run_lock.RACE_S and json.loads(path.read_text())["purpose"] == "loser"
            path.write_text(json.dumps({"host": "elsewhere", "pid": 7, "purpose": "lt-opd train racer", "token": "theirs", "beat": time.time()}))

    monkeypatch.setattr(run_lock, "time", AnotherHostWritesMeanwhile())
    with pytest.raises(RunLockedError, match=r"\(lt-opd train racer, pid 7 on elsewhere"):
        RemoteLease.acquire(host("host-b"), "loser")


def test_a_recorded_process_still_exiting_is_waited_for_until_its_last_thread_closes_its_port(tmp_path, monkeypatch):
    """A run that takes over a moment after the kill finds the dead cluster's processes exiting: the first thread of
    each a zombie, its command line and files no longer readable (nothing proves it is the cluster's), while its other
    threads unwind and the last one closes its sockets. Where the lock and its session are trusted, the take-over waits
    for such a process without a warning and returns once its port is free; a lock whose session the dead driver did
    not start (planted) gets a warning and no wait."""
    import warnings

    from lt_opd_ray.runtime import run_lock
    from lt_opd_ray.runtime.run_lock import _start_time

    folder = tmp_path / "run"
    dead_pid = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True).stdout)
    session = tmp_path / "ray" / f"session_2026-12-07_00-20-00_000000_{dead_pid}"
    session.mkdir(parents=True)
    # the first thread exits at once; the second holds the port until told, then a second more (exit_group: all closed)
    exits_last = ("import ctypes, os, socket, sys, threading, time; listener = socket.create_server(('127.0.0.1', 0));"
                  " print(listener.getsockname()[1], flush=True);"
                  " threading.Thread(target=lambda: (sys.stdin.readline(), time.sleep(1.0), os._exit(0))).start();"
                  " ctypes.CDLL(None).pthread_exit(None)")

    def take_over(session_folder: Path) -> list[str]:
        record = {"host": socket.gethostname(), "pid": dead_pid, "started": "0", "ray_session": str(session_folder),
                  "ray_processes": [[process.pid, _start_time(process.pid)]]}
        (tmp_path / ".run.lock").write_text(json.dumps(record))
        with warnings.catch_warnings(record=True) as warned:
            warnings.simplefilter("always")
            RunLock.acquire(folder, "resume").release()
        return [str(w.message) for w in warned]

    with subprocess.Popen([sys.executable, "-c", exits_last], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) as process:
        try:
            port = int(process.stdout.readline())
            state = lambda: Path(f"/proc/{process.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]  # noqa: E731
            assert wait_until(lambda: state() == "Z")  # its first thread gone, its second holding the port
            assert Path(f"/proc/{process.pid}/cmdline").read_bytes() == b""  # nothing left to prove whose it is
            planted = session.with_name(f"session_2026-12-07_00-20-00_000000_{os.getpid()}")
            assert take_over(planted) == [f"{tmp_path / '.run.lock'} names pid {process.pid}, which is not a process of the"
                                          f" dead run's Ray cluster (session not recorded): left running"]
            first_answer = []
            runs = run_lock._runs

            def runs_then_let_it_end(pid: int) -> bool:
                """The wait's own check; its first on the process tells it to end (in a second)."""
                answer = runs(pid)
                if pid == process.pid and not first_answer:
                    first_answer.append(answer)
                    process.stdin.write("end\n")
                    process.stdin.flush()
                return answer

            monkeypatch.setattr(run_lock, "_runs", runs_then_let_it_end)
            assert take_over(session) == []
            assert first_answer == [True]  # the wait began while its last thread held the port
            socket.create_server(("127.0.0.1", port)).close()  # free the moment the take-over returns
            assert process.wait(timeout=10) == 0
        finally:
            process.kill()
