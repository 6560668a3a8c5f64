"""Runtime benchmark: step-time split of the distributed tiny job against the single-process reference,
and weight-sync throughput of a ~100 MB model over gloo between Ray actors.

    python benchmarks/bench_runtime.py              # both parts (a few minutes on 2 cores)
    python benchmarks/bench_runtime.py --sync-only

Part 1 runs the same updates (same job, seed and data) both ways, alternating
update by update; the first update of each is reported apart as warm-up. Part 2 broadcasts a ~100 MB fp32
model shaped like a transformer (per layer two 1 MB matrices and four 4 KB
vectors: 48 layers, 288 tensors) from one actor to N actors, with per-tensor
buckets (every tensor its own broadcast) and with flat buckets of several sizes.
"""

from __future__ import annotations

import argparse
import statistics
import time

import ray
import torch

from lt_opd_ray.config.loading import load_job


def step_split(job_path: str, steps: int) -> None:
    from lt_opd_ray.core.batch_order import batches
    from lt_opd_ray.reference import ReferenceTrainer
    from lt_opd_ray.runtime.driver import Driver
    from lt_opd_ray.runtime.launch import init_ray
    from lt_opd_ray.sources.resolve import load_samples

    job = load_job(job_path)
    job = job.model_copy(update={"checkpoint": job.checkpoint.model_copy(update={"dir": "runs/bench", "every_steps": 10**6})})
    trainer = ReferenceTrainer(job)
    data = batches(load_samples(job.data.path, job.data.image_root, job.seed), job.sampling.prompts_per_step, job.data.shuffle_seed)

    def reference_update() -> float:
        begin = time.perf_counter()
        trainer.update(next(data))
        return time.perf_counter() - begin

    alone = [reference_update() for _ in range(4)]  # before any Ray process exists (the first is warm-up)
    init_ray(job)
    driver = Driver(job)
    # the two alternate, update by update (the reference in this process while the job's actors wait), so both
    # meet the same moments of this machine's speed, which drifts by tens of percent over minutes on a shared VM
    reference, logs, distributed = [], [], []
    for _ in range(steps):
        reference.append(reference_update())
        begin = time.perf_counter()
        logs.append(driver.run_step())
        distributed.append(time.perf_counter() - begin)  # the log's own step period would include the reference's
    driver.shutdown()
    ray.shutdown()

    pools = job.pools
    print(f"== step split: {job_path}, {steps} updates ({job.sampling.prompts_per_step} prompts x {job.sampling.n} responses,"
          f" {pools.rollout.workers} rollout worker, {pools.teacher.replicas} teacher replica, {pools.learner.ranks} learner ranks ZeRO-{pools.learner.zero_stage})")
    phases = ["rollout", "teacher", "learner", "sync"]
    print(f"{'update':>6} " + " ".join(f"{p:>15}" for p in [*phases, "step"]) + f" {'reference':>10}")
    for i, (log, step, ref) in enumerate(zip(logs, distributed, reference)):
        print(f"{i:>6} " + " ".join(f"{getattr(log.phases, p):>14.3f}s" for p in phases) + f" {step:>14.3f}s {ref:>9.3f}s")
    warm = slice(1, None)
    dist_mean = statistics.median(distributed[warm])
    ref_mean = statistics.median(reference[warm])
    print(f"RESULT median after warm-up: distributed step {dist_mean:.3f} s, reference update {ref_mean:.3f} s,"
          f" ratio distributed/reference = {dist_mean / ref_mean:.2f}x;"
          f" teacher payload {logs[-1].payload_bytes_per_token:.0f} B/token; weight sync {logs[-1].sync_bytes / 2**20:.2f} MB")
    print(f"reference before the cluster started: median {statistics.median(alone[1:]):.3f} s over {len(alone) - 1} updates"
          f" (the interleaved reference shares the machine with the job's idle actors, Serve and Ray's own processes)")


