"""Learner start-up memory under ZeRO-3: the whole model loaded per rank, then partitioned (what the learner did
before), against weights created partitioned (deepspeed.zero.Init through transformers, what it does now).

    python benchmarks/bench_learner_memory.py                 # the paper-shaped job's model, 2 ranks (~1 min on 2 cores)
    python benchmarks/bench_learner_memory.py --ranks 4

Each rank is a process of its own in a gloo group (as the learner actors are), built from the learner's own
pieces: `load_vlm`, `deepspeed_config`, `StudentObjective`, `build_optimizer`, `deepspeed.initialize`. Printed
per way and rank: the parameter bytes the rank holds once the model is loaded (what would sit on its GPU before
the engine exists), its anonymous resident memory (RssAnon: allocations, not the safetensors file's mapped pages)
after loading and after the engine is built, and its peak resident memory (ru_maxrss, file pages included). This
box has no GPU: on one, the first column is device memory.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import resource

JOB = "jobs/train_qwen35_shape.yaml"


def anon_mb() -> float:
    """RssAnon: resident memory that is not a mapped file (the weights' safetensors pages are)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssAnon:")) / 1024


def rank_main(rank: int, world: int, port: int, partitioned: bool, out) -> None:
    import deepspeed
    import torch

    from lt_opd_ray.config.loading import load_job
    from lt_opd_ray.core.optim import build_optimizer
    from lt_opd_ray.models.loading import load_vlm
    from lt_opd_ray.runtime.learner import StudentObjective, deepspeed_config, init_process_group
    from lt_opd_ray.sources.resolve import resolve_model_dir

    torch.set_num_threads(1)
    job = load_job(JOB)
    init_process_group(rank, world, "127.0.0.1", port, job.collective_timeout_s)
    config = deepspeed_config(job)
    _, model = load_vlm(resolve_model_dir(job.model.path), zero3_config=config if partitioned else None)
    tensors = [getattr(p, "ds_tensor", p) for p in model.parameters()]  # a partitioned parameter's own part
    loaded = sum(t.numel() * t.element_size() for t in tensors) / 2**20
    after_load = anon_mb()
    optimizer, scheduler = build_optimizer(model, job.optimizer)
    deepspeed.initialize(model=StudentObjective(model, job.objective), optimizer=optimizer, lr_scheduler=scheduler, config=config)
    out.put((rank, loaded, after_load, anon_mb(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024))
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
    from lt_opd_ray.config.loading import load_job
    from lt_opd_ray.sources.resolve import resolve_model_dir

    job = load_job(JOB)
    folder = resolve_model_dir(job.model.path)  # built once, before the ranks start
    size = sum(p.stat().st_size for p in folder.glob("*.safetensors")) / 2**20
    print(f"== learner start-up memory: {JOB} ({job.model.path}, {size:.0f} MB of fp32 weights), ZeRO-3, {args.ranks} ranks (gloo, CPU)")
    print("| load | rank | parameters held after loading MB | RssAnon after loading MB | RssAnon after engine MB | peak RSS MB |")
    print("|---|---|---|---|---|---|")
    held = {}
    for label, partitioned in (("whole model, then partitioned", False), ("created partitioned (zero.Init)", True)):
        rows = measure(args.ranks, partitioned)
        held[label] = max(row[1] for row in rows)
        for rank, loaded, after_load, after_engine, peak in rows:
            print(f"| {label} | {rank} | {loaded:.1f} | {after_load:.0f} | {after_engine:.0f} | {peak:.0f} |")
    whole, split = held.values()
    print(f"parameters a rank holds once loaded, worst rank: {whole:.1f} MB -> {split:.1f} MB ({whole / split:.2f}x: the model / its share)")


if __name__ == "__main__":
    main()
