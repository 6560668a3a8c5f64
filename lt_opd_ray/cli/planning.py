"""Reading and planning runs: `lt-opd timeline`, `plan`. Heavy libraries are imported inside the commands that need them."""

from __future__ import annotations

import sys
from pathlib import Path

from lt_opd_ray.cli.options import SET_HELP, whole_number
from lt_opd_ray.planning.presets import PRESETS


def cmd_timeline(args) -> int:
    from lt_opd_ray.tools.timeline import busy_lines, draw, out_problem, read_steps

    out = Path(args.out or Path(args.run) / "timeline.png")
    try:
        steps = read_steps(args.run, args.last)
    except (FileNotFoundError, ValueError) as exc:
        print(f"timeline: {exc}", file=sys.stderr)
        return 2
    if problem := out_problem(out):
        print(f"timeline: {problem}", file=sys.stderr)
        return 2
    draw(steps, out)
    print("\n".join(busy_lines(steps)))
    print(f"wrote {out}")
    return 0


PAPER_SECONDS_PER_UPDATE = 311  # the paper's reported training time per update (8 GPUs)


def cmd_plan(args) -> int:
    import json

    from lt_opd_ray.config.loading import JobConfigError, load_job
    from lt_opd_ray.planning.planner import (
        EFFICIENCY,
        EFFICIENCY_SOURCES,
        GPUS,
        SCHEDULES,
        best_split,
        job_split,
        judge_seconds,
        reward_gpus,
        teacher_gpus,
        learner_gb_per_gpu,
        plan,
        shapes_of,
        update_work,
        zero_stage_for,
    )
    from lt_opd_ray.planning.presets import preset_named_by

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
        try:
            fraction = float(value)
        except ValueError:
            fraction = None
        if fraction is None or not 0 < fraction <= 1:
            print(f"plan: --efficiency {item!r}: a fraction, more than 0 and at most 1", file=sys.stderr)
            return 2
        efficiency[name] = fraction
    try:
        height, width = (int(v) for v in args.image.lower().split("x"))
    except ValueError:
        print(f"plan: --image {args.image!r} is not HEIGHTxWIDTH in pixels", file=sys.stderr)
        return 2
    if args.frames < 0 or args.frames % 2:
        print(f"plan: --frames {args.frames}: an even number of frames (two make one temporal patch)", file=sys.stderr)
        return 2
    gpu, shapes = GPUS[args.gpu], shapes_of(job, args.text_tokens, (height, width), args.frames)
    split, gpus = job_split(job), args.gpus - reward_gpus(job)  # the judge's GPUs are its own: the splits share the rest
    try:
        if sum(split) != gpus:
            split = best_split(config, shapes, gpu, gpus, efficiency, "staleness 1").split
        best = [(f"best for {name}", best_split(config, shapes, gpu, gpus, efficiency, name)) for name in SCHEDULES]
    except ValueError as exc:  # "no split of 3 GPUs holds the learner's states ..."
        print(f"plan: {exc}", file=sys.stderr)
        return 2
    print(f"ESTIMATE (analytic, not measured) for {args.job} on {args.gpus}x {gpu.name}; model {source}; {shapes.prompts} prompts x"
          f" {shapes.n} responses of up to {shapes.max_new_tokens} tokens (mean {efficiency['mean_response_fraction']:.0%}),"
          f" budget {shapes.budget_bps / 100:g}%; each prompt shows "
          + (f"a {shapes.frames}-frame clip of {height}x{width} frames" if shapes.frames else f"one {height}x{width} image"))
    print("assumed efficiencies (none measured on a GPU; --efficiency NAME=VALUE to change):")
    for name, value in efficiency.items():
        print(f"  {name} {value:g}: {EFFICIENCY_SOURCES[name]}")
    one_node = sum(split) <= gpu.gpus_per_node
    print(f"links: weight sync and ZeRO collectives over {'NVLink' if one_node else 'the nodes network'}"
          f" ({gpu.link_gbps if one_node else gpu.network_gbps:g} GB/s); rollout engines decode {shapes.engine_batch or 'all their'} sequences at once"
          f" ({job.pools.rollout.backend}); "
          + (f"teacher on {shapes.teacher_backend}" + (" (the prompt once per prompt)" if shapes.teacher_backend == "transformers" else
                                                       " (the prompt prefilled with every response)") if shapes.teacher_backend else
             f"no teacher pool (objective.mode {job.objective.mode} reads no teacher scores): the {teacher_gpus(job)} GPU(s) of"
             " pools.teacher are free, and the splits below give the teacher none"))
    rows = [("job's split" if split == job_split(job) else "split", plan(config, shapes, gpu, split, efficiency))]
    if job.reward.uses_judge:
        reward, judge_config = job.pools.reward, Path(job.reward.judge) / "config.json"
        try:
            layout = (json.loads(judge_config.read_text()), str(judge_config)) if judge_config.exists() else (config, f"the student's layout ({judge_config} not here)")
        except (OSError, ValueError) as exc:
            print(f"plan: reward.judge {judge_config}: not a readable config.json ({exc})", file=sys.stderr)
            return 2
        judged = judge_seconds(layout[0], shapes, gpu, reward_gpus(job), efficiency) if reward_gpus(job) else float("inf")
        rollout = rows[0][1].phases["rollout"]
        print(f"reward judge (reward.judge {job.reward.judge}, {layout[1]}): pools.reward takes {reward_gpus(job)} GPU(s) ({reward.replicas}"
              f" replica(s) x {reward.gpus:g}) of the {args.gpus}; the splits below share the other {gpus}. Its forwards: {judged:.1f} s an update,"
              f" while the rollouts take {rollout:.1f}s ({rows[0][0]})" + ("" if judged <= rollout else
                                                                            ": the judge is slower than the rollouts it scores and bounds the update"))
    rows += best
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
        print(f"busy ({rows[0][0]}, {name}): {busy}; {chosen.step[name]:.0f} s/update, {_against_paper(chosen.step[name])}")
    if note := job.teacher_admission_note():
        print(note)
    return 0


