"""Running jobs: `lt-opd validate`, `train`, `submit`, `check-cluster`, `ablation`, `build-tiny`. Heavy libraries are imported inside the commands that need them."""

from __future__ import annotations

import sys
from pathlib import Path

from lt_opd_ray.cli.options import SET_HELP, load_job_or_report
from lt_opd_ray.core.families import FAMILIES


def cmd_validate(args) -> int:
    from lt_opd_ray.config.loading import JobConfigError, load_job
    from lt_opd_ray.core.redact import redact
    from lt_opd_ray.runtime.job_inputs import read_job_inputs

    failed = 0
    for path in args.jobs:
        try:
            job = load_job(path, args.set)
        except JobConfigError as exc:
            print(redact(str(exc)), file=sys.stderr)
            failed += 1
            continue
        summary = redact(f"{path}: ok ({job.name}: {job.model.path}, {job.budget.total_steps} steps, selector {job.selector.name}")
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

            from lt_opd_ray.core.redact import redact_values

            print(yaml.safe_dump(redact_values(job.model_dump(mode="json")), sort_keys=False), end="")
    return 1 if failed else 0


# Exit codes of `lt-opd train` (docs/operating.md, "Faults"): what a script or a scheduler can act on.
EXIT_DONE, EXIT_UNEXPECTED, EXIT_REFUSED, EXIT_RESUMABLE, EXIT_INTERRUPTED = 0, 1, 2, 3, 130


