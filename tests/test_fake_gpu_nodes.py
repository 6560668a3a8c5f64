"""The main job's pools placed on Ray nodes that advertise GPUs this machine does not have.

`ray start --num-gpus 8` works without GPUs: Ray places `num_gpus=1` actors and sets each one's
CUDA_VISIBLE_DEVICES, and the actors run their tiny models on CPU (gloo, no CUDA). So the placement a GPU
cluster would make (every pool at its real GPU request, a GPU of its own per actor, the learners packed,
pools pinned to node types) is tested here with the real driver; what runs inside stays CPU (docs/gpu.md).
The layouts run in a process of their own, one cluster after another: Ray fixes a process's auth mode (token, as `ray
start` clusters use) and its Serve client at the first session, so an earlier test's local cluster must not be the first.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import ray
from conftest import stop_ray_started_under

from lt_opd_ray.config.loading import load_job
from lt_opd_ray.runtime.driver import Driver
from lt_opd_ray.runtime.launch import WORKER_ENV, format_placements
from lt_opd_ray.runtime.learner_group import free_port
from lt_opd_ray.runtime.preflight import PreflightError

REPO = Path(__file__).resolve().parents[1]
RAY = Path(sys.executable).parent / "ray"
# the main job as shipped (its pools, GPU requests and CPUs), with a tiny model, tiny data and short answers
SMALL = [
    "model.path=tiny:qwen3_5", "model.dtype=float32", "data.path=synthetic:32", "data.min_pixels=4096",
    "data.max_pixels=65536", "budget.k_min=2", "objective.top_k=16", "objective.logsoftmax_chunk=256",
    "sampling.prompts_per_step=4", "sampling.n=2", "sampling.max_new_tokens=8",
    "pools.rollout.backend=transformers", "pools.teacher.backend=transformers",  # placement is the backends' same code path
    "pools.learner.micro_batch_tokens=4096", "pools.learner.activation_checkpointing=false",
]
HALVED = ["pools.rollout.workers=2", "pools.teacher.replicas=1", "pools.teacher.max_replicas=1", "pools.learner.ranks=1"]  # 4 GPUs


class FakeGpuCluster:
    """`ray start` nodes on this machine, each advertising GPUs (and custom resources) it does not have."""

    def __init__(self):
        self.tmp = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # Ray's socket paths stay under 108 bytes
        # one torch thread per actor, as on a local run of this box: Ray gives an actor of `cpus: 8` OMP_NUM_THREADS=8
        # (torch takes both cores), and the layouts' eight actors then spin against each other on 2 cores
        self.env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_TMPDIR": self.tmp, **WORKER_ENV, "OMP_NUM_THREADS": "1"}
        self.port = None

    def add_node(self, gpus: int, cpus: int, resources: dict | None = None) -> None:
        import json

        if self.port is None:
            self.port = free_port()
            where = ["--head", f"--port={self.port}", "--include-dashboard=false", "--disable-usage-stats"]
        else:
            where = [f"--address=127.0.0.1:{self.port}"]
        args = [str(RAY), "start", *where, f"--num-cpus={cpus}", f"--num-gpus={gpus}", f"--object-store-memory={300 * 2**20}"]
        if resources:
            args.append(f"--resources={json.dumps(resources)}")
        started = subprocess.run(args, env=self.env, capture_output=True, text=True, timeout=180)
        assert started.returncode == 0, started.stderr[-3000:]

    def connect(self) -> None:
        """This process joins as the driver, with the nodes' temp folder (not a session an earlier cluster left)."""
        self.saved = {key: os.environ.get(key) for key in ("RAY_AUTH_MODE", "RAY_TMPDIR")}
        os.environ.update({"RAY_AUTH_MODE": "token", "RAY_TMPDIR": self.tmp, **WORKER_ENV})
        ray.init(address=f"127.0.0.1:{self.port}", log_to_driver=False)

    def stop(self) -> None:
        from ray import serve

        if ray.is_initialized():
            serve.shutdown()
            ray.shutdown()
        for key, value in getattr(self, "saved", {}).items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        stop_ray_started_under(self.tmp)
        shutil.rmtree(self.tmp, ignore_errors=True)


def on_fake_cluster(nodes: list[tuple[int, int, dict | None]], jobs: list[tuple[str, list[str]]], steps: int) -> list[dict]:
    """In the layouts' process: start `nodes` (GPUs, CPUs, custom resources), then for each of `jobs` (a job file of
    jobs/ and its overrides) run its driver for `steps` updates; per job what the start-up printed, how long the pools
    took, where each actor went, or the refusal."""
    cluster = FakeGpuCluster()
    try:
        for gpus, cpus, resources in nodes:
            cluster.add_node(gpus, cpus, resources)
        cluster.connect()
        return [run_job(name, [*SMALL, *overrides], steps) for name, overrides in jobs]
    finally:
        cluster.stop()


def run_job(name: str, overrides: list[str], steps: int) -> dict:
    import contextlib
    import io

    printed = io.StringIO()
    try:
        job = load_job(REPO / "jobs" / name, overrides)
        begin = time.perf_counter()
        with contextlib.redirect_stdout(printed):
            driver = Driver(job)
        try:
            seconds = time.perf_counter() - begin
            logs = [driver.run_step() for _ in range(steps)]
            return {"placements": driver.placements, "seconds": seconds, "printed": printed.getvalue(),
                    "tokens": [log.tokens for log in logs]}
        finally:
            driver.shutdown()
    except PreflightError as exc:
        return {"refused": str(exc)}


