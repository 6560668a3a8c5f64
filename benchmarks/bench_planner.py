"""The planner against a measured run, phase by phase, on this CPU box.

The planner (`lt_opd_ray/planning/planner.py`) is an analytic model: each phase's work (FLOPs, bytes, decode steps in the
engine batches the code runs, passes over logits, collectives) over a device's rates. Here the device is this
machine as the paper-shaped job's actors get it: an actor of `cpus: 0.5`, whose torch threads are what Ray gives it.
Its rates come from microbenchmarks run in such an actor, which know nothing of the job but its shapes:

- peak: fp32 GEMM FLOP/s at 1024 x 1024 x 1024;
- MFU: the rate of the GEMM that dominates this narrow model's work (rows x hidden x vocabulary: the output head)
  over that peak, used for every compute phase (prefill, training, compute-bound decode);
- memory: one read + write streaming pass over 256 MB (`memory_bandwidth` = 1 of that);
- logits: a log-softmax and a top-100 over 256 rows of the vocabulary (3 fp32 passes), as bytes per second over
  the memory stream (`logit_bandwidth`: on CPU the exponentials and the selection, not the bytes, bound these);
- link: the weight sync's own transport (`weight_sync/group.SyncGroup`, the job's bucket size) of the job's model
  between two actors (`link` = 1 of that), for the sync and the learners' ZeRO collectives alike.

The "GPUs" of the split are the job's actors: rollout workers, teacher replicas, learner ranks.

Then the job (`jobs/train_qwen35_shape.yaml`, its own pools) runs for `--updates` updates; the last is compared,
its mean response length taken as `mean_response_fraction`. Printed: the rates, then per phase the planner's
seconds and the measured ones (rollout: the wall extent of the update's groups; teacher: its replicas' busy seconds
each, the head start on the prompts included; learner: the slowest rank's compute; sync: the broadcast), and their ratio.

    python benchmarks/bench_planner.py [--updates 2] [--save runs/bench-planner.json | --load runs/bench-planner.json [--rates]]

`--load` re-predicts from a saved run and rates without running anything (for changes to the planner's model);
with `--rates` it measures the rates again (seconds) and keeps the saved run.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import ray
import torch

from lt_opd_ray.config.loading import load_job

JOB = "jobs/train_qwen35_shape.yaml"


def best_seconds(fn, repeats: int = 5) -> float:
    fn()
    times = []
    for _ in range(repeats):
        begin = time.perf_counter()
        fn()
        times.append(time.perf_counter() - begin)
    return min(times)


@ray.remote
class Probe:
    """A process shaped like the job's actors (the same `num_cpus`), measuring this machine's rates."""

    def threads(self) -> int:
        return torch.get_num_threads()

    def compute(self, hidden: int, vocab: int, rows: int) -> dict:
        square = torch.randn(1024, 1024)
        peak = 2 * 1024**3 / best_seconds(lambda: square @ square)
        inputs, head = torch.randn(rows, hidden), torch.randn(vocab, hidden)
        head_rate = 2 * rows * hidden * vocab / best_seconds(lambda: inputs @ head.T, 3)
        stream = torch.randn(64 * 2**20)  # 256 MB
        bandwidth = 2 * stream.numel() * 4 / best_seconds(lambda: stream.mul_(1.0), 3)
        logits = torch.randn(256, vocab)
        logit_rate = 3 * logits.numel() * 4 / best_seconds(lambda: torch.topk(torch.log_softmax(logits, -1), 100, -1), 3)
        return {"peak_flops": peak, "head_flops": head_rate, "memory_bytes_per_s": bandwidth, "logit_bytes_per_s": logit_rate}

    def open_sync(self) -> tuple[str, int]:
        from lt_opd_ray.runtime.learner_group import free_port
        from lt_opd_ray.weight_sync.group import host_store

        address = ray.util.get_node_ip_address(), free_port()
        self.store = host_store(*address, 0, 120)
        return address

    def join_sync(self, rank: int, host: str, port: int, model: str) -> int:
        """A sync group of two (rank 0 sends) over the job's model; returns its bytes."""
        from lt_opd_ray.models.loading import load_vlm
        from lt_opd_ray.sources.resolve import resolve_model_dir
        from lt_opd_ray.weight_sync.group import SyncGroup, join_store

        self.weights = load_vlm(resolve_model_dir(model), device="cpu")[1]
        self.group = SyncGroup(self.store if rank == 0 else join_store(host, port, 120), rank, 2, 1, 120)
        return sum(p.numel() * p.element_size() for p in self.weights.parameters())

    def send(self, version: int, bucket_bytes: int) -> float:
        from lt_opd_ray.weight_sync.ends import TensorSource

        begin = time.perf_counter()
        self.group.send(TensorSource(list(self.weights.named_parameters())), version, bucket_bytes)
        return time.perf_counter() - begin

    def receive(self, version: int) -> float:
        from lt_opd_ray.weight_sync.ends import ModuleSink

        begin = time.perf_counter()
        self.group.receive(ModuleSink(self.weights), version)
        return time.perf_counter() - begin


