"""The paper's ablations on a toy task (lt_opd_ray/toy), each trained through the real distributed system.

Arms (all at the job's target budget, same teacher, same data):
  untrained       the teacher itself with the selector, no training
  sft             the paper's SFT: cross-entropy on the rows' own responses (one per row, so sampling.n 1)
  fixed_prefix    the paper's fixed-prefix JSD: the teacher's distributions on the rows' own responses, with the
                  curriculum (sampling.n 1)
  sequence_kd     cross-entropy on responses the full-token teacher sampled (sequence-level distillation)
  teacher_prefix  the teacher's distributions on responses it sampled, with the curriculum
  lt_opd_no_curriculum   LT-OPD at the target budget from the first update
  lt_opd          LT-OPD (docs/architecture.md §1)
  lt_opd_reverse_kl      LT-OPD with reverse KL instead of JSD
  lt_opd_token_merge     LT-OPD with the release's learnable token merge (not in the paper's table: asked for by name)
  lt_opd_divprune, lt_opd_hiprune  LT-OPD trained with DivPrune or HiPrune instead of the job's selector (the selector
                  cross, tools/cross_plan.py); carried from an earlier study, they take lt_opd's choices
  lt_opd_no_hold  LT-OPD whose cosine decay reaches the target at the last update (the paper's "no final plateau")
  grpo, dapo, gspo       the RL baselines on the student's rollouts, rewarded by the row's answer (no teacher; DAPO
                  with its overlong punishment over the last fifth of max_new_tokens and its dynamic sampling, a flat
                  group's prompt replaced up to 3 times), in PPO's mini-batches: four
                  optimizer steps an update, so their clips act on policy as in their papers' practice
  oracle_sft_matched  oracle_sft with as many sequences an update as LT-OPD has rollouts (prompts_per_step x n
                  prompts of one response each): the compute-matched ceiling
  oracle_sft      what the true labels recover at the budget (the gap the report takes shares of; an estimate, not a
                  bound on distillation): cross-entropy (with the curriculum) on the true labels in the student's own
                  format, the response the full-token teacher is trained to write for each training row (toy tasks:
                  `toy-<task>-reference:<n>`), not the rows' annotator sentences
Every trained arm is evaluated with each of the job's eval selectors, so the
table also shows a student trained with one selector and evaluated with another.
With `lr_scales`, every arm first trains once per scale of the job's learning rates (seed TUNING_SEED, never a
study seed) and each student is scored on validation rows (a split apart from the training and held-out rows): its
retain at the budget with the selector it trained with, averaged over the kinds of question. The arm's seeds then
train at the scale that scored highest, so every arm gets the same care. With `rl_variants` too, each RL arm then
trains once per variant named in it (of RL_VARIANTS: its group size, its clip range) at its chosen scale, scored
the same way; its seeds train with the variant that scored highest, or with none where the arm's own settings did.
With `choices_from` instead (an earlier study's results.json, of the same task, budget and selectors), every arm's
seeds train at the scale and variant that study chose on its validation rows, and nothing is tuned again: a longer
run of the same arms keeps their care without repeating the sweep.
Retain = accuracy at the budget / the teacher's full-token accuracy, on the same
held-out items; mean ± standard error over seeds.
"""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING

from lt_opd_ray.config.loading import load_job
from lt_opd_ray.config.objective import POLICY_GRADIENT
from lt_opd_ray.config.schema import JobConfig
from lt_opd_ray.core.curriculum import BPS
from lt_opd_ray.tools.ablation_choices import carried_choices, chosen_lr_scale, chosen_variant, finished_seconds, finished_study, grid_ends
from lt_opd_ray.tools.ablation_report import RL_ARMS, write_report

if TYPE_CHECKING:
    from lt_opd_ray.runtime.kept_roles import KeptRoles

