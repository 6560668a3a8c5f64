"""Job schema: every shipped YAML validates; bad fields are named with path and line."""

import subprocess
import sys
from pathlib import Path

import pytest

from lt_opd_ray.config.loading import JobConfigError, load_job, parse_job

REPO = Path(__file__).resolve().parents[1]
SHIPPED_JOBS = sorted((REPO / "jobs").glob("*.yaml"))  # every file there is a job: `lt-opd validate jobs/*.yaml` passes

MINIMAL = """\
model:
  path: tiny:qwen3_5
data:
  path: synthetic:8
"""


def test_jobs_are_shipped():
    assert {p.name for p in SHIPPED_JOBS} >= {"train_tiny.yaml", "train_qwen35.yaml"}


@pytest.mark.parametrize("path", SHIPPED_JOBS, ids=lambda p: p.name)
def test_every_shipped_job_validates(path):
    load_job(path)


@pytest.mark.parametrize("path", SHIPPED_JOBS, ids=lambda p: p.name)
def test_every_shipped_job_runs_as_a_command(path):
    """`./jobs/x.yaml` (and `ray job submit -- jobs/x.yaml`) runs `lt-opd train` on it: the shebang and the run bit."""
    import os

    assert path.read_text().startswith("#!/usr/bin/env -S lt-opd train\n") and os.access(path, os.X_OK)


def test_paper_recipe_carries_design_values():
    job = load_job(REPO / "jobs" / "train_qwen35.yaml")
    b, o, s, opt = job.budget, job.objective, job.sampling, job.optimizer
    assert (b.start_bps, b.target_bps, b.warm_steps, b.decay_end, b.total_steps, b.k_min) == (2500, 500, 14, 100, 175, 32)
    assert (o.divergence, o.alpha, o.top_k, o.importance_clip) == ("jsd", 0.5, 100, 2.0)
    assert (s.prompts_per_step, s.n, s.temperature, s.top_p, s.max_new_tokens, s.stop) == (80, 8, 1.0, 1.0, 1024, ["</answer>"])
    assert (opt.lr.language_model, opt.lr.vision_encoder, opt.lr.merger) == (1e-6, 2e-7, 1e-6)
    assert (opt.weight_decay, opt.warmup_steps, opt.grad_clip) == (0.01, 14, 1.0)
    assert job.model.dtype == "bfloat16" and job.selector.name == "cdpruner"


def test_the_9b_job_is_the_4b_recipe_on_another_split():
    """The paper transfers its recipe unchanged; jobs/train_qwen35_9b.yaml differs from the 4B job only in the model,
    its name and outputs, and the pools, whose learner the planner fits in 80 GB (tests/test_planner.py plans it)."""
    small, large = (load_job(REPO / "jobs" / name).model_dump() for name in ("train_qwen35.yaml", "train_qwen35_9b.yaml"))
    differing = {key for key in small if small[key] != large[key]}
    assert differing == {"name", "model", "pools", "checkpoint"}
    assert {k for k in small["model"] if small["model"][k] != large["model"][k]} == {"path"}
    assert {k for k in small["checkpoint"] if small["checkpoint"][k] != large["checkpoint"][k]} == {"dir"}


def test_the_grpo_job_is_the_4b_job_with_a_reward_instead_of_a_teacher():
    """jobs/train_qwen35_grpo.yaml: the main job's model, data, selector, curriculum and sampling; the objective, a
    reward, PPO's mini-batches, and the pools (no teacher: its GPUs sample) differ, and the learners are the same."""
    main, rl = (load_job(REPO / "jobs" / name) for name in ("train_qwen35.yaml", "train_qwen35_grpo.yaml"))
    a, b = main.model_dump(), rl.model_dump()
    assert {key for key in a if a[key] != b[key]} == {"name", "objective", "reward", "optimizer", "pools", "checkpoint"}
    assert rl.objective.mode == "grpo" and not rl.objective.teacher_scores and rl.reward.name == "answer_normalised"
    assert {k for k in a["optimizer"] if a["optimizer"][k] != b["optimizer"][k]} == {"steps_per_update"}
    assert rl.pools.learner == main.pools.learner
    assert rl.pools.rollout.workers == main.pools.rollout.workers + main.pools.teacher.replicas  # the teacher's GPUs sample


