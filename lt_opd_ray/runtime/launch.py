"""Start (or join) a Ray cluster and run a job through the driver, with one line per step and a progress bar."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from lt_opd_ray.config.schema import JobConfig
from lt_opd_ray.core.storage import RUN_RECORD, RunStorage
from lt_opd_ray.runtime.resources import check_export_port, check_local_machine, machine_cpus
from lt_opd_ray.runtime.run_lock import RemoteLease, RunLock
from lt_opd_ray.runtime.waits import NoAnswerError, RoleDiedError

if TYPE_CHECKING:
    from lt_opd_ray.runtime.roles import Roles

# Passed to every actor: near-zero-copy torch tensors through the object store, quiet transformers.
WORKER_ENV = {"RAY_ENABLE_ZERO_COPY_TORCH_TENSORS": "1", "TRANSFORMERS_VERBOSITY": "error", "TOKENIZERS_PARALLELISM": "false"}
# A local run's learners and workers share one machine: gloo's data sockets (learner collectives, weight broadcast)
# bind the loopback interface. On a cluster, set GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME in the job's runtime
# env to the private network's interface (docs/operating.md, "Network exposure").
LOCAL_ENV = {"GLOO_SOCKET_IFNAME": "lo"} if sys.platform == "linux" else {}
WORKER_SETUP_HOOK = "lt_opd_ray.core.redact.redact_worker_output"  # every worker's output without credentials


def init_ray(job: JobConfig, address: str | None = None) -> None:
    """Join the cluster in RAY_ADDRESS / `address` (as under `ray job submit`), else start a local one.

    A local cluster declares this machine's CPUs, and a job whose pools reserve more is refused before it starts
    (InsufficientResourcesError naming the shortfall), as is one whose metrics port another program holds; the laptop
    jobs reserve fractions of a core (cpus: 0.5), so the whole system runs on 2 cores.
    """
    import logging

    import ray

    os.environ.update(WORKER_ENV)
    logging.getLogger("ray.serve").setLevel(logging.WARNING)  # the step lines are the terminal's output
    if address or os.environ.get("RAY_ADDRESS"):
        ray.init(address=address, log_to_driver=False, logging_level=logging.WARNING)  # the job's runtime env applies
        return
    check_local_start(job)
    os.environ.update(LOCAL_ENV)
    ray.init(
        address="local",  # a cluster of its own, even where a `ray start` cluster runs on this machine
        num_cpus=machine_cpus(),
        include_dashboard=False,
        runtime_env={"env_vars": {**WORKER_ENV, **LOCAL_ENV, **operator_trust()}, "worker_process_setup_hook": WORKER_SETUP_HOOK},
        log_to_driver=False,
        logging_level=logging.WARNING,
        _metrics_export_port=job.metrics.export_port,
    )


def operator_trust() -> dict[str, str]:
    """The operator's list of modules a job's reward may import (evals/rewards.py), passed on to a local run's workers."""
    from lt_opd_ray.evals.rewards import TRUSTED_MODULES

    return {TRUSTED_MODULES: os.environ[TRUSTED_MODULES]} if os.environ.get(TRUSTED_MODULES) else {}


def check_local_start(job: JobConfig, address: str | None = None) -> None:
    """What a local cluster needs of this machine (its CPUs, the metrics port free), checked before a run or a study
    writes or evaluates anything; nothing where the job joins a cluster (`address`, RAY_ADDRESS)."""
    if address or os.environ.get("RAY_ADDRESS"):
        return
    check_local_machine(job, machine_cpus())
    check_export_port(job)


def format_accuracy(accuracy: dict[str, float], full: float | None) -> str:
    """`acc[selector] a`, with the retain ratio a / full when the full-token reference is known."""
    return "".join(f"  | acc[{name}] {value:.3f}" + (f" retain {value / full:.3f}" if full else "") for name, value in accuracy.items())


def shown(value: float | None, spec: str) -> str:
    """A step line's figure; `-` for one the job does not have (divergence and top-k overlap without a teacher)."""
    return "-" if value is None else format(value, spec)


def format_step(log, total: int, full: float | None = None) -> str:
    """One update's line."""
    p = log.phases
    return (
        f"step {log.step + 1:4d}/{total}  budget {log.budget_bps / 100:5.2f}%  loss {log.loss:.5f}  div {shown(log.divergence, '.5f')}"
        + (f"  reward {log.reward_mean:.3f}" if log.reward_mean is not None else "")
        + (f" (groups resampled {log.resampled_groups}, kept flat {log.flat_groups})" if log.resampled_groups is not None else "")
        + f"  is_w {log.importance_weight:.3f} (clipped {log.clipped_share:.1%})  gap {log.logprob_gap:.4f}  overlap {shown(log.top_k_overlap, '.3f')}"
        f"  tokens {log.tokens} (mean {log.response_tokens_mean:.0f}, max {log.response_tokens_max}, cut {log.truncated_share:.0%};"
        f" learner padding {log.padding_share:.0%})"
        f"  | rollout {p.rollout:.2f}s teacher {p.teacher:.2f}s learner {p.learner:.2f}s sync {p.sync:.2f}s"
        f" step {p.step:.2f}s" + (f" (staleness {log.staleness})" if log.staleness else "")
        + format_accuracy(log.eval_accuracy, full)
        + "".join(f"  | {name} {value:.2f}" for name, value in log.eval_scores.items())
    )


