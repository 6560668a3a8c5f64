"""`lt-opd submit`: Ray's job SDK around `lt-opd train JOB`."""

from __future__ import annotations

import os
import shlex
import time
from pathlib import Path

import yaml

TERMINAL = {"SUCCEEDED", "FAILED", "STOPPED"}


def submit(job_path: str, address: str | None, runtime_env_path: str, working_dir: str, train_args: list[str], wait: bool = True) -> int:
    from ray.job_submission import JobSubmissionClient

    address = address or os.environ.get("RAY_ADDRESS") or "http://127.0.0.1:8265"
    runtime_env = yaml.safe_load(Path(runtime_env_path).read_text()) or {} if Path(runtime_env_path).exists() else {}
    runtime_env = {**runtime_env, "working_dir": working_dir}
    entrypoint = shlex.join(["lt-opd", "train", job_path, *train_args])
    client = JobSubmissionClient(address)
    job_id = client.submit_job(entrypoint=entrypoint, runtime_env=runtime_env)
    print(f"submitted {job_id}: {entrypoint}")
    if not wait:
        return 0
    shown = 0
    while True:
        status = client.get_job_status(job_id)
        logs = client.get_job_logs(job_id)
        print(logs[shown:], end="", flush=True)
        shown = len(logs)
        if str(status.value if hasattr(status, "value") else status) in TERMINAL:
            print(f"\n{job_id}: {status}")
            return 0 if str(status.value if hasattr(status, "value") else status) == "SUCCEEDED" else 1
        time.sleep(1.0)