def problems_of(text):
    with pytest.raises(JobConfigError) as info:
        parse_job(text, source="job.yaml")
    return info.value.problems, str(info.value)


def test_the_learners_collectives_outwait_every_bound_the_driver_allows_a_peer():
    base = parse_job(MINIMAL)
    assert base.collective_timeout_s == 1800.0 + 120.0  # the update's bound, plus one micro-batch
    slow_sync = parse_job(MINIMAL + "schedule: {wait_timeout_s: 60, liveness_timeout_s: 30}\npools: {learner: {sync_timeout_s: 900}}\n")
    assert slow_sync.collective_timeout_s == 900.0 + 30.0  # rank 0 waiting on a slow receiver inside ZeRO-3's gather


@pytest.mark.parametrize(("prompts", "ranks", "group_prompts", "staleness"), [(80, 2, 1, 0), (7, 3, 2, 1), (5, 2, 4, 0)])
def test_the_requests_in_flight_are_the_groups_the_rollout_pool_makes(prompts, ranks, group_prompts, staleness):
    from lt_opd_ray.core.microbatch import split_evenly
    from lt_opd_ray.runtime.rollout_pool import group_bounds

    job = parse_job(MINIMAL + f"sampling: {{prompts_per_step: {prompts}}}\npools: {{learner: {{ranks: {ranks}}}}}\n"
                    f"schedule: {{group_prompts: {group_prompts}, max_staleness: {staleness}}}\n")
    groups = len(group_bounds(split_evenly(prompts, ranks), group_prompts))
    assert job.teacher_requests_in_flight == groups * (1 + staleness)
    slots = 2 * job.pools.teacher.max_batch_size  # one replica
    assert (job.teacher_admission_note() is None) == (slots >= groups * (1 + staleness))


def test_an_rl_baselines_clip_range_is_its_papers_where_the_job_sets_none_of_it():
    from lt_opd_ray.config.objective import ObjectiveConfig

    assert [ObjectiveConfig(mode=mode).clip_range for mode in ("grpo", "dapo", "gspo")] == [(0.2, 0.2), (0.2, 0.28), (3e-4, 4e-4)]
    assert ObjectiveConfig(mode="dapo", clip_high=0.3).clip_range == (0.2, 0.3) and ObjectiveConfig(mode="gspo", clip_low=1e-3).clip_range == (1e-3, 4e-4)


def test_unknown_key_is_an_error_with_path_and_line():
    problems, message = problems_of(MINIMAL + "budget:\n  start_bps: 2500\n  warmup: 3\n")
    assert problems == [("budget.warmup (line 7)", "unknown key; did you mean warm_steps?")]  # the nearest key there
    assert message.startswith("job.yaml: 1 problem(s)")
    problems, _ = problems_of(MINIMAL + "pools:\n  rollout: {wokers: 2}\nbudget: {zzz: 1}\n")
    assert problems == [("pools.rollout.wokers (line 6)", "unknown key; did you mean workers?"), ("budget.zzz (line 7)", "unknown key")]


def test_every_bad_field_is_reported_at_once():
    text = MINIMAL + "budget:\n  target_bps: 0\nsampling:\n  n: many\nselector:\n  name: fastx\n"
    problems, _ = problems_of(text)
    where = [w for w, _ in problems]
    assert where == ["budget.target_bps (line 6)", "sampling.n (line 8)", "selector.name (line 10)"]
    reasons = dict(problems)
    assert "greater than 0" in reasons["budget.target_bps (line 6)"]
    assert "integer" in reasons["sampling.n (line 8)"]
    assert "cdpruner" in reasons["selector.name (line 10)"]


@pytest.mark.parametrize("bps", [0, 10001, -3])
def test_budget_outside_unit_interval_is_refused(bps):
    problems, _ = problems_of(MINIMAL + f"budget:\n  start_bps: {bps}\n")
    assert problems[0][0] == "budget.start_bps (line 6)"


def test_k_min_above_the_largest_images_token_count_is_refused():
    problems, _ = problems_of(MINIMAL.replace("synthetic:8", "synthetic:8\n  max_pixels: 65536") + "budget:\n  k_min: 100\n")
    assert problems[0][0] == "budget.k_min (line 7)"
    assert "above N = 64" in problems[0][1]