def format_placements(placements) -> str:
    """`placed on GPUs: node abcd1234: rollout-0 0 (vLLM V2 runner), ...`: the GPU ids Ray gave each actor and
    what computes in it, by node."""
    nodes: dict[str, list[str]] = {}
    for p in placements:
        nodes.setdefault(p.node, []).append(f"{p.actor} {','.join(p.gpus) or '-'} ({p.engine})")
    return "placed on GPUs: " + "; ".join(f"node {node[:8]}: {', '.join(actors)}" for node, actors in nodes.items())


class RunFolderError(ValueError):
    """A fresh run pointed at a folder that holds an earlier run."""


def claim_run_folder(location: str | Path, resume: bool, force: bool, staging: str | None = None) -> None:
    """A fresh run gets a folder of its own: one that holds an earlier run's checkpoints, `final/` or step log is
    refused unless `--resume` continues that run or `--force` starts afresh (the earlier run is moved aside, not
    deleted). `location`: checkpoint.dir, a folder or a URI."""
    import time

    storage = RunStorage(str(location), staging)
    earlier = [name for name in storage.names() if name in ("final", "latest", "steps.jsonl") or name.startswith("step-")]
    if resume or not earlier:
        return
    record = storage.read_text(RUN_RECORD)
    try:  # the earlier run keeps its id in its folder's name
        suffix = f"-{json.loads(record)['run_id']}" if record else f"-before-{time.strftime('%Y%m%d-%H%M%S')}"
    except (ValueError, KeyError, TypeError):
        suffix = f"-before-{time.strftime('%Y%m%d-%H%M%S')}"
    if not force:
        raise RunFolderError(
            f"{storage.describe()} holds an earlier run ({', '.join(earlier[:6])}{', ...' if len(earlier) > 6 else ''}): `--resume` continues it,"
            f" `--force` starts afresh and moves it to {storage.describe().rstrip('/').rsplit('/', 1)[-1]}{suffix}, or set checkpoint.dir to a new folder"
        )
    aside = storage.move_aside(suffix)
    print(f"moved the earlier run in {storage.describe()} to {aside}", flush=True)


def train(job: JobConfig, steps: int | None = None, resume: bool = False, address: str | None = None, force: bool = False) -> list:
    """Start or join Ray, run the job, leave Ray. Returns the step logs."""
    import time

    import ray

    from lt_opd_ray.runtime.job_inputs import read_job_inputs
    from lt_opd_ray.runtime.preflight import PreflightError

    if problems := read_job_inputs(job, draw_generated=False)[1]:  # before Ray starts; preflight reads them again, in full
        raise PreflightError(f"job {job.name!r} cannot start:\n  " + "\n  ".join(problems))
    storage = RunStorage(job.checkpoint.dir, job.checkpoint.staging_dir)
    storage.check_reachable()  # before the lease is written there: a storage that does not answer is named as such
    lock = RunLock.acquire(storage.local, f"lt-opd train {job.name}")  # first: a live run in the folder is named as such
    try:
        lease = RemoteLease.acquire(storage, f"lt-opd train {job.name}") if storage.remote else None  # other hosts, same URI
    except BaseException:
        lock.release()
        raise
    try:
        check_local_start(job, address)  # before an earlier run is moved aside (--force)
        claim_run_folder(job.checkpoint.dir, resume, force, job.checkpoint.staging_dir)
        begin = time.perf_counter()
        init_ray(job, address)
        lock.record_ray()  # a successor after a kill stops this local cluster before it starts its own
        try:
            return run(job, steps, resume, ray_seconds=time.perf_counter() - begin)
        finally:
            ray.shutdown()
    finally:
        if lease is not None:
            lease.release()
        lock.release()


class StopRequest:
    """SIGTERM (what Kubernetes and `ray job stop` send) asks the run to stop at the next safe point: after the
    update in progress, with a checkpoint if an update finished since the last one. A second SIGTERM stops at once."""

    def __init__(self):
        import signal

        self.requested = False
        self.previous = signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt("second SIGTERM")
        self.requested = True

    def restore(self) -> None:
        import signal

        signal.signal(signal.SIGTERM, self.previous)


def start_history(driver, storage: RunStorage, resume: bool) -> Path:
    """Say where the run starts, and make the run's steps.jsonl (its local copy: `storage.local`) one history: a
    resume keeps the lines of the steps before its checkpoint (a killed run may have logged later ones)."""
    from tqdm import tqdm

    from lt_opd_ray.core.regular_files import write_text_nofollow

    step_file = storage.local / "steps.jsonl"
    if driver.restored is not None:
        for line in driver.restored.passed_over:
            tqdm.write(f"passed over a damaged checkpoint (kept as {line.tag}.damaged): {line}")
        tqdm.write(f"resuming from {storage.describe(driver.restored.tag)} (update {driver.step})")
        if storage.get("steps.jsonl"):
            kept = [line for line in step_file.read_text().splitlines() if _logged_step(line) < driver.step]
            write_text_nofollow(step_file, "".join(line + "\n" for line in kept))
        return step_file
    if resume:
        tqdm.write(f"--resume: no checkpoint in {storage.describe()}; starting at update 0")
    return step_file