ARMS: dict[str, dict] = {
    "sft": {"objective": {"mode": "sft"}, "sampling": {"n": 1}},
    "fixed_prefix": {"objective": {"mode": "fixed_prefix"}, "sampling": {"n": 1}},
    "sequence_kd": {"objective": {"mode": "sequence_kd"}},
    "teacher_prefix": {"objective": {"mode": "teacher_prefix"}},
    "lt_opd_no_curriculum": {"budget": {"warm_steps": 0, "decay_end": 0}},  # start_bps set to target below
    "lt_opd": {},
    "lt_opd_reverse_kl": {"objective": {"divergence": "reverse_kl"}},
    "lt_opd_token_merge": {"selector": {"merge": "learnable"}},  # the paper's release: CDPruner + learnable token merge
    # the selector cross: LT-OPD trained with another selector (the job's is CDPruner), at lt_opd's chosen settings
    "lt_opd_divprune": {"selector": {"name": "divprune"}},
    "lt_opd_hiprune": {"selector": {"name": "hiprune"}},
    "lt_opd_no_hold": {},  # the cosine decay reaches the target at the last update (set below): no final plateau
    # the RL baselines on the same rollouts, rewarded by the held-out metric's own check (the row's answer)
    "grpo": {"objective": {"mode": "grpo"}, "reward": {"name": "answer"}},
    "dapo": {"objective": {"mode": "dapo"}, "reward": {"name": "answer", "dynamic_sampling_rounds": 3}},  # overlong_buffer set below
    "gspo": {"objective": {"mode": "gspo"}, "reward": {"name": "answer"}},
    "oracle_sft": {"objective": {"mode": "sft"}, "sampling": {"n": 1}},  # data.path set below: the rows' true responses
    "oracle_sft_matched": {"objective": {"mode": "sft"}, "sampling": {"n": 1}},  # and prompts_per_step x n prompts an update
}
ORACLES = ("oracle_sft", "oracle_sft_matched")
# DAPO's soft overlong punishment starts this share of max_new_tokens before it (the paper: 4,096 of 20,480)
DAPO_OVERLONG_SHARE = 0.2
RL_STEPS_PER_UPDATE = 4  # the RL arms' optimizer steps an update (PPO's mini-batches), where each rank has the prompts
STUDY_ARMS = ("sft", "fixed_prefix", "lt_opd_no_curriculum", "lt_opd", "lt_opd_reverse_kl")  # the paper's ablation table


def _merge(base: dict, override: dict) -> dict:
    merged = copy.deepcopy(base)
    for key, value in override.items():
        merged[key] = _merge(merged.get(key, {}), value) if isinstance(value, dict) else value
    return merged


TUNING_SEED = 1000  # the learning-rate runs' seed: apart from the study's seeds 0..N-1
# The RL arms' other settings, tried at each one's chosen learning rates: its group of responses twice as large (the
# same responses an update: half the prompts), and its paper's clip range halved and doubled.
RL_VARIANTS = ("2x_group", "0.5x_clip", "2x_clip")