def _against_paper(seconds: float) -> str:
    """An update's time next to the paper's, in words: faster or slower, and by how much."""
    ratio = PAPER_SECONDS_PER_UPDATE / seconds
    return (f"{ratio:.1f}x faster than the paper's {PAPER_SECONDS_PER_UPDATE} s" if ratio >= 1
            else f"{1 / ratio:.1f}x slower than the paper's {PAPER_SECONDS_PER_UPDATE} s")


def register(sub) -> None:
    """This module's subcommands on the `lt-opd` parser."""
    timeline = sub.add_parser("timeline", help="draw a run's per-update timeline (steps.jsonl) as a Gantt chart PNG; pool busy fractions")
    timeline.add_argument("run", help="the run's checkpoint.dir (holds steps.jsonl)")
    timeline.add_argument("--last", type=whole_number(1), default=None, help="only the last K updates (default: all)")
    timeline.add_argument("--out", default=None, help="PNG path (default: RUN/timeline.png); a chart timeline drew is redrawn, any other file is left alone")
    timeline.set_defaults(func=cmd_timeline)

    planner = sub.add_parser("plan", help="estimate seconds per update of a job on N GPUs per schedule, and a pool split (analytic)")
    planner.add_argument("job", help="job YAML")
    planner.add_argument("--gpus", type=whole_number(1), required=True, help="GPUs in all")
    planner.add_argument("--gpu", choices=["a100", "a100-40gb", "h100", "h200"], default="a100")
    planner.add_argument("--preset", choices=list(PRESETS), default=None,
                         help="the model's layout when its config.json is not at hand (default: the preset model.path names, if any)")
    planner.add_argument("--set", action="append", default=[], metavar="PATH=VALUE", help=SET_HELP)
    planner.add_argument("--text-tokens", type=whole_number(0), default=84, help="text tokens of a prompt (default 84)")
    planner.add_argument("--image", default="896x832", help="image size HEIGHTxWIDTH in pixels (default 896x832)")
    planner.add_argument("--frames", type=whole_number(0), default=0, help="a clip of this many frames of --image's size per prompt instead of one image")
    planner.add_argument("--efficiency", nargs="*", default=[], metavar="NAME=VALUE", help="override an assumed efficiency (see lt_opd_ray/planning/planner.py)")
    planner.set_defaults(func=cmd_plan)
