"""One run per folder: the lock beside the run folder, refused while its holder lives, taken over when it is dead
(its local Ray cluster's processes stopped first), or when another host's holder stopped beating."""

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from lt_opd_ray.runtime.run_lock import STALE_S, RunLock, RunLockedError

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
    lock = RunLock.acquire(folder, "after the kill")  # same host, the pid gone: taken over at once
    assert json.loads(lock.path.read_text())["pid"] == os.getpid()
    lock.release()
    assert not lock.path.exists()


def test_taking_over_stops_the_dead_drivers_ray_processes_and_only_those(tmp_path):
    """Recorded as (pid, start time): a process still running under that pid since that time is the dead run's and is
    stopped; a pid now running another process (reused: its start time differs) is left alone."""
    from lt_opd_ray.runtime.run_lock import _start_time

    folder = tmp_path / "run"
    leftover = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        time.sleep(0.2)
        dead_pid = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True).stdout.strip()
        record = {"host": socket.gethostname(), "pid": int(dead_pid), "started": "0",
                  "ray_processes": [[leftover.pid, _start_time(leftover.pid)], [bystander.pid, "1"]]}
        (tmp_path / ".run.lock").write_text(json.dumps(record))
        RunLock.acquire(folder, "resume").release()
        assert leftover.wait(timeout=10) == -9
        assert bystander.poll() is None
    finally:
        for process in (leftover, bystander):
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
    import threading

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

    def another_host_writes_meanwhile():
        time.sleep(0.2)
        path.write_text(json.dumps({"host": "elsewhere", "pid": 7, "purpose": "lt-opd train racer", "token": "theirs", "beat": time.time()}))

    racer = threading.Thread(target=another_host_writes_meanwhile)
    racer.start()
    with pytest.raises(RunLockedError, match=r"\(lt-opd train racer, pid 7 on elsewhere"):
        RemoteLease.acquire(host("host-b"), "loser")
    racer.join()