def _logged_step(line: str) -> float:
    """A step-log line's update index; a line cut short by a kill counts as after every step."""
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return float("inf")


def progress_bar(total: int, initial: int, name: str, stream=None):
    """The run's progress bar on the stream its lines go to (stdout), so that each `tqdm.write` line clears the bar,
    prints whole, and the bar is redrawn below it; no bar at all where that stream is not a terminal (a log file, a
    pipe, `ray job logs`), which then holds only whole lines."""
    from tqdm import tqdm

    stream = stream or sys.stdout
    return tqdm(total=total, initial=initial, desc=name, unit="step", dynamic_ncols=True, file=stream, disable=not stream.isatty())


def run(job: JobConfig, steps: int | None = None, resume: bool = False, ray_seconds: float | None = None, roles: Roles | None = None) -> list:
    """Run the job on the Ray cluster this process is connected to, its pools from `roles` (`runtime/roles.RAY_ROLES`;
    `runtime/kept_roles.KeptRoles` for a series of runs).

    Every step is appended to `<checkpoint.dir>/steps.jsonl`; a run that reaches
    `total_steps` writes the student as a Hugging Face folder to `<checkpoint.dir>/final`.
    On SIGTERM it stops after the update in progress, checkpointed, so `--resume` continues.
    """
    from dataclasses import asdict

    from tqdm import tqdm

    from lt_opd_ray.models.kernels import slow_kernels_warning
    from lt_opd_ray.runtime.driver import Driver
    from lt_opd_ray.runtime.roles import RAY_ROLES
    from lt_opd_ray.runtime.tracking import Trackers

    stop = StopRequest()
    try:
        driver = Driver(job, resume=resume, roles=roles or RAY_ROLES)
    except BaseException:
        stop.restore()
        raise
    trackers = None
    total = job.budget.total_steps
    last = min(total, driver.step + steps) if steps else total
    logs = []
    try:
        phases = ({"ray": ray_seconds} if ray_seconds is not None else {}) | driver.startup
        ready = ", ".join(f"{pool} {seconds:.1f}" for pool, seconds in driver.pools_ready.items())
        tqdm.write(f"started in {sum(phases.values()):.1f} s: " + ", ".join(f"{name} {seconds:.1f}" for name, seconds in phases.items())
                   + f" (pools started together, ready after: {ready})")
        if any(p.gpus for p in driver.placements):
            tqdm.write(format_placements(driver.placements))
        if warning := slow_kernels_warning(driver.placements):
            tqdm.write(warning)
        storage = driver.checkpoints.storage
        tqdm.write(f"run {driver.checkpoints.run_id}: outputs (checkpoints, steps.jsonl, final/) go to {storage.describe()}"
                   + (f" (staged in {storage.local})" if storage.remote else ""))
        step_file = start_history(driver, storage, resume)
        trackers = Trackers(job, storage)
        full = None
        if job.eval.at_start and job.eval.data and driver.step == 0:
            full, untrained = driver.evaluate_baseline()
            tqdm.write(f"before training: full visual tokens acc {full:.3f}; at {job.eval_budget_bps / 100:g}%"
                       + format_accuracy(untrained, full))
        with progress_bar(last, driver.step, job.name) as bar, step_file.open("a") as out:
            while driver.step < last:
                replaced = driver.replace_dead_rollout_workers()
                if replaced:
                    tqdm.write(f"replaced dead rollout worker(s): {', '.join(replaced)}")
                log = driver.run_step()
                logs.append(log)
                out.write(json.dumps({"run_id": driver.checkpoints.run_id, **asdict(log)}) + "\n")
                out.flush()
                storage.put("steps.jsonl")  # to a URI: the whole log again (object stores do not append)
                trackers.step(log)
                tqdm.write(format_step(log, total, full))
                bar.update(1)
                if stop.requested:
                    where = driver.checkpoint()
                    tqdm.write(f"stopped by SIGTERM after update {driver.step}: checkpoint {where}; `--resume` continues from it")
                    return logs
        if driver.step == total:
            tqdm.write(f"the student is in {driver.export_student()}")
        else:  # stopped by --steps: the last update is always kept, whatever checkpoint.every_steps says
            where = driver.checkpoint()
            tqdm.write(f"stopped after update {driver.step} of {total} (--more-updates): checkpoint {where}; `--resume` continues from it")
    except (RoleDiedError, NoAnswerError) as exc:
        latest = driver.checkpoints.latest()
        where = f"`--resume` continues from {driver.checkpoints.storage.describe(latest)}" if latest else "no checkpoint yet: start it again"
        raise type(exc)(f"{exc}; the run stopped after update {driver.step}; {where}") from exc
    finally:
        stop.restore()
        if trackers is not None:
            trackers.close()
        driver.shutdown()
    return logs
