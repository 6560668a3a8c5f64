"""Shared fixtures: tiny real VLMs of every family built in-test, offline, and small random images."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from lt_opd_ray.core.families import FAMILIES as DESCRIPTIONS

FAMILIES = list(DESCRIPTIONS)  # every family the transformers path adapts
VLLM_FAMILIES = [name for name, family in DESCRIPTIONS.items() if family.vllm_module]  # the ones the vLLM plugin prunes too

# Every collective of every test (learner groups, weight syncs, in this process, its Ray actors and the CLI runs it
# starts) is held to its backend's device rule, as NCCL holds a GPU run (core/collectives.py).
os.environ.setdefault("LT_OPD_CHECK_COLLECTIVES", "1")
os.environ.setdefault("LT_OPD_TRUSTED_MODULES", "user_rewards")  # the operator's opt-in for the tests' own reward module


def pytest_report_header(config) -> str:
    """The CPU the run's figures belong to (fp32 kernels, and so rounding and speed, differ between CPUs)."""
    import platform

    from lt_opd_ray.runtime.resources import machine_cpus

    flags = model = ""
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as info:
            for line in info:
                key, _, value = line.partition(":")
                model = model or (value.strip() if key.strip() == "model name" else "")
                flags = flags or (value if key.strip() == "flags" else "")
    isa = "AVX-512" if " avx512f" in flags else "AVX2" if " avx2" in flags else platform.machine()
    return f"cpu: {model or platform.processor() or 'unnamed'}, {isa}, {machine_cpus()} cores for this process"


def pytest_collection_modifyitems(config, items):
    group_the_shared_clusters_modules(items)
    kept_runs_first(items)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; none is present on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# ------------------------------------------------------------------ the Ray cluster the job-running modules share
SHARED_CLUSTER = {"modules": set(), "running": False}


def group_the_shared_clusters_modules(items) -> None:
    """The modules with a test that runs on `cluster` run one after another, where the first of them stood (each
    module's own order kept), so the cluster and Serve's controller start once for all of them, not once each."""
    modules = {module_of(item) for item in items if "cluster" in getattr(item, "fixturenames", ())}
    SHARED_CLUSTER["modules"] = modules
    shared = [item for item in items if module_of(item) in modules]
    if shared:
        first = items.index(shared[0])
        rest = [item for item in items if module_of(item) not in modules]
        items[:] = rest[:first] + shared + rest[first:]


def kept_runs_first(items) -> None:
    """In each module, the tests that take `kept` (directly or through a fixture) run first, in file order: a test
    that does not take it stops the kept pools, so one between two that do makes the second start new ones."""
    import itertools

    ordered = []
    for _, module_items in itertools.groupby(items, key=module_of):  # a module's tests stand together
        ordered += sorted(module_items, key=lambda item: "kept" not in getattr(item, "fixturenames", ()))  # stable
    items[:] = ordered


def module_of(item) -> str:
    return getattr(getattr(item, "module", None), "__name__", "")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """A test of any other module gets a process without the shared cluster (it may start a cluster of its own)."""
    if SHARED_CLUSTER["running"] and module_of(item) not in SHARED_CLUSTER["modules"]:
        stop_shared_cluster()


def pytest_sessionfinish(session, exitstatus):
    if SHARED_CLUSTER["running"]:
        stop_shared_cluster()


