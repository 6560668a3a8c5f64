"""`lt-opd` command line. Heavy libraries are imported inside the commands that need them."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

SET_HELP = "override a field of the job, e.g. --set optimizer.lr.language_model=2e-6 (repeatable; checked by the schema)"


def cmd_validate(args) -> int:
    from lt_opd_ray.config import JobConfigError, load_job
    from lt_opd_ray.runtime.job_inputs import read_job_inputs

    failed = 0
    for path in args.jobs:
        try:
            job = load_job(path, args.set)
        except JobConfigError as exc:
            print(exc, file=sys.stderr)
            failed += 1
            continue
        summary = f"{path}: ok ({job.name}: {job.model.path}, {job.budget.total_steps} steps, selector {job.selector.name}"
        if args.schema_only:
            print(summary + "; schema only, inputs not read)")
        else:
            inputs, problems = read_job_inputs(job, draw_generated=False)  # the data and benchmark files, read as `train` reads them
            if problems:
                print(f"{path}: {len(problems)} problem(s) with the job's inputs\n" + "\n".join(f"  {p}" for p in problems), file=sys.stderr)
                failed += 1
                continue
            print(summary + f", {inputs.rows} training rows)")
        if args.print:
            import yaml

            print(yaml.safe_dump(job.model_dump(mode="json"), sort_keys=False), end="")
    return 1 if failed else 0


def _load_job_or_report(path: str, overrides: list[str] = ()):
    """The validated job (`--set` overrides applied), or None after printing every problem of the YAML."""
    from lt_opd_ray.config import JobConfigError, load_job

    try:
        return load_job(path, overrides)
    except JobConfigError as exc:
        print(exc, file=sys.stderr)
        return None


# Exit codes of `lt-opd train` (README, "Faults"): what a script or a scheduler can act on.
EXIT_DONE, EXIT_UNEXPECTED, EXIT_REFUSED, EXIT_RESUMABLE, EXIT_INTERRUPTED = 0, 1, 2, 3, 130


def cmd_train(args) -> int:
    """Every run-ending error is one line on stderr: refused input (2), a role that died or stopped answering (3,
    with the checkpoint `--resume` continues from), anything else (1, its traceback kept in the run's error.log)."""
    from lt_opd_ray.core.errors import InputError
    from lt_opd_ray.core.storage import StorageError
    from lt_opd_ray.runtime.checkpoint_files import CheckpointError
    from lt_opd_ray.runtime.driver import PreflightError
    from lt_opd_ray.runtime.launch import RunFolderError
    from lt_opd_ray.runtime.resources import InsufficientResourcesError
    from lt_opd_ray.runtime.run_lock import RunLockedError
    from lt_opd_ray.runtime.waits import NoAnswerError, RoleDiedError

    if (job := _load_job_or_report(args.job, args.set)) is None:
        return EXIT_REFUSED
    try:
        if args.reference:
            _train_reference(job, args.steps or job.budget.total_steps)
        else:
            from lt_opd_ray.runtime.launch import train

            train(job, steps=args.steps, resume=args.resume, address=args.address, force=args.force)
    except (InputError, CheckpointError, PreflightError, RunFolderError, RunLockedError, InsufficientResourcesError, StorageError,
            FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_REFUSED
    except (RoleDiedError, NoAnswerError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_RESUMABLE
    except KeyboardInterrupt:  # Ctrl-C, or a second SIGTERM: stopped at once, the pools stopped on the way out
        print("stopped at once (Ctrl-C or a second SIGTERM); `--resume` continues from the newest checkpoint", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as exc:  # a bug or an environment we did not foresee: one line here, the traceback in the run folder
        log = _keep_traceback(job)
        first = (str(exc).strip().splitlines() or [""])[0][:300]
        print(f"error: {type(exc).__name__}: {first} (traceback in {log}; `--resume` continues from the newest checkpoint)", file=sys.stderr)
        return EXIT_UNEXPECTED
    return EXIT_DONE


def _keep_traceback(job) -> str:
    """The exception being handled, written with its traceback to <run folder>/error.log (or a temp file where the
    run folder is not writable); returns where."""
    import tempfile
    import time
    import traceback

    from lt_opd_ray.core.storage import RunStorage

    text = f"{time.strftime('%Y-%m-%d %H:%M:%S')} lt-opd train {job.name}\n{traceback.format_exc()}\n"
    try:
        folder = RunStorage(job.checkpoint.dir, job.checkpoint.staging_dir).local
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / "error.log"
        with path.open("a") as handle:
            handle.write(text)
    except OSError:
        handle, name = tempfile.mkstemp(prefix="lt-opd-error-", suffix=".log")
        with open(handle, "w") as out:
            out.write(text)
        path = name
    return str(path)


def _train_reference(job, steps: int) -> None:
    """The single-process reference update, step by step (no Ray)."""
    import time

    import transformers

    from lt_opd_ray.core.batch_order import batches
    from lt_opd_ray.reference import ReferenceTrainer
    from lt_opd_ray.sources.resolve import load_samples

    transformers.logging.set_verbosity_error()  # the tiny models' missing fast-kernel notices are noise here
    transformers.logging.disable_progress_bar()
    samples = load_samples(job.data.path, job.data.image_root, job.seed)
    trainer = ReferenceTrainer(job)
    print(f"{job.name}: {len(samples)} samples, {steps} updates, single-process reference update")
    for _, batch in zip(range(steps), batches(samples, job.sampling.prompts_per_step, job.data.shuffle_seed)):
        start = time.perf_counter()
        report = trainer.update(batch)
        s = report.stats
        print(
            f"step {report.step + 1:4d}/{steps}  budget {report.budget_bps / 100:5.2f}%  loss {s.loss:.5f}"
            f"  div {s.divergence:.5f}  is_w {s.importance_weight:.3f}  overlap {s.top_k_overlap:.3f}"
            f"  tokens {s.tokens}  grad {report.grad_norm:.3f}  {time.perf_counter() - start:.1f}s",
            flush=True,
        )


def cmd_submit(args) -> int:
    if _load_job_or_report(args.job, args.set) is None:  # refuse a bad YAML here, not after the upload
        return 2
    from lt_opd_ray.runtime.submit import submit

    train_args = [*(f"--set={override}" for override in args.set), *args.train_args]
    return submit(args.job, args.address, args.runtime_env, args.working_dir, train_args, wait=not args.no_wait)


def cmd_check_cluster(args) -> int:
    import yaml

    from lt_opd_ray.tools.cluster_check import check_cluster_file

    if (job := _load_job_or_report(args.job)) is None:
        return 2
    failed = 0
    for path in args.clusters:
        with open(path) as handle:
            problems = check_cluster_file(yaml.safe_load(handle), job, path)
        for problem in problems:
            print(problem, file=sys.stderr)
        print(f"{path}: {'ok' if not problems else f'{len(problems)} problem(s)'} for {args.job}")
        failed += bool(problems)
    return 1 if failed else 0


def cmd_build_tiny(args) -> int:
    from lt_opd_ray.models.tiny import build_tiny_model

    print(build_tiny_model(args.family, args.out, seed=args.seed))
    return 0


def cmd_ablation(args) -> int:
    import transformers

    from lt_opd_ray.tools.ablation import run_ablation

    transformers.logging.set_verbosity_error()
    if _load_job_or_report(args.job) is None:
        return 2
    try:
        results = run_ablation(args.job, args.out, list(range(args.seeds)), args.steps, args.arms)
    except ValueError as exc:  # unknown arms, a base job without eval data: refused before any run
        print(f"ablation: {exc}", file=sys.stderr)
        return 2
    print((Path(args.out) / "retain_table.md").read_text())
    print(f"wrote {args.out}/results.json, retain_table.md, retain_table.csv, curves.png in {results['seconds'] / 60:.1f} min")
    return 0


def cmd_export(args) -> int:
    from lt_opd_ray.core.compression import CompressionConfig
    from lt_opd_ray.serving.export import ExportError, export_student

    job = _load_job_or_report(args.job)
    if job is None:
        return 2
    try:
        out = export_student(job, args.out, step=args.step, force=args.force)
    except ExportError as exc:
        print(f"export failed: {exc}", file=sys.stderr)
        return 1
    compression = CompressionConfig.read(out)
    print(f"wrote {out}: a Hugging Face folder + lt_opd_compression.json ({compression.selector},"
          f" {compression.budget_bps / 100:g}%, k_min {compression.k_min})")
    return 0


def cmd_serve(args) -> int:
    import os

    from lt_opd_ray.serving.serve import serve_command

    try:
        argv, env = serve_command(args.model, args.host, args.port, args.dtype, args.max_model_len, extra=args.train_args)
    except (FileNotFoundError, ValueError) as exc:
        print(f"serve: {exc}", file=sys.stderr)
        return 2
    os.execvpe(argv[0], argv, env)  # the server replaces this process: signals reach it directly


def cmd_data(args) -> int:
    from tqdm import tqdm

    from lt_opd_ray.core.errors import InputError
    from lt_opd_ray.sources.prepare import DataError, prepare

    with tqdm(desc="rows", unit="row") as bar:
        def progress(done: int) -> None:
            bar.update(done - bar.n)

        try:
            manifest = prepare(args.source, args.out, args.images, args.shard_rows, args.max_shards, progress)
        except (DataError, InputError) as exc:
            bar.close()
            print(f"data: {exc}", file=sys.stderr)
            return 1
    if manifest is None:
        print(f"stopped after {args.max_shards} new shard(s); run the same command again to continue")
        return 0
    print(f"wrote {args.out}: {manifest['rows']} rows in {len(manifest['shards'])} shard(s) + manifest.json"
          f" (use it as data.path: {args.out})")
    return 0


def cmd_eval(args) -> int:
    import transformers

    from lt_opd_ray.core.errors import InputError
    from lt_opd_ray.evals.benchmarks import BenchmarkError
    from lt_opd_ray.evals.run import run_eval

    transformers.logging.set_verbosity_error()
    files = {}
    for spec in args.bench:
        name, _, path = spec.partition("=")
        if not path:
            print(f"eval: --bench {spec!r} is not NAME=FILE", file=sys.stderr)
            return 2
        files[name] = path
    try:
        run_eval(args.model, files, args.budgets, args.selectors, args.out, args.k_min, args.max_new_tokens, args.limit)
    except (BenchmarkError, InputError, ValueError) as exc:
        print(f"eval failed: {exc}", file=sys.stderr)
        return 2
    print((Path(args.out) / "retain_table.md").read_text())
    print(f"wrote {args.out}/results.json, retain_table.md, retain_table.csv, retain.png")
    return 0


def cmd_efficiency(args) -> int:
    import json

    from lt_opd_ray.core.compression import learnable_merge
    from lt_opd_ray.planning.efficiency import PRESETS, merge_parameters, patch_grid, prefill_cost

    if args.preset:
        config = PRESETS[args.preset]
    elif args.model is None:
        print(f"efficiency: give a model folder or --preset (one of {', '.join(PRESETS)})", file=sys.stderr)
        return 2
    else:
        path = Path(args.model) / "config.json"
        if not path.exists():
            print(f"efficiency: {path} not found (give a model folder or --preset)", file=sys.stderr)
            return 2
        config = json.loads(path.read_text())
    try:
        height, width = (int(v) for v in args.image.lower().split("x"))
    except ValueError:
        print(f"efficiency: --image {args.image!r} is not HEIGHTxWIDTH in pixels", file=sys.stderr)
        return 2
    grid = patch_grid(config, height, width)
    merging = args.token_merge or learnable_merge(config) is not None
    rows = [prefill_cost(config, args.text_tokens, [grid], bps, args.k_min, token_merge=merging) for bps in sorted(set(args.budgets + [10000]), reverse=True)]
    full = rows[0]
    print(f"{args.preset or args.model}: {args.text_tokens} text tokens + one {height}x{width} image"
          f" ({full.visual_tokens} visual tokens), bf16 KV; FLOPs = 2 per multiply-accumulate")
    print(f"{'budget':>7} {'tokens':>7} {'LM prefill TFLOPs':>18} {'vision TFLOPs':>14} {'KV cache MB':>12} {'GDN state MB':>13}"
          + (f" {'merge GFLOPs':>14}" if merging else ""))
    for bps, row in zip(sorted(set(args.budgets + [10000]), reverse=True), rows):
        print(f"{bps / 100:>6g}% {row.prefill_tokens:>7} {row.lm_flops / 1e12:>10.3f} ({row.lm_flops / full.lm_flops - 1:>+6.1%})"
              f" {row.vision_flops / 1e12:>14.3f} {row.kv_cache_bytes / 1e6:>6.2f} ({row.kv_cache_bytes / full.kv_cache_bytes - 1:>+6.1%})"
              f" {row.linear_state_bytes / 1e6:>13.2f}" + (f" {row.merge_flops / 1e9:>14.3f}" if merging else ""))
    if merging:
        print(f"learnable token merge: {merge_parameters(config):,} parameters; its GFLOPs (last column) are"
              f" {rows[-1].merge_flops / rows[-1].lm_flops:.3%} of the LM prefill at {min(args.budgets) / 100:g}%")
    return 0


def cmd_timeline(args) -> int:
    from lt_opd_ray.tools.timeline import busy_lines, draw, read_steps

    try:
        steps = read_steps(args.run, args.last)
    except (FileNotFoundError, ValueError) as exc:
        print(f"timeline: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out or Path(args.run) / "timeline.png")
    draw(steps, out)
    print("\n".join(busy_lines(steps)))
    print(f"wrote {out}")
    return 0


PAPER_SECONDS_PER_UPDATE = 311  # the paper's reported training time per update (8 GPUs)


def cmd_plan(args) -> int:
    import json

    from lt_opd_ray.config import JobConfigError, load_job
    from lt_opd_ray.planning.efficiency import PRESETS, preset_named_by
    from lt_opd_ray.planning.planner import (
        EFFICIENCY,
        EFFICIENCY_SOURCES,
        GPUS,
        SCHEDULES,
        best_split,
        job_split,
        learner_gb_per_gpu,
        plan,
        shapes_of,
        update_work,
        zero_stage_for,
    )

    try:
        job = load_job(args.job, args.set)
    except JobConfigError as exc:
        print(exc, file=sys.stderr)
        return 2
    config_path = Path(job.model.path) / "config.json"
    if args.preset:
        config, source = PRESETS[args.preset], f"preset {args.preset}"
    elif config_path.exists():
        config, source = json.loads(config_path.read_text()), str(config_path)
    elif preset := preset_named_by(job.model.path):
        config, source = PRESETS[preset], f"preset {preset} (named by model.path; {config_path} not here)"
    else:
        print(f"plan: {config_path} not found and model.path names no preset; pass --preset ({', '.join(PRESETS)})", file=sys.stderr)
        return 2
    efficiency = dict(EFFICIENCY)
    for item in args.efficiency:
        name, _, value = item.partition("=")
        if name not in efficiency:
            print(f"plan: --efficiency {item!r}: unknown name (known: {', '.join(efficiency)})", file=sys.stderr)
            return 2
        efficiency[name] = float(value)
    try:
        height, width = (int(v) for v in args.image.lower().split("x"))
    except ValueError:
        print(f"plan: --image {args.image!r} is not HEIGHTxWIDTH in pixels", file=sys.stderr)
        return 2
    gpu, shapes = GPUS[args.gpu], shapes_of(job, args.text_tokens, (height, width))
    split = job_split(job)
    if sum(split) != args.gpus:
        split = best_split(config, shapes, gpu, args.gpus, efficiency, "staleness 1").split
    print(f"ESTIMATE (analytic, not measured) for {args.job} on {args.gpus}x {gpu.name}; model {source}; {shapes.prompts} prompts x"
          f" {shapes.n} responses of up to {shapes.max_new_tokens} tokens (mean {efficiency['mean_response_fraction']:.0%}),"
          f" budget {shapes.budget_bps / 100:g}%")
    print("assumed efficiencies (none measured on a GPU; --efficiency NAME=VALUE to change):")
    for name, value in efficiency.items():
        print(f"  {name} {value:g}: {EFFICIENCY_SOURCES[name]}")
    one_node = sum(split) <= gpu.gpus_per_node
    print(f"links: weight sync and ZeRO collectives over {'NVLink' if one_node else 'the nodes network'}"
          f" ({gpu.link_gbps if one_node else gpu.network_gbps:g} GB/s); rollout engines decode {shapes.engine_batch or 'all their'} sequences at once"
          f" ({job.pools.rollout.backend}); teacher on {shapes.teacher_backend}"
          + (" (the prompt once per prompt)" if shapes.teacher_backend == "transformers" else " (the prompt prefilled with every response)"))
    rows = [("job's split" if split == job_split(job) else "split", plan(config, shapes, gpu, split, efficiency))]
    rows += [(f"best for {name}", best_split(config, shapes, gpu, args.gpus, efficiency, name)) for name in SCHEDULES]
    print(f"{'':<24} {'GPUs r/t/l':>10} {'rollout':>8} {'teacher':>8} {'learner':>8} {'sync':>6} | "
          + " ".join(f"{name + ' s/upd':>19}" for name in SCHEDULES))
    for label, p in rows:
        print(f"{label:<24} {'/'.join(map(str, p.split)):>10} {p.phases['rollout']:>7.1f}s {p.phases['teacher']:>7.1f}s"
              f" {p.phases['learner']:>7.1f}s {p.phases['sync']:>5.2f}s | " + " ".join(f"{p.step[name]:>18.1f}s" for name in SCHEDULES))
    chosen = rows[0][1]
    work, ranks = update_work(config, shapes, efficiency), chosen.split[2]
    for stage in (2, 3):
        need = learner_gb_per_gpu(work, ranks, stage)
        verdict = "fits" if need <= gpu.memory_gb else "DOES NOT FIT"
        print(f"learner memory per GPU ({rows[0][0]}, {ranks} ZeRO-{stage} ranks): {need:.1f} GB of {gpu.memory_gb:g} GB, {verdict}"
              + (" (the job's stage)" if stage == shapes.zero_stage else ""))
    best_stage = zero_stage_for(work, gpu, ranks)
    advice = ("more learner ranks, or GPUs with more memory" if best_stage is None else
              f"ZeRO-{best_stage}" + (" (fits, and gathers no parameters)" if best_stage == 2 else ""))
    print(f"learner ZeRO stage for this split: {advice}" + (f"; the job sets {shapes.zero_stage}" if best_stage != shapes.zero_stage else ""))
    for name in SCHEDULES:
        busy = ", ".join(f"{pool} {fraction:.0%}" for pool, fraction in chosen.busy[name].items())
        print(f"busy ({rows[0][0]}, {name}): {busy}; {PAPER_SECONDS_PER_UPDATE / chosen.step[name]:.1f}x the paper's {PAPER_SECONDS_PER_UPDATE} s/update")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lt-opd", description="Low-token on-policy self-distillation for VLMs.")
    sub = parser.add_subparsers(dest="command", required=True)

    validate = sub.add_parser("validate", help="check job YAML files against the schema, and read their data and benchmark files (no torch/Ray import)")
    validate.add_argument("jobs", nargs="+", help="job YAML files")
    validate.add_argument("--set", action="append", default=[], metavar="PATH=VALUE", help=SET_HELP)
    validate.add_argument("--print", action="store_true", help="print each job as resolved (defaults and --set applied)")
    validate.add_argument("--schema-only", action="store_true",
                          help="check the YAML against the schema only, without reading its data and benchmark files (validating a"
                               " cluster job on a machine that does not hold them)")
    validate.set_defaults(func=cmd_validate)

    train = sub.add_parser("train", help="run a training job on Ray (a local cluster unless RAY_ADDRESS/--address is set)")
    train.add_argument("job", help="job YAML file")
    train.add_argument("--more-updates", "--steps", dest="steps", type=int, default=None, metavar="N",
                       help="run N more updates from where the run starts (step 0, or the resumed checkpoint), then checkpoint"
                            " and stop (default: on to budget.total_steps)")
    train.add_argument("--resume", action="store_true", help="continue from the newest intact checkpoint in checkpoint.dir")
    train.add_argument("--force", action="store_true", help="start afresh in a checkpoint.dir that holds an earlier run (moved aside)")
    train.add_argument("--address", default=None, help="Ray cluster address to join (default: RAY_ADDRESS, else start one)")
    train.add_argument("--reference", action="store_true", help="run the single-process reference update instead (no Ray)")
    train.add_argument("--set", action="append", default=[], metavar="PATH=VALUE", help=SET_HELP)
    train.set_defaults(func=cmd_train)

    submit = sub.add_parser(
        "submit",
        help="submit `lt-opd train JOB` to a Ray cluster through Ray's job API",
        epilog="Arguments after -- are passed to the remote lt-opd train, e.g. -- --steps 10 --resume",
    )
    submit.add_argument("job", help="job YAML file (inside the working directory)")
    submit.add_argument("--address", default=None, help="Ray dashboard address (default: RAY_ADDRESS or http://127.0.0.1:8265)")
    submit.add_argument("--runtime-env", default="cluster/runtime_env.yaml", help="runtime env YAML")
    submit.add_argument("--working-dir", default=".", help="uploaded as the job's working directory")
    submit.add_argument("--no-wait", action="store_true", help="return after submitting instead of following the logs")
    submit.add_argument("--set", action="append", default=[], metavar="PATH=VALUE", help=SET_HELP + " (passed on to the remote train)")
    submit.set_defaults(func=cmd_submit)

    cluster = sub.add_parser("check-cluster", help="check cluster launcher / KubeRay YAMLs against a job's pools (offline)")
    cluster.add_argument("job", help="job YAML file")
    cluster.add_argument("clusters", nargs="+", help="cluster YAML files")
    cluster.set_defaults(func=cmd_check_cluster)

    ablation = sub.add_parser(
        "ablation", help="the paper's ablations on a toy task through the distributed runtime: retain table + curves"
    )
    ablation.add_argument("job", nargs="?", default="jobs/toy_circles.yaml", help="base job YAML (default: jobs/toy_circles.yaml)")
    ablation.add_argument("--out", default="runs/ablation", help="output folder")
    ablation.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1 per arm")
    ablation.add_argument("--steps", type=int, default=None, help="updates per run (curriculum rescaled; default: the job's)")
    ablation.add_argument("--arms", nargs="+", default=None, help="arms to train (default: the paper's table: sft fixed_prefix lt_opd_no_curriculum lt_opd lt_opd_reverse_kl; also lt_opd_token_merge)")
    ablation.set_defaults(func=cmd_ablation)

    export = sub.add_parser("export", help="write the trained student as a Hugging Face folder + its compression config")
    export.add_argument("job", help="the job YAML the student was trained with")
    export.add_argument("--out", required=True, help="output folder (assembled beside it, renamed into place)")
    export.add_argument("--step", type=int, default=None, help="export checkpoint step-N (default: <checkpoint.dir>/final)")
    export.add_argument("--force", action="store_true", help="replace an existing output folder")
    export.set_defaults(func=cmd_export)

    serve = sub.add_parser("serve", help="serve an exported student at its budget (vLLM, OpenAI-compatible); -- passes vLLM options")
    serve.add_argument("model", help="exported model folder")
    serve.add_argument("--host", default="127.0.0.1", help="bind address (default: localhost only)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--dtype", default=None, help="vLLM dtype (default: bf16 for Qwen3.5 on CPU, else auto)")
    serve.add_argument("--max-model-len", type=int, default=8192)
    serve.set_defaults(func=cmd_serve)

    data = sub.add_parser("data", help="verify and shard a training set (LT-14K layout, datasets folder, JSONL/parquet)")
    data.add_argument("source", help="LT-14K folder, datasets save_to_disk folder, or .jsonl/.parquet file")
    data.add_argument("--out", required=True, help="output folder (manifest.json is written last)")
    data.add_argument("--images", default=None, help="image folder of a JSONL/parquet source (default: its folder)")
    data.add_argument("--shard-rows", type=int, default=1000)
    data.add_argument("--max-shards", type=int, default=None, help="stop after N new shards (run again to continue)")
    data.set_defaults(func=cmd_data)

    evaluate = sub.add_parser("eval", help="score a model at full tokens and at budgets over local benchmarks; the retain table")
    evaluate.add_argument("model", help="model folder (or tiny:<family>, toy:<task>)")
    evaluate.add_argument("--bench", action="append", required=True, metavar="NAME=FILE",
                          help="a benchmark file; NAME one of mmbench, mmmu, vstar, hrbench, pope, gqa, textvqa, mme, ocrbench")
    evaluate.add_argument("--budgets", type=int, nargs="+", default=[500, 1000, 2500], help="budgets in basis points")
    evaluate.add_argument("--selectors", nargs="+", default=["cdpruner"])
    evaluate.add_argument("--k-min", type=int, default=1)
    evaluate.add_argument("--max-new-tokens", type=int, default=16)
    evaluate.add_argument("--limit", type=int, default=None, help="first N items of each benchmark")
    evaluate.add_argument("--out", default="runs/eval", help="output folder")
    evaluate.set_defaults(func=cmd_eval)

    efficiency = sub.add_parser("efficiency", help="analytic prefill FLOPs and KV-cache bytes of a model at visual budgets")
    efficiency.add_argument("model", nargs="?", default=None, help="model folder (its config.json)")
    efficiency.add_argument("--preset", choices=["qwen3.5-4b"], default=None, help="a built-in config instead of a folder")
    efficiency.add_argument("--text-tokens", type=int, default=84, help="text tokens of the prompt (default 84)")
    efficiency.add_argument("--image", default="896x832", help="image size HEIGHTxWIDTH in pixels (default 896x832)")
    efficiency.add_argument("--budgets", type=int, nargs="+", default=[2500, 1000, 500], help="budgets in basis points")
    efficiency.add_argument("--k-min", type=int, default=1)
    efficiency.add_argument("--token-merge", action="store_true", help="add the learnable token merge (on by itself for a folder that has one)")
    efficiency.set_defaults(func=cmd_efficiency)

    planner = sub.add_parser("plan", help="estimate seconds per update of a job on N GPUs per schedule, and a pool split (analytic)")
    planner.add_argument("job", help="job YAML")
    planner.add_argument("--gpus", type=int, required=True, help="GPUs in all")
    planner.add_argument("--gpu", choices=["a100", "a100-40gb", "h100", "h200"], default="a100")
    planner.add_argument("--preset", choices=["qwen3.5-4b"], default=None,
                         help="the model's layout when its config.json is not at hand (default: the preset model.path names, if any)")
    planner.add_argument("--set", action="append", default=[], metavar="PATH=VALUE", help=SET_HELP)
    planner.add_argument("--text-tokens", type=int, default=84, help="text tokens of a prompt (default 84)")
    planner.add_argument("--image", default="896x832", help="image size HEIGHTxWIDTH in pixels (default 896x832)")
    planner.add_argument("--efficiency", nargs="*", default=[], metavar="NAME=VALUE", help="override an assumed efficiency (see lt_opd_ray/planning/planner.py)")
    planner.set_defaults(func=cmd_plan)

    timeline = sub.add_parser("timeline", help="draw a run's per-update timeline (steps.jsonl) as a Gantt chart PNG; pool busy fractions")
    timeline.add_argument("run", help="the run's checkpoint.dir (holds steps.jsonl)")
    timeline.add_argument("--last", type=int, default=0, help="only the last K updates (default: all)")
    timeline.add_argument("--out", default=None, help="PNG path (default: RUN/timeline.png)")
    timeline.set_defaults(func=cmd_timeline)

    tiny = sub.add_parser("build-tiny", help="write a tiny random Qwen VLM folder (offline)")
    tiny.add_argument("family", choices=["qwen3_5", "qwen3_vl", "qwen2_5_vl"])
    tiny.add_argument("out", help="output folder")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.set_defaults(func=cmd_build_tiny)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # `lt-opd submit JOB [options] -- [lt-opd train options]`: what follows -- goes to the remote train
    train_args = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    args = build_parser().parse_args(argv)
    args.train_args = train_args
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