def transformer_like(megabytes: int, fill) -> torch.nn.ParameterList:
    """Per layer: two 1 MB matrices and four 4 KB vectors (norms, biases), until ~megabytes."""
    layers = max(1, megabytes // 2)
    shapes = [(512, 512), (512, 512), (1024,), (1024,), (1024,), (1024,)] * layers
    return torch.nn.ParameterList([torch.nn.Parameter(fill(shape)) for shape in shapes])


class Sender:
    def __init__(self, megabytes: int):
        from lt_opd_ray.runtime.learner_group import free_port
        from lt_opd_ray.weight_sync.group import host_store

        torch.manual_seed(0)
        self.model = transformer_like(megabytes, torch.randn)
        self.host, self.port = ray.util.get_node_ip_address(), free_port()
        self.store = host_store(self.host, self.port, 0, 120)
        self.group = None

    def address(self):
        return self.host, self.port

    def join(self, world: int, generation: int):
        from lt_opd_ray.weight_sync.group import SyncGroup

        self.group = SyncGroup(self.store, 0, world, generation, 120)

    def send(self, version: int, bucket_bytes: int) -> float:
        from lt_opd_ray.weight_sync.ends import TensorSource

        begin = time.perf_counter()
        self.group.send(TensorSource(list(self.model.named_parameters())), version, bucket_bytes)
        return time.perf_counter() - begin


class Receiver:
    def __init__(self, megabytes: int):
        self.model = transformer_like(megabytes, torch.zeros)
        self.group = None

    def join(self, host, port, rank, world, generation):
        from lt_opd_ray.weight_sync.group import SyncGroup, join_store

        self.group = SyncGroup(join_store(host, port, 120), rank, world, generation, 120)

    def receive(self, version: int) -> float:
        from lt_opd_ray.weight_sync.ends import ModuleSink

        begin = time.perf_counter()
        self.group.receive(ModuleSink(self.model), version)  # the bucket size comes in the sync's header
        return time.perf_counter() - begin


def sync_throughput(receivers: int, megabytes: int) -> None:
    ray.init(num_cpus=receivers + 1, include_dashboard=False, log_to_driver=False)
    sender = ray.remote(num_cpus=1)(Sender).remote(megabytes)
    workers = [ray.remote(num_cpus=1)(Receiver).remote(megabytes) for _ in range(receivers)]
    numel = sum(p.numel() for p in transformer_like(megabytes, torch.empty).parameters())
    tensors = len(transformer_like(megabytes, torch.empty))
    host, port = ray.get(sender.address.remote())
    world = receivers + 1
    ray.get([sender.join.remote(world, 1)] + [w.join.remote(host, port, r, world, 1) for r, w in enumerate(workers, 1)])
    print(f"== weight sync: {numel * 4 / 2**20:.0f} MB fp32 in {tensors} tensors, 1 sender -> {receivers} receivers, gloo, best of 3")
    print(f"{'buckets':>22} {'seconds':>9} {'MB/s per receiver':>18}")
    version = 0
    for label, bucket in [("per tensor", 1), ("flat 4 MB", 4 * 2**20), ("flat 16 MB", 16 * 2**20), ("flat 64 MB", 64 * 2**20)]:
        times = []
        for _ in range(3):
            version += 1
            refs = [sender.send.remote(version, bucket)] + [w.receive.remote(version) for w in workers]
            times.append(max(ray.get(refs)))
        best = min(times)
        print(f"{label:>22} {best:>9.3f} {numel * 4 / 2**20 / best:>18.0f}")
    ray.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--job", default="jobs/train_tiny.yaml")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--receivers", type=int, default=1)
    parser.add_argument("--megabytes", type=int, default=100)
    parser.add_argument("--sync-only", action="store_true")
    args = parser.parse_args()
    if not args.sync_only:
        step_split(args.job, args.steps)
    sync_throughput(args.receivers, args.megabytes)


if __name__ == "__main__":
    main()
