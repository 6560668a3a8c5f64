"""What a job reads before it starts (its training rows, its evaluation rows, its benchmark files), checked alike by
`lt-opd validate` and by `train`'s preflight, so a file `train` would refuse is named by `validate` first. No torch,
no Ray."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from lt_opd_ray.config.schema import JobConfig
from lt_opd_ray.core.families import Family
from lt_opd_ray.core.samples import Sample
from lt_opd_ray.sources.resolve import embedded_model, generated_rows, load_samples, resolve_model_dir


@dataclass(frozen=True)
class JobInputs:
    rows: int | None  # training rows; None where data.path does not read (a problem says why)
    samples: list[Sample] | None  # the rows themselves; None where not drawn (validate) or unreadable
    eval_samples: list[Sample] | None  # None: no eval.data, not drawn, or unreadable
    benchmarks: dict[str, list]  # name -> items (evals.benchmarks.Item); a file that does not read is left out
    model_dir: Path | None  # model.path's folder; None where it is missing, or embedded and not built (validate)


def read_job_inputs(job: JobConfig, draw_generated: bool = True) -> tuple[JobInputs, list[str]]:
    """Every input of the job read as training reads it, and one line per problem (file, row and field named).
    `draw_generated=False` (validate): synthetic and toy rows are counted from their spec, not drawn; they hold no
    file that could be missing or damaged."""
    from lt_opd_ray.evals.benchmarks import benchmark

    problems: list[str] = []

    def attempt(read):
        try:
            return read()
        except ValueError as exc:  # InputError, BenchmarkError: each names its file
            problems.append(str(exc))
            return None

    def rows_of(spec: str) -> list[Sample] | None:
        if not draw_generated and generated_rows(spec) is not None:
            return None
        return load_samples(spec, job.data.image_root, job.seed, job.data.allow_outside_root)

    samples = attempt(lambda: rows_of(job.data.path))
    generated = generated_rows(job.data.path)  # its shape was checked by the schema
    rows = len(samples) if samples is not None else generated.count if generated is not None else None
    if rows is not None and job.sampling.prompts_per_step > rows:
        problems.append(f"sampling.prompts_per_step ({job.sampling.prompts_per_step}) is more than the {rows} rows of"
                        f" data.path {job.data.path!r}: an update's prompts are distinct rows")
    if samples is not None and job.objective.prefixes == "dataset" and (lacking := [s.uid for s in samples if not s.response]):
        problems.append(f"objective.mode {job.objective.mode} trains on the rows' own responses, but {len(lacking)} of the {len(samples)}"
                        f" rows of data.path {job.data.path!r} carry none ({', '.join(lacking[:3])}{', ...' if len(lacking) > 3 else ''}):"
                        " give each row a `response`, or train on the teacher's (sequence_kd, teacher_prefix)")
    if job.reward.name is not None:
        problems += reward_problems(job.reward.name, samples, job.data.path)
    eval_samples = attempt(lambda: rows_of(job.eval.data)) if job.eval.data else None
    if eval_samples is not None and (unscorable := [s.uid for s in eval_samples if s.answer is None]):
        problems.append(f"{len(unscorable)} of the {len(eval_samples)} rows of eval.data {job.eval.data!r} carry no reference answer"
                        f" ({', '.join(unscorable[:3])}{', ...' if len(unscorable) > 3 else ''}): an evaluation scores each"
                        " row's answer, so give each an `answer`")
    model_dir = None
    if draw_generated or not embedded_model(job.model.path):  # validate names a missing folder; it builds no embedded model
        try:
            model_dir = resolve_model_dir(job.model.path)  # builds an embedded model once, not in every actor
        except FileNotFoundError as exc:
            problems.append(str(exc))
    if job.reward.uses_judge and (draw_generated or not embedded_model(job.reward.judge)):
        try:
            resolve_model_dir(job.reward.judge)  # builds an embedded judge once, not in every replica
        except FileNotFoundError:
            problems.append(f"reward.judge {job.reward.judge!r}: no judge model there (a Hugging Face model folder with its"
                            " config.json, tiny:<family> or toy:<task>)")
    if samples is None and generated is not None and generated.images > job.data.max_images:  # not drawn (validate)
        problems.append(f"data.path {job.data.path!r} shows {generated.images} images per row, more than data.max_images"
                        f" ({job.data.max_images}): raise data.max_images")
    for spec, rows_read in ((job.data.path, samples), (job.eval.data, eval_samples)):
        if rows_read is not None and (crowded := [s.uid for s in rows_read if len(s.images) > job.data.max_images]):
            most = max(len(s.images) for s in rows_read)
            problems.append(f"{len(crowded)} rows of {spec!r} show more than data.max_images ({job.data.max_images}) images"
                            f" ({', '.join(crowded[:3])}{', ...' if len(crowded) > 3 else ''}; the most is {most}): raise data.max_images")
        clips = [s.uid for s in rows_read if s.video is not None] if rows_read is not None else []
        drawn_clips = rows_read is None and (drawn := generated_rows(spec) if spec else None) is not None and drawn.video
        vllm = [role for role in ("rollout", "teacher") if getattr(job.pools, role).backend == "vllm"]
        if (clips or drawn_clips) and vllm and job.data.max_videos == 0:
            shown = f"{len(clips)} rows of {spec!r} show a video ({', '.join(clips[:3])}{', ...' if len(clips) > 3 else ''})" if clips else f"{spec!r} draws videos"
            problems.append(f"{shown}, but data.max_videos is 0 and pools.{' and pools.'.join(vllm)} run vLLM, whose engines reserve"
                            " room for a clip only when asked: set data.max_videos: 1")
    if model_dir is not None and (vllm_roles := [role for role in ("rollout", "teacher") if getattr(job.pools, role).backend == "vllm"]):
        problems += vllm_model_problems(job, model_dir, vllm_roles)
    if model_dir is not None and "fastv" in job.eval.selectors:
        problems += fastv_model_problems(job, model_dir)
    loaded = {name: attempt(lambda name=name, path=path: benchmark(name).load(path)) for name, path in job.eval.benchmarks.items()}
    return JobInputs(rows, samples, eval_samples, {name: items for name, items in loaded.items() if items is not None}, model_dir), problems


def vllm_model_problems(job: JobConfig, model_dir: Path, roles: list[str]) -> list[str]:
    """What a vLLM engine of `roles` would refuse of the model folder wherever it runs (core/families.vllm_model_problem)."""
    import json

    from lt_opd_ray.core.families import vllm_model_problem

    config_path = Path(model_dir) / "config.json"
    if not config_path.exists():
        return []  # the folder's own problem: named where the model is read
    try:
        problem = vllm_model_problem(json.loads(config_path.read_text()), f"model.path {job.model.path!r} ({config_path})")
    except ValueError as exc:  # a config.json that does not parse, or names no family we know: say so, do not stop
        problem = str(exc)
    return [f"pools.{' and pools.'.join(roles)} run vLLM: {problem}"] if problem else []


def fastv_model_problems(job: JobConfig, model_dir: Path) -> list[str]:
    """Whether the model's language model has layers after FastV's scoring layer (eval.selectors fastv)."""
    import json

    from lt_opd_ray.planning.efficiency import fastv_cut

    config_path = Path(model_dir) / "config.json"
    if not config_path.exists():
        return []  # the folder's own problem: named where the model is read
    try:
        fastv_cut(json.loads(config_path.read_text()))
    except (ValueError, KeyError) as exc:
        return [f"eval.selectors fastv on model.path {job.model.path!r} ({config_path}): {exc}"]
    return []


def reward_problems(name: str, samples: list[Sample] | None, spec: str) -> list[str]:
    """Whether reward.name loads where the job starts (a user's module imported; the judge's model is loaded by its
    pool) and the rows read carry what it compares with."""
    from lt_opd_ray.config.objective import JUDGE_REWARD
    from lt_opd_ray.evals.rewards import RewardError, load_reward, row_problems

    try:
        if name != JUDGE_REWARD:
            load_reward(name)
    except RewardError as exc:
        return [f"reward.name: {exc}"]
    return row_problems(name, samples, spec) if samples is not None else []


def family_problems(job: JobConfig, family: Family, inputs: JobInputs) -> list[str]:
    """What the model's family cannot take in the rows read: images beside a video in one prompt, for a family whose
    model takes one or the other (GLM-4V)."""
    if family.image_beside_clip:
        return []
    problems = []
    for spec, rows in ((job.data.path, inputs.samples), (job.eval.data, inputs.eval_samples)):
        if rows and (both := [s.uid for s in rows if s.images and s.video is not None]):
            problems.append(f"{len(both)} rows of {spec!r} show images and a video ({', '.join(both[:3])}{', ...' if len(both) > 3 else ''}),"
                            f" but {family.name} takes one or the other in a prompt: split them into rows of images and rows of video")
    return problems