def test_missing_section_and_wrong_types():
    problems, _ = problems_of("data:\n  path: x.jsonl\nseed: [1]\n")
    assert ("model", "Field required") in problems
    assert any(w.startswith("seed (line 3)") for w, _ in problems)


def test_teacher_replica_bounds_and_metrics_port_are_checked():
    problems, _ = problems_of(MINIMAL + "pools:\n  teacher:\n    replicas: 5\n    max_replicas: 2\nmetrics:\n  export_port: 12000\n")
    where = [w for w, _ in problems]
    assert where == ["pools.teacher (line 6)", "metrics (line 9)"]


def test_not_yaml_and_not_a_mapping():
    problems, _ = problems_of("model: [unclosed\n")
    assert problems[0][0].startswith("line ")
    problems, _ = problems_of("- a\n- b\n")
    assert problems == [("<top>", "a job YAML must be a mapping of sections")]


@pytest.mark.parametrize("extra, where, reason", [
    ("optimizer: {betas: [5.0, 0.9]}", "optimizer.betas.0", "less than 1"),
    ("optimizer: {betas: [0.9, -3.0]}", "optimizer.betas.1", "greater than or equal to 0"),
    ("optimizer: {betas: [.nan, 0.9]}", "optimizer.betas.0", "finite number"),
    ("optimizer: {eps: .inf}", "optimizer.eps", "finite number"),
    ("optimizer: {grad_clip: .nan}", "optimizer.grad_clip", "finite number"),
    ("optimizer: {lr: {language_model: .inf}}", "optimizer.lr.language_model", "finite number"),
    ("sampling: {temperature: .inf}", "sampling.temperature", "finite number"),
    ("pools: {rollout: {cpus: .inf}}", "pools.rollout.cpus", "finite number"),
    ("eval: {data: 'synthetic:0'}", "eval.data", "'synthetic:0': expected synthetic:<count from 1 to 100,000>"),
    ("eval: {data: 'synthetic:4@8x8'}", "eval.data", "sides of at least 32 pixels"),
    ("objective: {clip_high: 0.3}", "objective", "objective.clip_high is the RL baselines' (grpo, dapo, gspo); objective.mode lt_opd"),
    ("objective: {mode: grpo, clip_low: 1.5}", "objective.clip_low", "less than 1"),
    ("objective: {scale_advantages: false}", "objective", "objective.scale_advantages is the RL baselines'"),
    ("objective: {mode: dapo, importance: prefix}\nreward: {name: format}", "objective",
     "objective.importance weighs the distillation modes' divergence; objective.mode dapo corrects for rollouts of older weights by its clipped ratio"),
    ("objective: {mode: gspo, importance_clip: 5.0}\nreward: {name: format}", "objective", "objective.importance_clip weighs"),
    ("objective: {dual_clip: 4.0}", "objective", "objective.dual_clip is the RL baselines'"),
    ("objective: {mode: grpo, dual_clip: 1.0}\nreward: {name: format}", "objective.dual_clip", "greater than 1"),
    ("objective: {mode: gspo, dual_clip: 5.0}\nreward: {name: format}", "objective", "objective.mode gspo clips one ratio per response"),
])
def test_values_that_would_fail_later_are_refused_by_validate(extra, where, reason):
    problems, _ = problems_of(MINIMAL + extra + "\n")
    assert len(problems) == 1 and problems[0][0].startswith(where) and reason in problems[0][1], problems