def cmd_train(args) -> int:
    """Every run-ending error is one line on stderr: refused input (2), a role that died or stopped answering (3,
    with the checkpoint `--resume` continues from), anything else (1, its traceback kept in the run's error.log)."""
    from lt_opd_ray.core.errors import InputError
    from lt_opd_ray.core.redact import redact
    from lt_opd_ray.core.storage import StorageError
    from lt_opd_ray.runtime.checkpoint_files import CheckpointError
    from lt_opd_ray.runtime.launch import RunFolderError
    from lt_opd_ray.runtime.preflight import PreflightError
    from lt_opd_ray.runtime.resources import InsufficientResourcesError
    from lt_opd_ray.runtime.run_lock import RunLockedError
    from lt_opd_ray.runtime.waits import NoAnswerError, RoleDiedError, in_words

    if (job := load_job_or_report(args.job, args.set)) is None:
        return EXIT_REFUSED
    try:
        if args.reference:
            _train_reference(job, args.steps or job.budget.total_steps)
        else:
            from lt_opd_ray.runtime.launch import train

            train(job, steps=args.steps, resume=args.resume, address=args.address, force=args.force)
    except (InputError, CheckpointError, PreflightError, RunFolderError, RunLockedError, InsufficientResourcesError, StorageError,
            FileNotFoundError) as exc:
        print(f"error: {redact(str(exc))}", file=sys.stderr)
        return EXIT_REFUSED
    except (RoleDiedError, NoAnswerError) as exc:
        print(f"error: {redact(str(exc))}", file=sys.stderr)
        return EXIT_RESUMABLE
    except KeyboardInterrupt:  # Ctrl-C, or a second SIGTERM: stopped at once, the pools stopped on the way out
        print(f"stopped at once (Ctrl-C or a second SIGTERM); {_resume_hint(job)}", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as exc:  # a bug or an environment we did not foresee: one line here, the traceback in the run folder
        log = _keep_traceback(job)
        print(redact(f"error: {in_words(exc)} (traceback in {log}; {_resume_hint(job)})"), file=sys.stderr)
        return EXIT_UNEXPECTED
    return EXIT_DONE


def _resume_hint(job) -> str:
    """What `--resume` would continue from: the newest checkpoint, or that there is none to continue."""
    from lt_opd_ray.core.storage import RunStorage

    try:
        latest = RunStorage(job.checkpoint.dir, job.checkpoint.staging_dir).read_text("latest")
    except Exception:  # an unreachable storage: say nothing it cannot tell
        latest = None
    if latest:
        return f"`--resume` continues from {latest.strip()}"
    return "no checkpoint was written, so a new run starts from the beginning"


def _keep_traceback(job) -> str:
    """The exception being handled, written with its traceback to <run folder>/error.log (or a temp file where the
    run folder is not writable); returns where."""
    import tempfile
    import time
    import traceback

    from lt_opd_ray.core.redact import redact
    from lt_opd_ray.core.storage import RunStorage

    text = redact(f"{time.strftime('%Y-%m-%d %H:%M:%S')} lt-opd train {job.name}\n{traceback.format_exc()}\n")
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
    from lt_opd_ray.runtime.launch import shown
    from lt_opd_ray.sources.resolve import load_samples

    transformers.logging.set_verbosity_error()  # the tiny models' missing fast-kernel notices are noise here
    transformers.logging.disable_progress_bar()
    samples = load_samples(job.data.path, job.data.image_root, job.seed, job.data.allow_outside_root)
    trainer = ReferenceTrainer(job, rows=samples)
    print(f"{job.name}: {len(samples)} samples, {steps} updates, single-process reference update")
    for _, batch in zip(range(steps), batches(samples, job.sampling.prompts_per_step, job.data.shuffle_seed)):
        start = time.perf_counter()
        report = trainer.update(batch)
        s = report.stats
        print(
            f"step {report.step + 1:4d}/{steps}  budget {report.budget_bps / 100:5.2f}%  loss {s.loss:.5f}"
            f"  div {shown(s.divergence, '.5f')}"
            + (f"  reward {report.reward_mean:.3f}" if report.reward_mean is not None else "")
            + (f" (groups resampled {report.resampled_groups}, kept flat {report.flat_groups})" if report.resampled_groups is not None else "")
            + f"  is_w {s.importance_weight:.3f}  overlap {shown(s.top_k_overlap, '.3f')}"
            f"  tokens {s.tokens}  grad {report.grad_norm:.3f}  {time.perf_counter() - start:.1f}s",
            flush=True,
        )


def cmd_submit(args) -> int:
    from lt_opd_ray.core.redact import redact, redact_values

    if (job := load_job_or_report(args.job, args.set)) is None:  # refuse a bad YAML here, not after the upload
        return 2
    from lt_opd_ray.runtime.submit import ClusterRefusedError, submit

    train_args = [*(f"--set={override}" for override in args.set), *args.train_args]
    dumped = job.model_dump(mode="json")
    if redact_values(dumped) != dumped or any(redact(a) != a for a in train_args):
        print(f"error: {args.job} (with its --set values) carries credentials in a URI; Ray keeps a job's entrypoint and working"
              " directory where every holder of the cluster's token can read them: pass them through the environment"
              ' (an instance role, a secret; docs/operating.md, "Security")', file=sys.stderr)
        return 2
    try:
        return submit(args.job, args.address, args.runtime_env, args.working_dir, train_args, wait=not args.no_wait)
    except ClusterRefusedError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def cmd_check_cluster(args) -> int:
    import yaml

    from lt_opd_ray.tools.cluster_check import check_cluster_file

    if (job := load_job_or_report(args.job)) is None:
        return 2
    failed = 0
    for path in args.clusters:
        try:
            text = Path(path).read_text()
        except OSError as exc:
            print(f"check-cluster: {path}: {exc.strerror.lower() if exc.strerror else exc}", file=sys.stderr)
            return 2
        problems = check_cluster_file(yaml.safe_load(text), job, path)
        for problem in problems:
            print(problem, file=sys.stderr)
        print(f"{path}: {'ok' if not problems else f'{len(problems)} problem(s)'} for {args.job}")
        failed += bool(problems)
    return 2 if failed else 0  # a config it cannot prove safe is refused


def cmd_ablation(args) -> int:
    import transformers

    from lt_opd_ray.runtime.resources import InsufficientResourcesError
    from lt_opd_ray.tools.ablation import StudyStopped, run_ablation

    transformers.logging.set_verbosity_error()
    if args.plan:
        return run_study_plan(args)
    if load_job_or_report(args.job) is None:
        return 2
    try:
        results = run_ablation(args.job, args.out, list(range(args.seeds)), args.updates, args.arms, resume=args.resume,
                               lr_scales=args.lr_scales, rl_variants=args.rl_variants, accept_grid_ends=args.accept_grid_ends,
                               choices_from=args.choices_from)
    except (ValueError, InsufficientResourcesError) as exc:  # unknown arms, a base job without eval data, a taken port: before any run
        print(f"ablation: {exc}", file=sys.stderr)
        return 2
    except StudyStopped as exc:  # SIGTERM inside a run
        print(f"ablation: {exc}", file=sys.stderr)
        return EXIT_RESUMABLE
    print((Path(args.out) / "retain_table.md").read_text())
    print(f"wrote {args.out}/results.json, retain_table.md, retain_table.csv, curves.png in {results['seconds'] / 60:.1f} min")
    if "grid_ends" in results:
        print("ablation: stopped after the learning-rate runs: " + ", ".join(f"{arm} chose {scale:g}x" for arm, scale in results["grid_ends"].items())
              + ", an end of --lr-scales; add a scale beyond it and --resume (or --accept-grid-ends)", file=sys.stderr)
        return EXIT_RESUMABLE
    return 0


def run_study_plan(args) -> int:
    """`lt-opd ablation --plan PLAN`: the study and the verdict the plan file names (tools/plans.py)."""
    from lt_opd_ray.runtime.resources import InsufficientResourcesError
    from lt_opd_ray.tools.ablation import StudyStopped, run_plan
    from lt_opd_ray.tools.plans import read_plan

    given = [flag for flag, value in (("--arms", args.arms), ("--lr-scales", args.lr_scales), ("--rl-variants", args.rl_variants),
                                      ("--choices-from", args.choices_from), ("--updates", args.updates)) if value is not None]
    if given:
        print(f"ablation: --plan names the study whole; {', '.join(given)} belong in the plan file", file=sys.stderr)
        return 2
    try:
        results, _ = run_plan(args.plan, resume=args.resume)
    except (ValueError, InsufficientResourcesError) as exc:
        print(f"ablation: {exc}", file=sys.stderr)
        return 2
    except StudyStopped as exc:
        print(f"ablation: {exc}", file=sys.stderr)
        return EXIT_RESUMABLE
    out = Path(read_plan(args.plan).out)
    print((out / "verdict.md").read_text())
    print(f"wrote {out}/results.json, verdict.md, statistic.csv, retain_table.md, curves.png in {results['seconds'] / 60:.1f} min")
    return 0


def cmd_build_tiny(args) -> int:
    from lt_opd_ray.models.tiny import build_tiny_model

    print(build_tiny_model(args.family, args.out, seed=args.seed))
    return 0


def register(sub) -> None:
    """This module's subcommands on the `lt-opd` parser."""
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
    ablation.add_argument("--updates", type=int, default=None, help="updates per run (curriculum rescaled; default: the job's)")
    ablation.add_argument("--arms", nargs="+", default=None, help="arms to train (default: the paper's table: sft fixed_prefix lt_opd_no_curriculum lt_opd lt_opd_reverse_kl; also sequence_kd teacher_prefix (on the teacher's samples), lt_opd_token_merge, lt_opd_no_hold, the RL baselines grpo dapo gspo (answer reward), and oracle_sft (SFT on the true labels: the bound))")
    ablation.add_argument("--lr-scales", type=float, nargs="+", default=None, metavar="SCALE",
                          help="choose each arm's learning rates first: one run per scale of the job's (e.g. 0.3 1 3), scored on"
                               " the toy task's validation rows; the arm's seeds train at the best")
    ablation.add_argument("--rl-variants", nargs="+", default=None, metavar="VARIANT",
                          help="then try each RL arm at its chosen learning rates with these variants: 2x_group (twice the group,"
                               " half the prompts), 0.5x_clip, 2x_clip (its clip range halved, doubled), scored on the validation"
                               " rows; its seeds train with the best, or its own settings")
    ablation.add_argument("--accept-grid-ends", action="store_true",
                          help="go on to the variants and seeds when an arm's learning rates are chosen at an end of --lr-scales"
                               " (by default the study stops there, exit 3, so that the grid is extended first)")
    ablation.add_argument("--choices-from", default=None, metavar="RESULTS",
                          help="train every arm at the learning rates (and RL variant) an earlier study of the same task chose on"
                               " validation rows (its results.json), tuning nothing again: a longer run of the same arms")
    ablation.add_argument("--plan", default=None, metavar="PLAN",
                          help="a pre-registered contrast's plan file (YAML: tools/study_plan.py): the study it names, and the verdict"
                          " its rule computes (verdict.md, statistic.csv)")
    ablation.add_argument("--resume", action="store_true", help="keep the finished runs of --out's results.json (the same study; --lr-scales may add"
                          " scales, --rl-variants variants, while no seed has trained) and train only the missing ones")
    ablation.set_defaults(func=cmd_ablation)

    tiny = sub.add_parser("build-tiny", help="write a tiny random VLM folder of a supported family (offline)")
    tiny.add_argument("family", choices=list(FAMILIES))
    tiny.add_argument("out", help="output folder")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.set_defaults(func=cmd_build_tiny)
