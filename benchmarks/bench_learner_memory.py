"""Learner start-up memory under ZeRO-3: the whole model loaded per rank, then partitioned (what the learner did
before), against weights created partitioned (deepspeed.zero.Init through transformers, what it does now).

    python benchmarks/bench_learner_memory.py                 # the paper-shaped job's model, 2 ranks (~1 min on 2 cores)
    python benchmarks/bench_learner_memory.py --ranks 4

Each rank is a process of its own in a gloo group (as the learner actors are), built from the learner's own
pieces: `load_vlm`, `deepspeed_config`, `StudentObjective`, `build_optimizer`, `deepspeed.initialize`. Printed
per way: the peak resident memory of each rank (ru_maxrss: everything the process touched), its resident memory
after the engine is built, and the parameter bytes the rank holds (its partition). On a GPU the same bytes would
sit in device memory; this box has none, so the figures are host memory.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import resource

JOB = "jobs/train_qwen35_shape.yaml"


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def rank_main(rank: int, world: int, port: int, partitioned: bool, out) -> None:
    import deepspeed
    import torch

    from lt_opd_ray.config import load_job
    from lt_opd_ray.models.loading import load_vlm
    from lt_opd_ray.optim import build_optimizer
    from lt_opd_ray.runtime.learner import StudentObjective, deepspeed_config, init_process_group

    torch.set_num_threads(1)
    job = load_job(JOB)
    init_process_group(rank, world, "127.0.0.1", port)
    config = deepspeed_config(job)
    before = rss_mb()
    _, model = load_vlm(job.model.path, zero3_config=config if partitioned else None)
    optimizer, scheduler = build_optimizer(model, job.optimizer)
    engine, _, _, _ = deepspeed.initialize(model=StudentObjective(model, job.objective), optimizer=optimizer, lr_scheduler=scheduler, config=config)
    held = sum(p.ds_tensor.numel() * p.ds_tensor.element_size() for p in engine.module.parameters())
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    out.put((rank, peak, rss_mb(), before, held / 2**20))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def measure(world: int, partitioned: bool) -> list[tuple]:
    from lt_opd_ray.runtime.learner_group import free_port

    context = mp.get_context("spawn")
    out, port = context.Queue(), free_port()
    ranks = [context.Process(target=rank_main, args=(r, world, port, partitioned, out)) for r in range(world)]
    for process in ranks:
        process.start()
    results = sorted(out.get(timeout=600) for _ in ranks)
    for process in ranks:
        process.join(timeout=120)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    args = parser.parse_args()
    from lt_opd_ray.config import load_job
    from lt_opd_ray.models.loading import resolve_model_dir

    job = load_job(JOB)
    folder = resolve_model_dir(job.model.path)  # built once, before the ranks start
    size = sum(p.stat().st_size for p in folder.glob("*.safetensors")) / 2**20
    print(f"== learner start-up memory: {JOB} ({job.model.path}, {size:.0f} MB of fp32 weights), ZeRO-3, {args.ranks} ranks (gloo, CPU)")
    print("| load | rank | peak RSS MB | RSS after engine MB | RSS before load MB | parameters held MB |")
    print("|---|---|---|---|---|---|")
    peaks = {}
    for label, partitioned in (("whole model, then partitioned", False), ("created partitioned (zero.Init)", True)):
        rows = measure(args.ranks, partitioned)
        peaks[label] = max(peak - before for _, peak, _, before, _ in rows)
        for rank, peak, after, before, held in rows:
            print(f"| {label} | {rank} | {peak:.0f} | {after:.0f} | {before:.0f} | {held:.1f} |")
    whole, split = peaks.values()
    print(f"peak growth over the pre-load RSS, worst rank: {whole:.0f} MB -> {split:.0f} MB ({whole / split:.2f}x)")


if __name__ == "__main__":
    main()