def measure_rates(job, config: dict) -> dict:
    sender, receiver = Probe.options(num_cpus=job.pools.learner.cpus).remote(), Probe.options(num_cpus=job.pools.rollout.cpus).remote()
    text = config.get("text_config", config)
    rates = ray.get(sender.compute.remote(text["hidden_size"], text["vocab_size"], 512))
    rates["threads"] = ray.get(sender.threads.remote())
    host, port = ray.get(sender.open_sync.remote())
    size, _ = ray.get([sender.join_sync.remote(0, host, port, job.model.path), receiver.join_sync.remote(1, host, port, job.model.path)])
    bucket = int(job.pools.learner.sync_bucket_mb * 2**20)
    times = [max(ray.get([sender.send.remote(version, bucket), receiver.receive.remote(version)])) for version in range(1, 5)]
    rates["link_bytes_per_s"] = size / min(times[1:])  # the first warms the buffers up
    for actor in (sender, receiver):
        ray.kill(actor)
    return rates


def run_job(job, updates: int) -> dict:
    from lt_opd_ray.core.wire import busy_seconds
    from lt_opd_ray.runtime.driver import Driver

    driver = Driver(job)
    try:
        logs = [driver.run_step() for _ in range(updates)]
    finally:
        driver.shutdown()
    last = logs[-1]
    origin = min(span.start for span in last.timeline)
    return {
        "timeline": [(span.role, span.actor, span.what, span.start - origin, span.seconds) for span in last.timeline],
        "phases": {
            "rollout": last.phases.rollout,
            # the replicas' work (its head start on the prompts runs during the rollouts: the phase's wall extent
            # would count the wait between), per replica as the planner counts it
            "teacher": busy_seconds([s for s in last.timeline if s.role == "teacher"]) / job.pools.teacher.replicas,
            "learner": last.phases.learner,
            "sync": last.phases.sync,
        },
        "step": last.phases.step, "every_step": [log.phases.step for log in logs],
        "tokens": last.tokens, "sequences": last.sequences, "micro_batches": last.micro_batches,
    }


def prompt_shape(job) -> tuple[int, tuple[int, int]]:
    """(text tokens of a prompt, its image's (height, width)) as the job's processor encodes its first sample."""
    from lt_opd_ray.models.processor import VLMProcessor, encode_samples, load_image
    from lt_opd_ray.sources.resolve import load_samples, resolve_model_dir

    sample = load_samples(job.data.path, job.data.image_root, job.seed)[0]
    processor = VLMProcessor(resolve_model_dir(job.model.path), job.data.min_pixels, job.data.max_pixels)
    prompt = encode_samples(processor, [sample], job.data.system_prompt)[0]
    width, height = load_image(sample.images[0], sample.uid).size
    return int((prompt.mm_token_type_ids == 0).sum()), (height, width)


