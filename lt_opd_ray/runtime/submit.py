"""`lt-opd submit`: Ray's job SDK around `lt-opd train JOB`."""

from __future__ import annotations

import os
import shlex
import time
from pathlib import Path

import yaml

from lt_opd_ray.core.redact import redact

TERMINAL = {"SUCCEEDED", "FAILED", "STOPPED"}


class ClusterRefusedError(Exception):
    """The cluster's job API refused the request: its token auth is on and the token sent was missing or wrong."""


def submit(job_path: str, address: str | None, runtime_env_path: str, working_dir: str, train_args: list[str], wait: bool = True) -> int:
    """Ray's client sends the cluster's token where RAY_AUTH_MODE=token (from RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or
    ~/.ray/auth_token); a cluster that refuses it raises ClusterRefusedError, saying how to pass it."""
    from ray.exceptions import AuthenticationError
    from ray.job_submission import JobSubmissionClient

    address = address or os.environ.get("RAY_ADDRESS") or "http://127.0.0.1:8265"
    runtime_env = yaml.safe_load(Path(runtime_env_path).read_text()) or {} if Path(runtime_env_path).exists() else {}
    runtime_env = {**runtime_env, "working_dir": working_dir}
    entrypoint = shlex.join(["lt-opd", "train", job_path, *train_args])
    try:
        client = JobSubmissionClient(address)
        job_id = client.submit_job(entrypoint=entrypoint, runtime_env=runtime_env)
    except AuthenticationError as exc:
        reason = str(exc).strip().splitlines()[0]
        raise ClusterRefusedError(
            f"the cluster at {redact(address)} refused the job ({reason}): it takes jobs with its token only; set RAY_AUTH_MODE=token "
            "and give the token in ~/.ray/auth_token, a file named by RAY_AUTH_TOKEN_PATH, or RAY_AUTH_TOKEN "
            '(docs/operating.md, "Security")'
        ) from None
    print(redact(f"submitted {job_id}: {entrypoint}"))
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