def apply_variant(data: dict, variant: str) -> None:
    """One of RL_VARIANTS on an RL arm's job (as a dict): its group size, or its clip range (the job's, else its
    paper's) scaled."""
    from lt_opd_ray.config.objective import ObjectiveConfig

    if variant == "2x_group":
        sampling = data["sampling"]
        if sampling["prompts_per_step"] % 2:
            raise ValueError(f"variant 2x_group halves sampling.prompts_per_step {sampling['prompts_per_step']}: it must be even")
        sampling.update(n=2 * sampling["n"], prompts_per_step=sampling["prompts_per_step"] // 2)
        return
    factor = {"0.5x_clip": 0.5, "2x_clip": 2.0}[variant]
    low, high = ObjectiveConfig.model_validate(data["objective"]).clip_range
    data["objective"].update(clip_low=low * factor, clip_high=high * factor)


def arm_job(base: JobConfig, arm: str, seed: int, out: Path, steps: int | None = None, lr_scale: float = 1.0,
            variant: str | None = None, eval_every: int | None = None) -> JobConfig:
    """The base job specialised to one arm and seed, its learning rates times `lr_scale`, an RL arm's `variant` (of
    RL_VARIANTS) applied; `steps` rescales the curriculum to a shorter run (and its evaluations' interval, unless
    `eval_every` sets it)."""
    data = base.model_dump()
    if steps is not None:
        scale = steps / base.budget.total_steps
        data["budget"].update(
            total_steps=steps,
            warm_steps=round(base.budget.warm_steps * scale),
            decay_end=round(base.budget.decay_end * scale),
        )
        data["eval"]["every_steps"] = max(1, round(base.eval.every_steps * scale))
    if eval_every is not None:
        data["eval"]["every_steps"] = eval_every
    data = _merge(data, ARMS[arm])
    if arm == "lt_opd_no_curriculum":
        data["budget"]["start_bps"] = data["budget"]["target_bps"]
    if arm == "lt_opd_no_hold":  # update c runs at the budget after c steps: the last, c = total_steps - 1, at the target
        data["budget"]["decay_end"] = data["budget"]["total_steps"] - 1
    if arm in ORACLES:
        data["data"]["path"] = reference_rows(base)
    if arm == "oracle_sft_matched":  # one true response per prompt, as many as LT-OPD's rollouts an update
        data["sampling"]["prompts_per_step"] = base.sampling.prompts_per_step * base.sampling.n
    if arm == "dapo":
        data["reward"]["overlong_buffer"] = max(1, round(DAPO_OVERLONG_SHARE * data["sampling"]["max_new_tokens"]))
    if variant is not None:
        if arm not in RL_ARMS:
            raise ValueError(f"variant {variant} is an RL arm's ({', '.join(RL_ARMS)}), not {arm}'s")
        apply_variant(data, variant)
    if data["objective"]["mode"] in POLICY_GRADIENT:  # at least one prompt per rank and mini-batch
        prompts_per_rank = data["sampling"]["prompts_per_step"] // data["pools"]["learner"]["ranks"]
        data["optimizer"]["steps_per_update"] = max(1, min(RL_STEPS_PER_UPDATE, prompts_per_rank))
    data["optimizer"]["lr"] = {module: rate * lr_scale for module, rate in data["optimizer"]["lr"].items()}
    data.update(name=f"{base.name}-{arm}-s{seed}", seed=seed)
    data["data"]["shuffle_seed"] = seed
    data["checkpoint"]["dir"] = str(out / arm / f"seed{seed}")
    return JobConfig.model_validate(data)


def trains_with(base: JobConfig, arm: str) -> str:
    """The selector `arm` trains with: its own (ARMS) or the base job's."""
    return ARMS[arm].get("selector", {}).get("name", base.selector.name)


def reference_rows(job: JobConfig) -> str:
    """The job's toy training rows with the true responses in the teacher's format (`toy-<task>-reference:<n>`)."""
    from lt_opd_ray.sources.resolve import REFERENCE_RESPONSES, generated_rows

    rows = generated_rows(job.data.path)
    if rows is None or rows.toy_task is None or rows.split != "train" or rows.reference_responses:
        raise ValueError(f"the oracle_sft arm trains on a toy task's training rows with their true responses; data.path"
                         f" {job.data.path!r} names no toy task's training rows (toy-<task>:<n>)")
    return f"toy-{rows.toy_task}{REFERENCE_RESPONSES}:{rows.count}"


def eval_sets(job: JobConfig, spec: str | None = None) -> dict[str, list]:
    """The held-out rows (`eval.data`, or the rows `spec` names) by kind of question where they are a toy task's that
    asks several kinds (`discs`), else one set, "all"."""
    from lt_opd_ray.sources.resolve import generated_rows, load_samples
    from lt_opd_ray.sources.toy.tasks import toy_task

    spec = spec or job.eval.data
    samples = load_samples(spec, job.data.image_root, job.seed, job.data.allow_outside_root)
    rows = generated_rows(spec)
    task = toy_task(rows.toy_task) if rows is not None and rows.toy_task is not None else None
    if task is None or task.kind_of(samples[0]) is None:
        return {"all": samples}
    sets: dict[str, list] = {}
    for sample in samples:
        sets.setdefault(task.kind_of(sample), []).append(sample)
    return sets


def evaluate(model_dir: str, job: JobConfig, sets: dict[str, list], full_tokens: bool) -> dict[str, dict[str, float]]:
    """Greedy accuracy of the model folder on each set (single process): per eval selector at the eval budget, and
    at full tokens ("full") where asked."""
    from lt_opd_ray.models.adapter import QwenVLM
    from lt_opd_ray.models.evaluation import evaluate_answers
    from lt_opd_ray.models.loading import load_vlm
    from lt_opd_ray.models.processor import VLMProcessor

    model_dir, model = load_vlm(model_dir, "cpu", token_merge=job.selector.merge == "learnable")
    vlm, processor = QwenVLM(model.eval()), VLMProcessor(model_dir)
    kwargs = dict(k_min=job.budget.k_min, system_prompt=job.data.system_prompt, max_new_tokens=job.eval.max_new_tokens)
    out = {}
    for name, samples in sets.items():
        out[name] = {"full": evaluate_answers(vlm, processor, samples, BPS, **kwargs).accuracy} if full_tokens else {}
        for selector in job.eval.selectors:
            out[name][selector] = evaluate_answers(vlm, processor, samples, job.eval_budget_bps, selector, **kwargs).accuracy
    return out


def pooled(by_set: dict[str, dict[str, float]], sets: dict[str, list]) -> dict[str, float]:
    """Accuracy over the union of the sets, from each set's accuracy and size."""
    total = sum(map(len, sets.values()))
    return {column: sum(by_set[name][column] * len(sets[name]) for name in sets) / total for column in by_set[next(iter(sets))]}


def validation_rows(base: JobConfig) -> str:
    """The rows learning rates are chosen on: the validation split of the held-out rows' toy task, as many rows."""
    from lt_opd_ray.sources.resolve import generated_rows

    rows = generated_rows(base.eval.data)
    if rows is None or rows.toy_task is None:
        raise ValueError(f"eval.data {base.eval.data!r} is not a toy task's rows: choosing learning rates needs validation rows apart from them")
    return f"toy-{rows.toy_task}-validation:{rows.count}"


def mean_retain(accuracy: dict[str, dict[str, float]], teacher: dict[str, dict[str, float]], selector: str) -> float:
    """Retain at the budget with `selector` (accuracy / the teacher's full-token accuracy), averaged over the kinds."""
    return sum(accuracy[kind][selector] / teacher[kind]["full"] for kind in accuracy) / len(accuracy)


def run_ablation(base_path: str, out: str, seeds: list[int], steps: int | None = None, arms: list[str] | None = None,
                 resume: bool = False, lr_scales: list[float] | None = None, rl_variants: list[str] | None = None,
                 accept_grid_ends: bool = False, choices_from: str | None = None, roles: KeptRoles | None = None,
                 eval_rows: str | None = None, eval_every: int | None = None, plan: dict | None = None,
                 plan_file: Path | None = None, eval_selectors: list[str] | None = None) -> dict:
    """Train every arm for every seed through the distributed runtime; write results, table and curves to `out`.
    `resume`: keep the finished runs of `out`'s results.json (the same study: base job, updates, budget, selectors,
    learning-rate scales and RL variants, or more of them while no seed has trained) and train only the runs it lacks;
    the wall time adds up over the invocations.
    `lr_scales`: each arm's learning rates chosen first on validation rows; `rl_variants`: then each RL arm's
    settings among these variants of RL_VARIANTS (see the module's docstring). Where an arm's chosen scale is the
    smallest or largest of `lr_scales` (`grid_ends`), the study stops after the learning-rate runs (results["complete"]
    False, results["grid_ends"] naming them), so that the grid is extended that way before anything trains at it;
    unless `accept_grid_ends`, or seeds have trained. `choices_from`: another study's results.json whose choices
    (scale, variant) every arm trains with, instead of `lr_scales`' own tuning (`carried_choices`). `roles`: the
    caller's `KeptRoles`, whose pools the study's runs start in and leave up for the caller's next runs (several
    studies in one session); by default the study keeps its own and stops them at its end. A Ray session already up (one `runtime.launch.init_ray` started,
    with the workers' environment) is used and left up; otherwise the study starts its own and stops it. `eval_rows`,
    `eval_every`: every run evaluated on these rows (the job's eval.data otherwise) every so many updates, with
    `eval_selectors` (the job's eval.selectors otherwise); `plan`: the
    pre-registered plan (tools/study_plan.py) the study runs, whose verdict its report is; `plan_file`, its path, the one
    file a new study's folder may already hold."""
    import ray

    from lt_opd_ray.runtime.launch import check_local_start, claim_run_folder, init_ray, run

    base = load_job(base_path)
    if eval_rows is not None:
        base = base.model_copy(update={"eval": base.eval.model_copy(update={"data": eval_rows})})
    if eval_selectors is not None:
        base = base.model_copy(update={"eval": base.eval.model_copy(update={"selectors": list(eval_selectors)})})
    if not base.eval.data:
        raise ValueError(f"{base_path}: the ablation needs eval.data (held-out rows with answers)")
    arms = arms or list(STUDY_ARMS)
    unknown = sorted(set(arms) - set(ARMS))
    if unknown:
        raise ValueError(f"unknown arm(s) {', '.join(unknown)}; known: {', '.join(ARMS)}")
    if lr_scales is not None and (not lr_scales or min(lr_scales) <= 0 or len(set(lr_scales)) != len(lr_scales)):
        raise ValueError(f"--lr-scales {' '.join(map(str, lr_scales))}: distinct positive scales of the job's learning rates")
    rl_variants = list(rl_variants or [])
    if not set(rl_variants) <= set(RL_VARIANTS) or len(set(rl_variants)) != len(rl_variants):
        raise ValueError(f"--rl-variants {' '.join(rl_variants)}: distinct names of {', '.join(RL_VARIANTS)}")
    if choices_from and (lr_scales or rl_variants):
        raise ValueError("--choices-from trains at an earlier study's choices: give it without --lr-scales and --rl-variants")
    if rl_variants and not lr_scales:
        raise ValueError("--rl-variants are tried at each RL arm's learning rates chosen on validation rows: give --lr-scales too")
    for arm in arms:  # each arm's job refused now, not when the study reaches it
        arm_job(base, arm, seeds[0] if seeds else 0, Path(out), steps, eval_every=eval_every)
    carried = carried_choices(choices_from, base_path, base, arms) if choices_from else None
    if lr_scales and (unscored := [arm for arm in arms if trains_with(base, arm) not in base.eval.selectors]):
        raise ValueError(f"--lr-scales scores each arm with the selector it trains with: {', '.join(unscored)} train with one"
                         f" eval.selectors ({', '.join(base.eval.selectors)}) lacks")
    validation_spec = validation_rows(base) if lr_scales else None  # refused here, before anything trains or evaluates
    if roles is not None and not ray.is_initialized():
        raise ValueError("pools kept by the caller live in the caller's Ray session: start it first (runtime.launch.init_ray)")
    if not ray.is_initialized():
        check_local_start(base)  # the cluster the study will start: this machine's CPUs, its metrics port free
    out_dir = Path(out)
    check_study_folder(out_dir, resume, plan_file)
    earlier = finished_study(out_dir, base_path, steps or base.budget.total_steps, base, lr_scales, rl_variants,
                             carried, eval_every, plan) if resume else {}
    out_dir.mkdir(parents=True, exist_ok=True)
    begin = time.perf_counter()
    from lt_opd_ray.sources.resolve import resolve_model_dir

    sets = eval_sets(base)
    teacher_by_kind = evaluate(resolve_model_dir(base.model.path), base, sets, full_tokens=True)  # trains a toy teacher on first use
    teacher, eval_items = pooled(teacher_by_kind, sets), sum(map(len, sets.values()))
    print(f"teacher: full-token accuracy {teacher['full']:.3f}; at the budget: "
          + ", ".join(f"{s} {teacher[s]:.3f}" for s in base.eval.selectors), flush=True)
    if len(sets) > 1:
        print("  by kind of question: " + "; ".join(f"{kind} full {a['full']:.3f}" for kind, a in teacher_by_kind.items()), flush=True)
    runs, tuning = earlier.get("runs", []), earlier.get("tuning_runs", [])
    done = {(r["arm"], r["seed"]) for r in runs}
    begin -= finished_seconds(out_dir) if earlier else 0.0
    results = {"base_job": base_path, "seeds": seeds, "steps": steps or base.budget.total_steps,
               "budget_bps": base.eval_budget_bps, "selectors": list(base.eval.selectors), "eval_rows": base.eval.data,
               "eval_every": eval_every, **({"plan": plan} if plan else {}),
               "trained_with": base.selector.name,
               "teacher": teacher, "eval_items": eval_items, "runs": runs, "seconds": 0.0, "complete": False,
               "lr_scales": lr_scales, "rl_variants": rl_variants, "tuning_runs": tuning, "chosen_lr_scale": {}, "chosen_variant": {},
               **({"choices_from": carried, "chosen_lr_scale": carried["lr_scale"], "chosen_variant": carried["variant"]}
                  if carried else {}),
               **({"teacher_by_kind": teacher_by_kind, "kind_items": {k: len(v) for k, v in sets.items()}} if len(sets) > 1 else {})}
    own_cluster = not ray.is_initialized()  # a session already up (a test module's) is used as it is: start it with init_ray(job)
    if own_cluster:
        init_ray(base)
    from lt_opd_ray.runtime.kept_roles import KeptRoles

    own_roles = roles is None
    roles = roles or KeptRoles()  # a run whose pools have the last run's shape starts in the last run's processes
    try:
        if lr_scales:
            validation = eval_sets(base, validation_spec)
            teacher_on_validation = evaluate(resolve_model_dir(base.model.path), base, validation, full_tokens=True)
            results["validation"] = {"rows": validation_spec, "teacher_by_kind": teacher_on_validation}

            def tune(arm: str, scale: float, variant: str | None) -> None:
                """One validation run of `arm` at `scale` (with `variant`), unless the study has it."""
                if any((r["arm"], r["lr_scale"], r.get("variant")) == (arm, scale, variant) for r in tuning):
                    return
                folder = f"lr{scale:g}" + (f"-{variant}" if variant else "")
                job = arm_job(base, arm, TUNING_SEED, out_dir / "tuning" / folder, steps, scale, variant)
                claim_run_folder(Path(job.checkpoint.dir), resume=False, force=True)
                started = time.perf_counter()
                trained(job, run(job, roles=roles))
                accuracy = evaluate(str(Path(job.checkpoint.dir) / "final"), job, validation, full_tokens=False)
                tuning.append({"arm": arm, "lr_scale": scale, "variant": variant, "seconds": time.perf_counter() - started,
                               "accuracy": accuracy, "retain": mean_retain(accuracy, teacher_on_validation, job.selector.name)})
                print(f"{arm} at {scale:g}x the learning rates{f', {variant}' if variant else ''}: validation retain"
                      f" {tuning[-1]['retain']:.3f}", flush=True)
                save_results(results, out_dir, begin)

            for arm in arms:
                for scale in lr_scales:
                    tune(arm, scale, None)
            for arm in arms:
                results["chosen_lr_scale"][arm] = chosen_lr_scale(tuning, arm, lr_scales)
            ends = grid_ends(tuning, results["chosen_lr_scale"], lr_scales)
            if ends and not accept_grid_ends and not runs:  # once seeds trained, the grid is the study's: nothing to extend
                results["grid_ends"] = ends
                print("stopped before the variants and seeds: the learning rates chosen at an end of the grid ("
                      + ", ".join(f"{arm} {scale:g}x" for arm, scale in ends.items()) + "); extend --lr-scales that way and --resume,"
                      " or --accept-grid-ends", flush=True)
                save_results(results, out_dir, begin)
                return results
            for arm in [a for a in arms if a in RL_ARMS] if rl_variants else []:
                for variant in rl_variants:
                    tune(arm, results["chosen_lr_scale"][arm], variant)
                results["chosen_variant"][arm] = chosen_variant(tuning, arm, results["chosen_lr_scale"][arm], rl_variants)
        for seed in seeds:
            for arm in arms:
                if (arm, seed) in done:
                    (recorded,) = [r for r in runs if (r["arm"], r["seed"]) == (arm, seed)]
                    if len(sets) > 1 and "final_by_kind" not in recorded:  # the study stopped in its per-kind evaluation
                        job = arm_job(base, arm, seed, out_dir, steps, recorded["lr_scale"], recorded["variant"], eval_every)
                        recorded["final_by_kind"] = evaluate(str(Path(job.checkpoint.dir) / "final"), job, sets, full_tokens=False)
                        save_results(results, out_dir, begin)
                    continue
                job = arm_job(base, arm, seed, out_dir, steps, results["chosen_lr_scale"].get(arm, 1.0), results["chosen_variant"].get(arm),
                              eval_every)
                record = {"arm": arm, "seed": seed, "lr_scale": results["chosen_lr_scale"].get(arm, 1.0), "variant": results["chosen_variant"].get(arm)}
                recovered = finished_run(Path(job.checkpoint.dir), job) if resume else None
                if recovered is not None:  # trained to its last update, then the study stopped before recording it
                    record |= recovered
                    print(f"{arm} seed {seed}: its folder holds the finished run ({recovered['run_id']}): taken as it is", flush=True)
                else:
                    claim_run_folder(Path(job.checkpoint.dir), resume=False, force=True)  # a study run again starts each arm afresh
                    started = time.perf_counter()
                    logs = trained(job, run(job, roles=roles))
                    record |= {"seconds": time.perf_counter() - started,
                               "run_id": json.loads((Path(job.checkpoint.dir) / "run.json").read_text())["run_id"],
                               "curve": [curve_point(log.step, log.budget_bps, log.loss, log.divergence, log.reward_mean, log.eval_accuracy,
                                                     log.eval_by_kind) for log in logs]}
                final = record["curve"][-1]["eval"]
                runs.append({**record, "final": final})
                save_results(results, out_dir, begin)  # recorded before the per-kind evaluation below: a stop there loses no run
                if len(sets) > 1:  # the trained student on each kind of question
                    runs[-1]["final_by_kind"] = evaluate(str(Path(job.checkpoint.dir) / "final"), job, sets, full_tokens=False)
                print(f"{arm} seed {seed}: " + ", ".join(f"{s} {a:.3f}" for s, a in final.items())
                      + f"  ({runs[-1]['seconds']:.0f}s)", flush=True)
                save_results(results, out_dir, begin)  # a study cut short keeps every finished run
    finally:
        if own_roles:
            roles.close()
        if own_cluster:
            ray.shutdown()
    results["complete"] = True
    save_results(results, out_dir, begin)
    return results


def curve_point(step: int, budget_bps: int, loss, divergence, reward, eval_accuracy: dict, eval_by_kind: dict) -> dict:
    """One update of a run's curve in results.json (`step` 0-based, as the step log counts)."""
    return {"step": step + 1, "budget_bps": budget_bps, "loss": loss, "divergence": divergence, "reward": reward, "eval": eval_accuracy,
            **({"eval_by_kind": eval_by_kind} if eval_by_kind else {})}


def finished_run(folder: Path, job: JobConfig) -> dict | None:
    """A run folder holding a finished run of `job` (the job it recorded is this one, every update is in its step log,
    its final/ was written last) as a study records it: its curve from steps.jsonl (the values the run's step logs
    carried), its run id, and its seconds from the start run.json records to its last update's end. None for a folder
    without one (missing, cut short, trained with other settings)."""
    from datetime import datetime

    import yaml

    from lt_opd_ray.core.redact import redact_values

    steps_file, run_file, job_file = folder / "steps.jsonl", folder / "run.json", folder / "job.yaml"
    if not (steps_file.is_file() and run_file.is_file() and job_file.is_file() and (folder / "final" / "config.json").is_file()):
        return None
    if yaml.safe_load(job_file.read_text()) != redact_values(job.model_dump(mode="json")):  # as the run wrote it
        return None
    total_steps = job.budget.total_steps
    by_step = {}
    for line in steps_file.read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            by_step[record["step"]] = record  # a resumed run logs its redone updates again: the last one stands
    if sorted(by_step) != list(range(total_steps)):
        return None
    run_record = json.loads(run_file.read_text())
    started = datetime.strptime(run_record["started_at"], "%Y-%m-%dT%H:%M:%S%z").timestamp()
    ended = max((phase["end"] for phase in by_step[total_steps - 1].get("timeline", [])), default=started)
    return {"seconds": ended - started, "run_id": run_record["run_id"], "recovered": True,
            "curve": [curve_point(step, r["budget_bps"], r["loss"], r["divergence"], r["reward_mean"], r["eval_accuracy"], r.get("eval_by_kind"))
                      for step, r in sorted(by_step.items())]}


class StudyStopped(RuntimeError):
    """A run of the study stopped before its last update (SIGTERM): results.json keeps every finished run."""


def trained(job: JobConfig, logs: list) -> list:
    """`logs` of a run that reached its last update; StudyStopped where it stopped before (it is trained again on --resume)."""
    done = logs[-1].step + 1 if logs else 0
    if done < job.budget.total_steps:
        raise StudyStopped(f"{job.name} stopped after update {done} of {job.budget.total_steps}: results.json keeps the finished runs;"
                           " --resume trains this one again")
    return logs


def save_results(results: dict, out_dir: Path, begin: float) -> None:
    """results.json (replaced atomically), the tables and the curves, for the runs finished so far."""
    results["seconds"] = time.perf_counter() - begin
    staging = out_dir / "results.json.tmp"
    staging.write_text(json.dumps(results, separators=(",", ":")))  # compact: a study's curves run to 40 KB a run
    staging.replace(out_dir / "results.json")
    if results.get("plan"):  # a pre-registered plan's report: its verdict, in its own definition of retain
        from lt_opd_ray.tools.plans import write_plan_verdict

        write_plan_verdict(results, out_dir)
    if not results.get("plan") or results["plan"].get("kind") == "cross":  # a cross reads the study's table beside it
        write_report(results, out_dir)


def check_study_folder(out_dir: Path, resume: bool, plan_file: Path | None = None) -> None:
    """A new study starts in a new or empty folder, which may hold only the plan file it runs: a study's results and
    runs are never written over."""
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"{out_dir} is a file; --out names the study's folder")
    if resume or not out_dir.is_dir():
        return
    plan_here = plan_file.resolve() if plan_file else None
    held = sorted(p for p in out_dir.iterdir() if p.is_symlink() or p.resolve() != plan_here)  # a link to the plan is not it
    if held:
        what = "an earlier study (--resume continues it)" if (out_dir / "results.json").exists() else f"files of its own ({held[0].name} first)"
        raise ValueError(f"{out_dir} holds {what}; a new study needs a new or empty --out")