@pytest.mark.parametrize("mode", ["lt_opd", "sft", "fixed_prefix", "sequence_kd", "teacher_prefix", "grpo", "dapo", "gspo"])
def test_a_vllm_rollout_pool_is_refused_by_validate_exactly_where_the_student_does_not_sample(mode):
    """vLLM samples; the modes that train on the rows' or the teacher's responses read them with the student's
    transformers forward instead. The refusal comes from the schema (so `validate` names it), before any pool starts."""
    extra = "reward: {name: format}\n" if mode in ("grpo", "dapo", "gspo") else "sampling: {n: 1}\n"
    text = MINIMAL + f"objective: {{mode: {mode}}}\npools: {{rollout: {{backend: vllm}}}}\n" + extra
    who = {"sft": "dataset", "fixed_prefix": "dataset", "sequence_kd": "teacher", "teacher_prefix": "teacher"}.get(mode)
    if who is None:
        assert parse_job(text).pools.rollout.backend == "vllm"
        return
    problems, _ = problems_of(text)
    (where, reason), = problems
    assert where == "<top>" and reason.endswith(f"objective.mode {mode} trains on responses the student does not sample (the {who}'s),"
                                                " which a rollout worker reads with the student's transformers forward: set"
                                                " pools.rollout.backend: transformers"), reason
    assert parse_job(text.replace("backend: vllm", "backend: transformers")).objective.mode == mode


def test_unknown_tiny_model_and_empty_synthetic_data_are_refused():
    problems, _ = problems_of(MINIMAL.replace("tiny:qwen3_5", "tiny:nope").replace("synthetic:8", "synthetic:0"))
    assert [w.split(" ")[0] for w, _ in problems] == ["model.path", "data.path"]
    assert "family one of qwen3_5, qwen3_vl, qwen2_5_vl" in problems[0][1]


def test_files_that_are_not_utf8_yaml_are_named(tmp_path):
    cases = {
        "utf16.yaml": (MINIMAL.encode("utf-16"), "<file>", "UTF-16 text: save the job as UTF-8"),
        "binary.yaml": (b"model:\x00\x01\x02", "<file>", "binary data (a NUL byte at offset 6)"),
        "latin1.yaml": ((MINIMAL + "name: caf\xe9\n").encode("latin-1"), "line 5", "not UTF-8 text (byte 0xe9"),
        "deep.yaml": (("a: " + "[" * 5000 + "]" * 5000 + "\n").encode(), "yaml", "nested too deeply"),
    }
    for name, (data, where, reason) in cases.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(JobConfigError) as info:
            load_job(tmp_path / name)
        (got_where, got_reason), = info.value.problems
        assert got_where == where and reason in got_reason, (name, got_where, got_reason)


def test_validate_cli_imports_no_heavy_library_and_reports(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(MINIMAL + "objective:\n  divergence: tvd\n")
    code = (
        "import sys; from lt_opd_ray.cli.main import main; rc = main(['validate', %r, %r]);"
        "heavy = [m for m in ('torch', 'ray', 'vllm', 'transformers') if m in sys.modules];"
        "print('HEAVY', heavy); sys.exit(rc)"
    ) % (str(REPO / "jobs" / "train_tiny.yaml"), str(bad))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 1
    assert "HEAVY []" in out.stdout
    assert "train_tiny.yaml: ok" in out.stdout
    assert "objective.divergence (line 6)" in out.stderr


def test_set_overrides_are_applied_and_judged_by_the_schema(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text(MINIMAL)
    job = load_job(path, ["optimizer.lr.language_model=2e-6", "pools.rollout.workers=4", "sampling.stop=['</a>', '</b>']"])
    assert (job.optimizer.lr.language_model, job.pools.rollout.workers, job.sampling.stop) == (2e-6, 4, ["</a>", "</b>"])
    with pytest.raises(JobConfigError) as info:
        load_job(path, ["pools.rollout.workers=0", "optimizer.lr.bogus=1", "budget.k_min=oops"])
    assert [w for w, _ in info.value.problems] == ["budget.k_min (--set)", "optimizer.lr.bogus (--set)", "pools.rollout.workers (--set)"]
    for bad, where in (("no-equals", "--set no-equals"), ("model.path.deeper=1", "--set model.path.deeper")):
        with pytest.raises(JobConfigError) as info:
            load_job(path, [bad])
        assert info.value.problems[0][0] == where


def test_validate_print_shows_the_resolved_job(tmp_path, capsys):
    from lt_opd_ray.cli.main import main

    path = tmp_path / "job.yaml"
    path.write_text(MINIMAL)
    assert main(["validate", str(path), "--set", "pools.learner.ranks=2", "--set", "sampling.prompts_per_step=8", "--print"]) == 0
    printed = capsys.readouterr().out
    assert "ranks: 2" in printed and "top_k: 100" in printed  # the override and a default