@pytest.fixture(scope="module")
def cluster(request, metrics_port):
    """The local Ray cluster of the modules that run jobs in this process (8 CPUs, the workers' env, tests/ on their
    PYTHONPATH for user_rewards.py, Ray's metrics on `metrics_port`), started by the first test that asks for it and
    kept until a test of another module runs; yields its GCS address. Each module hands it on as it found it: every
    CPU free and no Serve app left, else the cluster is stopped (the next module starts a clean one) and the module
    fails, naming what it left."""
    import ray

    from lt_opd_ray.runtime.launch import WORKER_ENV

    SHARED_CLUSTER["modules"].add(request.module.__name__)  # also where a test asks for it by name at run time
    if not SHARED_CLUSTER["running"]:
        assert not ray.is_initialized(), "an earlier test left a Ray session of its own in this process"
        os.environ.update(WORKER_ENV)
        tests = os.pathsep.join(filter(None, [os.path.dirname(__file__), os.environ.get("PYTHONPATH")]))
        pool_nodes = {"lt_opd_rollout": 1, "lt_opd_teacher": 1, "lt_opd_learner": 1}  # every pool's node_resource: the dashboard's panels read them
        ray.init(address="local", num_cpus=8, resources=pool_nodes, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {**WORKER_ENV, "PYTHONPATH": tests, "LT_OPD_TRUSTED_MODULES": os.environ["LT_OPD_TRUSTED_MODULES"]}}, _metrics_export_port=metrics_port)
        SHARED_CLUSTER["running"] = True
    yield ray.get_runtime_context().gcs_address
    left = leftovers()
    if left:
        stop_shared_cluster()
        pytest.fail(f"{request.module.__name__} left {left} on the shared Ray cluster", pytrace=False)


@pytest.fixture(scope="module")
def kept(cluster):
    """`KeptRoles` for the module's runs (runtime/kept_roles.py): a run whose pools have the last run's shape starts
    in its rollout worker's, learner ranks' and teacher replica's processes. What is kept is stopped at the module's end and before any
    test that does not ask for `kept` (it may need the whole cluster, or count the actors it starts)."""
    from lt_opd_ray.runtime.kept_roles import KeptRoles

    roles = SHARED_CLUSTER["kept"] = KeptRoles()
    yield roles
    SHARED_CLUSTER["kept"] = None
    roles.close()


@pytest.fixture(autouse=True)
def kept_pools_only_where_asked(request):
    roles = SHARED_CLUSTER.get("kept")
    if roles is not None and "kept" not in request.fixturenames:
        roles.close()


def leftovers(timeout_s: float = 60.0) -> str:
    """What the cluster still holds once its actors have had `timeout_s` to go (Ray frees them asynchronously): CPUs
    reserved, Serve apps; empty when nothing."""
    import time

    import ray
    from ray import serve

    deadline = time.monotonic() + timeout_s
    while True:
        busy = ray.cluster_resources()["CPU"] - ray.available_resources().get("CPU", 0.0)
        apps = sorted(serve.status().applications)
        if (not busy and not apps) or time.monotonic() > deadline:
            return "; ".join(filter(None, [f"{busy:g} CPUs reserved" if busy else "", f"Serve apps {apps}" if apps else ""]))
        time.sleep(0.5)


@pytest.fixture(scope="session")
def metrics_port() -> int:
    """Where the shared cluster exports Ray's metrics: a port nothing on this machine holds (a run beside the suite may
    hold any fixed one)."""
    from lt_opd_ray.runtime.learner_group import free_port

    return free_port()


def stop_shared_cluster() -> None:
    import ray
    from ray import serve

    SHARED_CLUSTER["running"] = False
    try:
        serve.shutdown()
    finally:
        ray.shutdown()


@pytest.fixture(autouse=True)
def autograd_left_on():
    """A test that turns autograd off for the process (`torch.set_grad_enabled(False)` outside a context) fails here,
    not every gradient test after it."""
    yield
    assert torch.is_grad_enabled(), "this test left autograd off for the whole process"


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    from lt_opd_ray.models.tiny import build_tiny_model

    root = tmp_path_factory.mktemp("tiny")
    return {family: build_tiny_model(family, root / family, seed=0) for family in FAMILIES}


def wait_until(condition, timeout_s: float = 60.0, every_s: float = 0.05) -> bool:
    """Poll `condition` until it holds (True) or `timeout_s` passes (what it says then)."""
    import time

    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return bool(condition())
        time.sleep(every_s)
    return True