def predict(job, config: dict, rates: dict, measured: dict) -> dict:
    from lt_opd_ray.planning.planner import GPU, plan, shapes_of

    text_tokens, image = prompt_shape(job)
    shapes = shapes_of(job, text_tokens, image)
    device = GPU(f"this CPU ({rates['threads']} thread per actor)", rates["peak_flops"] / 1e12, 1e6, rates["memory_bytes_per_s"] / 1e12,
                 rates["link_bytes_per_s"] / 1e9, rates["link_bytes_per_s"] / 1e9, gpus_per_node=1024)
    mfu = rates["head_flops"] / rates["peak_flops"]
    efficiency = {
        "memory_bandwidth": 1.0, "logit_bandwidth": rates["logit_bytes_per_s"] / rates["memory_bytes_per_s"],
        "decode_compute": mfu, "prefill_mfu": mfu, "train_mfu": mfu, "link": 1.0,
        "mean_response_fraction": measured["tokens"] / measured["sequences"] / shapes.max_new_tokens,
    }
    print(f"shapes: {shapes.prompts} prompts x {shapes.n} responses, {text_tokens} text tokens + an image of {image[0]}x{image[1]},"
          f" engine batch {shapes.engine_batch or 'the worker share'}, teacher {shapes.teacher_backend}, ZeRO-{shapes.zero_stage},"
          f" {shapes.dtype_bytes} B per value; mean response {efficiency['mean_response_fraction']:.0%} of {shapes.max_new_tokens}")
    actors = (job.pools.rollout.workers, job.pools.teacher.replicas, job.pools.learner.ranks)
    return plan(config, shapes, device, actors, efficiency).phases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--updates", type=int, default=2)
    parser.add_argument("--save", type=Path, default=None)
    parser.add_argument("--load", type=Path, default=None)
    parser.add_argument("--rates", action="store_true", help="with --load: measure the rates again")
    args = parser.parse_args()
    from lt_opd_ray.runtime.launch import init_ray
    from lt_opd_ray.sources.resolve import resolve_model_dir

    job = load_job(JOB, ["checkpoint.dir=runs/bench-planner", "checkpoint.every_steps=1000000", f"budget.total_steps={args.updates}"])
    config = json.loads((resolve_model_dir(job.model.path) / "config.json").read_text())
    saved = json.loads(args.load.read_text()) if args.load else {}
    rates, measured = saved.get("rates"), saved.get("measured")
    if measured is None or args.rates:
        init_ray(job)
        try:
            rates = measure_rates(job, config)
            measured = measured or run_job(job, args.updates)
        finally:
            ray.shutdown()
        if args.save:
            args.save.parent.mkdir(parents=True, exist_ok=True)
            args.save.write_text(json.dumps({"rates": rates, "measured": measured}, indent=1))
    print(f"== rates of this machine as one actor of the job gets it ({rates['threads']} torch thread(s))")
    print("| peak fp32 GEMM | the head's GEMM (MFU) | memory stream | log-softmax + top-100 (logit_bandwidth) | weight sync link |")
    print("|---|---|---|---|---|")
    print(f"| {rates['peak_flops'] / 1e9:.1f} GFLOP/s | {rates['head_flops'] / 1e9:.1f} GFLOP/s ({rates['head_flops'] / rates['peak_flops']:.2f})"
          f" | {rates['memory_bytes_per_s'] / 1e9:.2f} GB/s | {rates['logit_bytes_per_s'] / 1e9:.2f} GB/s"
          f" ({rates['logit_bytes_per_s'] / rates['memory_bytes_per_s']:.2f}) | {rates['link_bytes_per_s'] / 1e9:.2f} GB/s |")
    predicted = predict(job, config, rates, measured)
    print(f"== {JOB}: update {len(measured['every_step'])} of {len(measured['every_step'])} (every update's seconds:"
          f" {' '.join(f'{s:.1f}' for s in measured['every_step'])}), {measured['micro_batches']} learner micro-batches")
    print("| phase | planner s | measured s | measured / planner |\n|---|---|---|---|")
    for phase, seconds in predicted.items():
        got = measured["phases"][phase]
        print(f"| {phase} | {seconds:.2f} | {got:.2f} | {got / seconds:.2f} |")
    print("the measured update's spans (seconds from its first):\n| role | actor | what | start | seconds |\n|---|---|---|---|---|")
    for role, actor, what, start, seconds in measured["timeline"]:
        print(f"| {role} | {actor} | {what} | {start:.1f} | {seconds:.2f} |")
    worst = max(max(measured["phases"][p] / s, s / measured["phases"][p]) for p, s in predicted.items())
    print(f"RESULT planner vs measured: worst phase off by {worst:.2f}x (goal: within 2x)")


if __name__ == "__main__":
    main()