def run_plan(plan_path: str, resume: bool = False, roles: KeptRoles | None = None) -> tuple[dict, dict]:
    """The study a plan file names (a contrast, tools/study_plan.py; a selector cross, tools/cross_plan.py), run or
    resumed, and its verdict computed from the plan: (results, verdict); results.json, the tables, verdict.md and
    statistic.csv in the plan's `out`."""
    from lt_opd_ray.tools.cross_plan import CrossPlan
    from lt_opd_ray.tools.plans import read_plan, write_plan_verdict

    plan = read_plan(plan_path)
    cross = isinstance(plan, CrossPlan)
    if cross:  # each arm trains with the selector the plan says (an unknown arm is refused by the study, by name)
        base = load_job(plan.job)
        if mislabelled := [f"{arm} trains with {trains_with(base, arm)}, not {selector}" for selector, arm in plan.trained_with.items()
                           if arm in ARMS and trains_with(base, arm) != selector]:
            raise ValueError(f"{plan_path}: trained_with: {'; '.join(mislabelled)}")
    results = run_ablation(plan.job, plan.out, plan.seed_list, plan.updates, list(plan.trained_with.values()) if cross else list(plan.contrast),
                           resume=resume, choices_from=plan.choices_from, roles=roles, eval_rows=plan.eval_rows, eval_every=plan.eval_every,
                           plan=plan.model_dump(mode="json"), plan_file=Path(plan_path), eval_selectors=plan.selectors if cross else None)
    return results, write_plan_verdict(results, Path(plan.out))