def bomb_png(side: int = 20000) -> bytes:
    """A valid PNG header claiming side x side pixels with no pixel data: a decompression bomb's signature."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", side, side, 8, 2, 0, 0, 0)) + chunk(b"IEND", b"")


def stop_ray_started_under(temp_dir: str) -> None:
    """Stop the `ray start` cluster whose temp folder is `temp_dir` (its GCS, raylet, monitors and every process they
    started) and nothing else: `ray stop` would end every Ray cluster on the machine, a study running beside the
    suite included."""
    import psutil

    roots = [p for p in psutil.process_iter(["cmdline"]) if any(temp_dir in arg for arg in p.info["cmdline"] or [])]
    processes = set(roots)
    for root in roots:
        try:
            processes.update(root.children(recursive=True))
        except psutil.Error:
            pass
    for process in processes:
        try:
            process.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(list(processes), timeout=2)  # the GCS and the raylet take ~15 s to end on SIGTERM
    for process in alive:
        try:
            process.kill()
        except psutil.Error:
            pass


def random_image(seed: int, height: int = 128, width: int = 128):
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 255, (height, width, 3), dtype=np.uint8))


@pytest.fixture(scope="session")
def loaded(tiny_dirs):
    """family -> (model in fp32, processor, adapter), loaded once per session."""
    from transformers import AutoModelForImageTextToText

    from lt_opd_ray.models.adapter import QwenVLM
    from lt_opd_ray.models.processor import VLMProcessor

    out = {}
    for family, path in tiny_dirs.items():
        model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()  # CPU
        out[family] = (model, VLMProcessor(path), QwenVLM(model))
    return out


def job_for(model_dir, ckpt_dir, ranks=2, zero_stage=2, workers=1, every=100, total=12, name="t", mode="lt_opd", extra="",
            dtype="float32", backend="transformers", micro_batch_tokens=16384, prompts=2, verify_weights=False,
            activation_checkpointing=False, n=2, max_new_tokens=6, images=1, data=None, warmup=1, teacher_batch=4, stop=None, steps_per_update=1,
            kl_coef=0.0, packing=True, gradient_step=False):
    """A small distributed job on a tiny model: `prompts` (2) x `n` (2) responses per update, `images` per row (or the
    rows `data` names, a data.path); `extra` is appended YAML. `gradient_step`: every learning rate and AdamW's eps at
    1 and no weight decay, so that the first step moves each weight by g / (|g| + 1), the gradient entry itself to
    within its square, and every step by about the gradient: an equality test then reads update 0's gradient off the
    weights entry by entry, and the run's movement is its gradients' (test_runtime's `assert_reproduces`)."""
    from lt_opd_ray.config.loading import parse_job

    rates = ("{language_model: 1.0, vision_encoder: 1.0, merger: 1.0, token_merge: 1.0}, eps: 1.0, weight_decay: 0.0" if gradient_step
             else "{language_model: 1.0e-3, vision_encoder: 5.0e-4, merger: 1.0e-3}")

    return parse_job(
        f"""
name: {name}
seed: 5
model: {{path: "{model_dir}", dtype: {dtype}}}
data: {{path: "{data or f"synthetic:16{f'*{images}' if images > 1 else ''}"}", max_pixels: 65536, max_images: {images}, frames: 8}}
budget: {{start_bps: 2500, target_bps: 500, warm_steps: 1, decay_end: 4, total_steps: {total}, k_min: 2}}
objective: {{top_k: 8, logsoftmax_chunk: 32, mode: {mode}, kl_coef: {kl_coef}}}
sampling: {{prompts_per_step: {prompts}, n: {n}, max_new_tokens: {max_new_tokens}{f", stop: {stop!r}" if stop else ""}}}
optimizer: {{lr: {rates}, warmup_steps: {warmup}, steps_per_update: {steps_per_update}}}
pools:
  rollout: {{workers: {workers}, cpus: 1, backend: {backend}, verify_weights: {str(verify_weights).lower()}}}
  teacher: {{replicas: 1, cpus: 1, max_batch_size: {teacher_batch}, backend: {backend}}}
  learner: {{ranks: {ranks}, cpus: 1, zero_stage: {zero_stage}, sync_bucket_mb: 0.25, sync_timeout_s: 120, micro_batch_tokens: {micro_batch_tokens},
            activation_checkpointing: {str(activation_checkpointing).lower()}, packing: {str(packing).lower()}}}
checkpoint: {{dir: "{ckpt_dir}", every_steps: {every}, keep: 2}}
metrics: {{export_port: 8099}}
{extra}"""
    )