@pytest.fixture(scope="module")
def layouts():
    """`on_fake_cluster` in a process of its own, started once for the module: its first Ray session is a `ray start`
    cluster's (token auth), never a local cluster an earlier test module started in pytest's process."""
    import multiprocessing

    saved = os.environ.get("RAY_AUTH_MODE")
    os.environ["RAY_AUTH_MODE"] = "token"  # the child reads it when it imports ray, before it joins the nodes
    try:
        with multiprocessing.get_context("spawn").Pool(1) as pool:
            def fresh(nodes, *jobs: list[str] | tuple[str, list[str]], steps=0) -> list[dict] | dict:
                """One job's result, or a list of several jobs' results in order (each the main job's overrides, or
                a job file of jobs/ and its overrides), on a fresh cluster of `nodes`."""
                jobs = [job if isinstance(job, tuple) else ("train_qwen35.yaml", job) for job in jobs]
                results = pool.apply(on_fake_cluster, (nodes, jobs, steps))
                return results[0] if len(results) == 1 else results

            yield fresh
    finally:
        if saved is None:
            os.environ.pop("RAY_AUTH_MODE")
        else:
            os.environ["RAY_AUTH_MODE"] = saved


def gpu_ids(placements) -> list[str]:
    return sorted(g for p in placements for g in p.gpus)


@pytest.mark.slow
def test_the_main_job_starts_on_one_8_gpu_node_each_actor_on_a_gpu_of_its_own(layouts, tmp_path):
    """The main job, then its GRPO baseline (jobs/train_qwen35_grpo.yaml: no teacher, its GPUs sample), on the same node."""
    # the recipe's pools take 8 CPUs per actor; the GRPO job's 4 optimizer steps need 4 prompts per rank
    run, rl = layouts([(8, 72, None)], [f"checkpoint.dir={tmp_path / 'run'}"],
                    ("train_qwen35_grpo.yaml", ["sampling.prompts_per_step=8", f"checkpoint.dir={tmp_path / 'rl'}"]), steps=1)
    placements = run["placements"]
    print(f"\n8-GPU node: pools started in {run['seconds']:.1f} s; {format_placements(placements)}")
    assert sorted(p.actor.split("-")[0] for p in placements) == ["learner"] * 2 + ["rollout"] * 4 + ["teacher"] * 2
    assert all(len(p.gpus) == 1 for p in placements)
    assert gpu_ids(placements) == [str(i) for i in range(8)]  # eight actors, eight distinct GPUs
    assert len({p.node for p in placements}) == 1
    assert "the teacher may autoscale to pools.teacher.max_replicas = 4; this cluster has room for 2" in run["printed"]
    assert {p.engine for p in placements} == {"transformers", "DeepSpeed ZeRO-2"}
    assert run["tokens"][0] > 0  # one update ran: the collectives (gloo: the actors see no CUDA) under the device guard
    print(f"8-GPU node, GRPO: pools started in {rl['seconds']:.1f} s; {format_placements(rl['placements'])}")
    assert sorted(p.actor.split("-")[0] for p in rl["placements"]) == ["learner"] * 2 + ["rollout"] * 6
    assert gpu_ids(rl["placements"]) == [str(i) for i in range(8)] and rl["tokens"][0] > 0


@pytest.mark.slow
def test_pinned_pools_on_two_8_gpu_nodes(layouts, tmp_path):
    """Two node types, as a 16-GPU cluster with a node type per role: rollouts on one, teacher + learners on the other
    (the halved pools: where each pool lands is the point, and four actors start on 2 cores in half the time eight do)."""
    pins = [f"pools.{pool}.node_resource=lt_opd_{pool}" for pool in ("rollout", "teacher", "learner")]
    nodes = [(8, 40, {"lt_opd_rollout": 8}), (8, 40, {"lt_opd_teacher": 4, "lt_opd_learner": 4})]
    run = layouts(nodes, [*pins, *HALVED, "pools.rollout.cpus=4", "pools.teacher.cpus=4", "pools.learner.cpus=4",
                        f"checkpoint.dir={tmp_path / 'run'}"])
    placements = run["placements"]
    print(f"\n2 x 8-GPU nodes: pools started in {run['seconds']:.1f} s; {format_placements(placements)}")
    nodes_of = {role: {p.node for p in placements if p.actor.startswith(role)} for role in ("rollout", "teacher", "learner")}
    assert len(nodes_of["rollout"]) == 1 and nodes_of["teacher"] == nodes_of["learner"] and nodes_of["rollout"] != nodes_of["learner"]
    assert all(len(p.gpus) == 1 for p in placements)
    per_node: dict[str, list[str]] = {}
    for p in placements:
        per_node.setdefault(p.node, []).extend(p.gpus)
    assert all(len(ids) == len(set(ids)) for ids in per_node.values())  # no GPU given twice on a node


@pytest.mark.slow
def test_a_4_gpu_node_refuses_the_main_job_by_name_and_starts_the_halved_one(layouts, tmp_path):
    refused, run = layouts([(4, 40, None)], [f"checkpoint.dir={tmp_path / 'refused'}"], [*HALVED, f"checkpoint.dir={tmp_path / 'run'}"])
    assert "GPU: the pools need 8 (rollout 4, teacher 2, learner 2) but the cluster has 4, short by 4" in refused["refused"]
    print(f"\n4-GPU node: pools started in {run['seconds']:.1f} s; {format_placements(run['placements'])}")
    assert gpu_ids(run["placements"]) == ["0", "1", "2", "3"]
