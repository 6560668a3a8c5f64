"""The single-process reference update on a tiny real Qwen3.5."""

import math
import statistics

import pytest
import torch
from conftest import FAMILIES

from lt_opd_ray.config.loading import parse_job
from lt_opd_ray.core.families import family_of
from lt_opd_ray.core.optim import module_of, param_groups
from lt_opd_ray.engines.transformers.rollout import rollout
from lt_opd_ray.engines.transformers.teacher import teacher_scores
from lt_opd_ray.models.loss import student_loss
from lt_opd_ray.reference import ReferenceTrainer
from lt_opd_ray.sources.resolve import load_samples


def tiny_job(model_dir, **overrides):
    text = f"""
seed: 3
model: {{path: "{model_dir}", dtype: float32}}
data: {{path: "synthetic:8", max_pixels: 65536}}
budget: {{start_bps: {overrides.get("start_bps", 2500)}, target_bps: {overrides.get("target_bps", 1000)}, warm_steps: 1, decay_end: 3, total_steps: 4, k_min: 2}}
objective: {{top_k: 8, logsoftmax_chunk: 16, divergence: {overrides.get("divergence", "jsd")}, mode: {overrides.get("mode", "lt_opd")}, kl_coef: {overrides.get("kl_coef", 0)}}}
sampling: {{prompts_per_step: 2, n: {overrides.get("n", 2)}, max_new_tokens: {overrides.get("max_new_tokens", 6)}}}
optimizer: {{lr: {{language_model: 1.0e-3, vision_encoder: 1.0e-3, merger: 1.0e-3}}, warmup_steps: 0, steps_per_update: {overrides.get("steps", 1)}}}
""" + (f"reward: {{name: {overrides['reward']}}}\n" if "reward" in overrides else "") + (
        f"selector: {{name: {overrides['selector']}}}\n" if "selector" in overrides else "")
    return parse_job(text)


def state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def samples():
    return load_samples("synthetic:8")


def test_updates_are_deterministic_for_a_seed(tiny_dirs, samples):
    runs = []
    for _ in range(2):
        trainer = ReferenceTrainer(tiny_job(tiny_dirs["qwen3_5"]))
        losses = [trainer.update(samples[2 * i : 2 * i + 2]).stats.loss for i in range(2)]
        runs.append((losses, state(trainer.student.model)))
    assert runs[0][0] == runs[1][0]
    for key, value in runs[0][1].items():
        assert torch.equal(value, runs[1][1][key]), key


def test_update_moves_every_student_module_and_never_the_teacher(tiny_dirs, samples):
    trainer = ReferenceTrainer(tiny_job(tiny_dirs["qwen3_5"]))
    student_before, teacher_before = state(trainer.student.model), state(trainer.teacher.model)
    report = trainer.update(samples[:2])
    assert report.step == 0 and report.budget_bps == 2500
    # first update: rollout policy == learner weights, so exp(logp - old_logp) == 1
    assert report.stats.importance_weight == pytest.approx(1.0, abs=1e-4)
    family = family_of(trainer.student.model.config.model_type)
    moved = {module_of(k, family) for k, v in state(trainer.student.model).items() if not torch.equal(v, student_before[k])}
    assert moved == {"language_model", "vision_encoder", "merger"}
    for key, value in state(trainer.teacher.model).items():
        assert torch.equal(value, teacher_before[key]), key
    assert trainer.update(samples[2:4]).budget_bps == trainer.schedule.budget_bps(1) == 2125  # 1000 + 750 * (1 + cos(pi/3))


@pytest.mark.parametrize("divergence", ["jsd", "reverse_kl"])
def test_the_gradient_is_the_slope_of_the_loss_by_hand_along_a_direction_through_every_weight(tiny_dirs, samples, divergence):
    """student_loss's gradient, read along a random direction through every student weight (vision tower, merger,
    language model, head), equals the central difference of loss_by_hand (tests/loss_by_hand.py: plain forwards, the
    support as a set, the tail bin, the divergence token by token; importance weights held, as the learner detaches
    them) along it. A term the learner drops or mis-weights (the tail bin, a column, the mixture) moves its gradient
    and not the slope."""
    from loss_by_hand import loss_by_hand

    job = tiny_job(tiny_dirs["qwen3_5"], divergence=divergence)
    job = job.model_copy(update={"objective": job.objective.model_copy(update={"alpha": 0.3})})  # the JSD's weights unequal
    trainer = ReferenceTrainer(job)
    with torch.no_grad():  # move the student away from the teacher so there is something to recover
        trainer.student.lm_head.weight.add_(0.3 * torch.randn(trainer.student.lm_head.weight.shape, generator=torch.Generator().manual_seed(0)))
    prompts = trainer.encode(samples[:2])
    rollouts = rollout(trainer.student, trainer.processor.tokenizer, prompts, ["a", "b"], trainer.selector, 1000, 2, trainer.params, 2, 0, 0)
    scores = teacher_scores(trainer.teacher, prompts, rollouts, job.objective.top_k, 16)
    params = list(trainer.student.model.parameters())
    loss, _ = student_loss(trainer.student, prompts, rollouts, scores, job.objective)
    gradient = torch.autograd.grad(loss, params, allow_unused=True)
    generator = torch.Generator().manual_seed(1)
    direction = [torch.randn(p.shape, generator=generator) for p in params]
    slope = sum(float((g.double() * d).sum()) for g, d in zip(gradient, direction) if g is not None)
    held, start = {}, [p.detach().clone() for p in params]

    def by_hand_at(step: float) -> float:
        with torch.no_grad():
            for p, p0, d in zip(params, start, direction):
                p.copy_(p0 + step * d)
        try:
            return loss_by_hand(trainer, prompts, rollouts, job.objective, held)
        finally:
            with torch.no_grad():
                for p, p0 in zip(params, start):
                    p.copy_(p0)

    assert by_hand_at(0.0) == pytest.approx(float(loss), rel=1e-5)  # and fills `held` at the start

    def central(step: float) -> float:
        return (by_hand_at(step) - by_hand_at(-step)) / (2 * step)

    # a step of 1e-4 on every entry of a tiny model (weights ~2e-2) still curves the loss (its difference is 3e-3 off
    # the slope) and one of 1e-6 meets fp32's rounding: two steps, Richardson's extrapolation cancels the curvature
    coarse, fine = central(1e-4), central(5e-5)
    extrapolated = (4 * fine - coarse) / 3
    print(f"\n{divergence}: gradient along the direction {slope:.6g}; by hand: {coarse:.6g} (step 1e-4), {fine:.6g} (5e-5), {extrapolated:.6g} extrapolated")
    assert abs(slope) > 1 and slope == pytest.approx(extrapolated, rel=2e-3)


def test_rollouts_replay_selected_indices_and_respect_the_budget(tiny_dirs, samples):
    trainer = ReferenceTrainer(tiny_job(tiny_dirs["qwen3_5"]))
    prompts = trainer.encode(samples[:2])
    rollouts = rollout(trainer.student, trainer.processor.tokenizer, prompts, ["a", "b"], trainer.selector, 1000, 2, trainer.params, 3, 0, 0)
    assert [r.prompt_index for r in rollouts] == [0, 0, 0, 1, 1, 1]
    for r in rollouts:
        n = int(prompts[r.prompt_index].image_grid_thw.prod() // 4)
        assert len(r.selected[0]) == max(2, -(-n * 1000 // 10000))
        assert r.response_ids.shape[0] == r.old_logp.shape[0] == r.student_top_ids.shape[0] <= 6
    # the n responses of one prompt differ (distinct seeds) but share the selection
    assert torch.equal(rollouts[0].selected[0], rollouts[1].selected[0])
    assert not all(torch.equal(rollouts[0].response_ids, r.response_ids) for r in rollouts[1:3])


def test_an_update_trains_with_hiprune_on_what_it_picks_from_the_towers_attention(tiny_dirs, samples):
    """The selector cross's HiPrune arm: rollouts keep what HiPrune picks from the vision tower's recorded attention
    (the adapter's own selection, read here apart), and the update trains on them."""
    trainer = ReferenceTrainer(tiny_job(tiny_dirs["qwen3_5"], selector="hiprune"))
    prompts = trainer.encode(samples[:2])
    rollouts = rollout(trainer.student, trainer.processor.tokenizer, prompts, ["a", "b"], trainer.selector, 1000, 2, trainer.params, 3, 0, 0)
    for r in rollouts:
        prompt = prompts[r.prompt_index]
        features = trainer.student.visual_features(prompt, with_attention=True)
        picked = trainer.selector.select(trainer_input(trainer, prompt, features), len(r.selected[0]))
        assert torch.equal(r.selected[0], picked)
    assert math.isfinite(trainer.update(samples[:2]).stats.loss)


def trainer_input(trainer, prompt, features):
    from lt_opd_ray.core.selectors import SelectionInput

    (t, h, w) = features.merged_grids[0]
    return SelectionInput(features.embeds[0].float(), None, (t * h, w), attention=features.attention[0])


@pytest.mark.parametrize("family", FAMILIES)
def test_param_groups_cover_the_three_modules(loaded, family):
    from lt_opd_ray.config.schema import LearningRates

    model = loaded[family][0]
    groups = {g["name"]: g for g in param_groups(model, LearningRates(language_model=1.0, vision_encoder=2.0, merger=3.0))}
    assert {name: g["lr"] for name, g in groups.items()} == {"language_model": 1.0, "vision_encoder": 2.0, "merger": 3.0}
    assert sum(len(g["params"]) for g in groups.values()) == len(list(model.parameters()))
    ids = {name: {id(p) for p in g["params"]} for name, g in groups.items()}
    assert id(model.lm_head.weight) in ids["language_model"]
    assert {id(p) for p in model.model.visual.merger.parameters()} <= ids["merger"]
    assert {id(p) for p in model.model.visual.blocks.parameters()} <= ids["vision_encoder"]


def test_a_model_without_the_projector_the_recipe_trains_is_named(tiny_dirs):
    from transformers import AutoModelForImageTextToText

    from lt_opd_ray.config.schema import LearningRates

    model = AutoModelForImageTextToText.from_pretrained(tiny_dirs["glm4v"], dtype=torch.float32)
    del model.model.visual.merger, model.model.visual.downsample
    with pytest.raises(ValueError, match=r"GLM-4.1V / GLM-4.6V-Flash model \(Glm4vForConditionalGeneration\) has no merger parameters"
                                         r" \(none named by visual.downsample, visual.merger\)"):
        param_groups(model, LearningRates())


def test_bf16_compute_over_fp32_master_weights(tiny_dirs, samples):
    job = parse_job(
        f'model: {{path: "{tiny_dirs["qwen3_5"]}", dtype: bfloat16}}\n'
        'data: {path: "synthetic:8", max_pixels: 65536}\n'
        "budget: {k_min: 2}\nobjective: {top_k: 8}\nsampling: {prompts_per_step: 2, n: 2, max_new_tokens: 6}\n"
    )
    trainer = ReferenceTrainer(job)
    report = trainer.update(samples[:2])
    assert all(p.dtype == torch.float32 for p in trainer.student.model.parameters())
    # rollout and learner both compute in bf16: the weights agree to bf16 rounding (~2^-8 relative per logit)
    assert report.stats.importance_weight == pytest.approx(1.0, abs=2e-2)


def _perturbed_student(trainer, scale=0.05):
    """Move the student away from the teacher so their distributions differ."""
    generator = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for p in trainer.student.model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=generator))


def _hf_log_probs(model, prompt, response):
    """Independent reference: log-softmax of transformers' own full-token forward at the response positions [T, V]."""
    from test_adapter import full_forward_inputs

    logits = model(**full_forward_inputs(prompt, response)).logits[0, -response.numel() - 1 : -1]
    return torch.log_softmax(logits.double(), dim=-1)


@torch.no_grad()
def _teacher_sampled(tiny_dirs, batch, mode):
    """(job, trainer with a perturbed student, prompts, rollouts sampled by the teacher at full tokens, 2 per prompt)."""
    job = tiny_job(tiny_dirs["qwen3_5"], mode=mode)
    trainer = ReferenceTrainer(job)
    _perturbed_student(trainer)
    prompts = trainer.encode(batch)
    rollouts = rollout(trainer.student, trainer.processor.tokenizer, prompts, [s.uid for s in batch], trainer.selector,
                       10_000, 2, trainer.params, 2, job.seed, 0, behaviour=trainer.teacher)
    return job, trainer, prompts, rollouts


@torch.no_grad()
def test_teacher_sampled_rollouts_are_the_teachers_samples_seen_by_the_student(tiny_dirs, samples):
    from lt_opd_ray.core.seeding import stable_seed
    from lt_opd_ray.models.sampler import sample

    job, trainer, prompts, rollouts = _teacher_sampled(tiny_dirs, samples[:2], "teacher_prefix")
    uids = [s.uid for s in samples[:2]]
    full = []
    for p in prompts:
        features = trainer.teacher.visual_features(p)
        full += [trainer.teacher.reduce(p, features, trainer.teacher.keep_all(features))] * 2
    seeds = [stable_seed(job.seed, 0, uid, j) for uid in uids for j in range(2)]
    teacher_samples = sample(trainer.teacher, full, trainer.params, seeds, trainer.processor.tokenizer)
    for r, t in zip(rollouts, teacher_samples):
        assert torch.equal(r.response_ids, t.token_ids)  # the teacher's own full-token samples
        student = _hf_log_probs(trainer.student.model, prompts[r.prompt_index], r.response_ids)
        assert (r.old_logp.double() - student.gather(-1, r.response_ids[:, None]).squeeze(-1)).abs().max() <= 1e-5
        assert torch.equal(r.student_top_ids, torch.topk(student, 8, dim=-1).indices)
        assert not torch.allclose(r.old_logp, t.logprobs, atol=1e-3)  # the student's view, not the teacher's


@pytest.mark.parametrize("mode", ["sequence_kd", "sft"])
def test_the_sft_modes_loss_is_the_cross_entropy_of_their_responses(tiny_dirs, samples, mode):
    """sequence_kd: of the teacher's samples; sft: of the rows' own responses. Their loss reads no teacher scores (such
    a job starts no teacher pool), and refuses some given; the teacher-scored modes refuse none given."""
    responses = _teacher_sampled if mode == "sequence_kd" else _written
    job, trainer, prompts, rollouts = responses(tiny_dirs, samples[:2], mode)
    assert not job.objective.teacher_scores
    with torch.no_grad():
        scores = teacher_scores(trainer.teacher, prompts, rollouts, 8, 16)
    with pytest.raises(ValueError, match=f"objective.mode {mode} reads no teacher scores, but some were given"):
        student_loss(trainer.student, prompts, rollouts, scores, job.objective)
    with pytest.raises(ValueError, match="objective.mode fixed_prefix reads teacher scores, but none were given"):
        student_loss(trainer.student, prompts, rollouts, None, job.objective.model_copy(update={"mode": "fixed_prefix"}))
    loss, stats = student_loss(trainer.student, prompts, rollouts, None, job.objective)
    assert stats.divergence is None and stats.top_k_overlap is None  # nothing to compare with
    with torch.no_grad():
        per_sequence = [
            -_hf_log_probs(trainer.student.model, prompts[r.prompt_index], r.response_ids).gather(-1, r.response_ids[:, None]).mean()
            for r in rollouts
        ]
    assert float(loss.detach()) == pytest.approx(float(torch.stack(per_sequence).mean()), rel=1e-5)
    # its gradient is the cross-entropy's, through the student: the head's, against autograd of transformers' own
    # forward of each response (no teacher anywhere in it)
    head = trainer.student.model.lm_head.weight
    (gradient,) = torch.autograd.grad(loss, head)
    by_hand = torch.stack([
        -_hf_log_probs(trainer.student.model, prompts[r.prompt_index], r.response_ids).gather(-1, r.response_ids[:, None]).mean() for r in rollouts
    ]).mean()
    (expected,) = torch.autograd.grad(by_hand, head)
    assert float(expected.norm()) > 0
    torch.testing.assert_close(gradient, expected, rtol=1e-4, atol=1e-7)


@torch.no_grad()
def test_seeded_selectors_take_the_63_bit_sample_seeds(loaded, samples):
    """Rollout and evaluation seeds are 63-bit stable_seed values; the random selector must accept them."""
    from lt_opd_ray.core.seeding import stable_seed
    from lt_opd_ray.core.selectors import build_selector
    from lt_opd_ray.models.processor import encode_samples

    _, processor, vlm = loaded["qwen3_5"]
    prompt = encode_samples(processor, samples[:1])[0]
    features = vlm.visual_features(prompt)
    seed = stable_seed("eval", samples[0].uid)
    picks = [vlm.select(prompt, features, build_selector("random"), 2500, 2, seed=seed)[0] for _ in range(2)]
    assert torch.equal(picks[0], picks[1])
    assert not torch.equal(picks[0], vlm.select(prompt, features, build_selector("random"), 2500, 2, seed=seed + 1)[0])


@torch.no_grad()
def _written(tiny_dirs, batch, mode):
    """(job, trainer with a perturbed student, prompts, rollouts of the rows' own responses, one per prompt)."""
    job = tiny_job(tiny_dirs["qwen3_5"], mode=mode, n=1, max_new_tokens=16)
    trainer = ReferenceTrainer(job)
    _perturbed_student(trainer)
    prompts = trainer.encode(batch)
    rollouts = rollout(trainer.student, trainer.processor.tokenizer, prompts, [s.uid for s in batch], trainer.selector,
                       10_000, 2, trainer.params, 1, job.seed, 0, written=[s.response for s in batch])
    return job, trainer, prompts, rollouts


@torch.no_grad()
def test_written_rollouts_are_the_rows_responses_seen_by_the_student(tiny_dirs, samples):
    job, trainer, prompts, rollouts = _written(tiny_dirs, samples[:2], "fixed_prefix")
    tokenizer = trainer.processor.tokenizer
    for r, s in zip(rollouts, samples[:2], strict=True):
        assert s.response.endswith("</answer>")  # a stop string: the tokens end there, as a sampled response would
        assert r.response_ids.tolist() == tokenizer(s.response, add_special_tokens=False)["input_ids"]
        assert r.finish_reason == "stop"
        student = _hf_log_probs(trainer.student.model, prompts[r.prompt_index], r.response_ids)
        assert (r.old_logp.double() - student.gather(-1, r.response_ids[:, None]).squeeze(-1)).abs().max() <= 1e-5
        assert torch.equal(r.student_top_ids, torch.topk(student, 8, dim=-1).indices)


def test_a_response_without_a_stop_string_ends_with_eos_and_one_too_long_is_refused_by_row(tiny_dirs, samples):
    import dataclasses

    from lt_opd_ray.engines.transformers.rollout import read_written

    job = tiny_job(tiny_dirs["qwen3_5"], mode="sft", n=1, max_new_tokens=16)
    trainer = ReferenceTrainer(job)
    tokenizer, params = trainer.processor.tokenizer, trainer.params
    ids, finish = read_written(tokenizer, "Plain words", "row-a", params)
    assert ids.tolist() == [*tokenizer("Plain words", add_special_tokens=False)["input_ids"], tokenizer.eos_token_id] and finish == "eos"
    with pytest.raises(ValueError, match=r"row row-b: the response is \d+ tokens, above sampling.max_new_tokens \(16\)"):
        read_written(tokenizer, "word " * 40, "row-b", params)
    with pytest.raises(ValueError, match="row row-c carries no response to train on"):
        read_written(tokenizer, None, "row-c", params)
    long = [dataclasses.replace(s, response="word " * 40) for s in samples[:2]]
    with pytest.raises(ValueError, match=f"row {long[0].uid}: the response is"):
        trainer.update(long)


def test_the_dataset_modes_are_refused_more_than_one_response_per_row(tiny_dirs):
    from lt_opd_ray.config.loading import JobConfigError

    with pytest.raises(JobConfigError, match="objective.mode fixed_prefix trains on the one response each row carries: set sampling.n to 1"):
        tiny_job(tiny_dirs["qwen3_5"], mode="fixed_prefix", n=2)
    assert tiny_job(tiny_dirs["qwen3_5"], mode="teacher_prefix", n=2).objective.prefixes == "teacher"


def test_the_learning_rate_warms_up_linearly_over_the_default_14_updates_then_holds(loaded):
    """build_optimizer's schedule (the reference's and every learner rank's), update by update, against
    lr * min(1, (u + 1) / W) written out with W = 14, the default: update 0 at lr / 14, update 13 at the full rate."""
    from lt_opd_ray.config.schema import OptimizerConfig
    from lt_opd_ray.core.optim import build_optimizer

    config = OptimizerConfig()
    assert config.warmup_steps == 14
    optimizer, scheduler = build_optimizer(loaded["qwen3_5"][0], config)
    base = {group["name"]: getattr(config.lr, group["name"]) for group in optimizer.param_groups}
    for update in range(20):
        expected = {name: lr * min(1.0, (update + 1) / 14) for name, lr in base.items()}
        assert {group["name"]: group["lr"] for group in optimizer.param_groups} == pytest.approx(expected, rel=1e-12), update
        optimizer.step()  # no gradients: nothing moves, the schedule advances
        scheduler.step()


def test_the_warm_up_counts_updates_whatever_the_optimizer_steps_an_update(loaded):
    """optimizer.steps_per_update 2, warm-up over 3 updates: the scheduler steps with the optimizer, twice an
    update, and both steps of update u use lr * (u + 1) / 3."""
    from lt_opd_ray.config.schema import OptimizerConfig
    from lt_opd_ray.core.optim import build_optimizer

    config = OptimizerConfig(warmup_steps=3, steps_per_update=2)
    optimizer, scheduler = build_optimizer(loaded["qwen3_5"][0], config)
    factors = []
    for _ in range(8):
        factors.append(optimizer.param_groups[0]["lr"] / config.lr.language_model)
        optimizer.step()
        scheduler.step()
    assert factors == pytest.approx([1 / 3, 1 / 3, 2 / 3, 2 / 3, 1, 1, 1, 1], rel=1e-12)


def brute_force_reverse_kl(student_lp, teacher_lp, student_top_ids, sampled, k) -> torch.Tensor:
    """KL(student || teacher) at each position [T] from full-vocabulary log-probs [T, V]: over the set of the
    student's top-k ids, the teacher's top-k and the sampled token, plus one bin for the rest of the vocabulary."""
    values = []
    for t in range(student_lp.shape[0]):
        ids = sorted({*student_top_ids[t].tolist(), *teacher_lp[t].topk(k).indices.tolist(), int(sampled[t])})
        s, q = student_lp[t, ids].exp(), teacher_lp[t, ids].exp()
        s_tail, q_tail = 1 - s.sum(), 1 - q.sum()
        values.append((s * (s.log() - q.log())).sum() + s_tail * (s_tail.log() - q_tail.log()))
    return torch.stack(values)


def rl_rollouts(tiny_dirs, samples, mode: str, kl_coef: float):
    """(job, reference trainer with its student moved off the teacher, 2 prompts, their 4 rollouts each at 100%) of an
    RL baseline rewarded by `format`."""
    job = tiny_job(tiny_dirs["qwen3_5"], mode=mode, n=4, reward="format", kl_coef=kl_coef)
    trainer = ReferenceTrainer(job)
    _perturbed_student(trainer)
    batch = samples[:2]
    prompts = trainer.encode(batch)
    with torch.no_grad():
        rollouts = rollout(trainer.student, trainer.processor.tokenizer, prompts, [s.uid for s in batch], trainer.selector,
                           10_000, 2, trainer.params, 4, job.seed, 0)
    return job, trainer, prompts, rollouts


@pytest.mark.parametrize("kl_coef", [0.0, 0.5])
@pytest.mark.parametrize("mode", ["grpo", "dapo", "gspo"])
def test_the_rl_baselines_loss_is_the_papers_formula_on_plain_forwards(tiny_dirs, samples, mode, kl_coef):
    """Each rollout's advantage within its prompt's group, the student's log-probs from transformers' own forward,
    and core/rl.py's loss on them (itself checked against the papers' formulas, tests/test_rl.py): the gradient on
    policy (the old policy is the student's own log-probs, so every ratio is exactly 1), and the value and gradient
    on rollouts of a policy a version behind (their recorded log-probs, moved so that the clip binds). With a KL
    term, plus kl_coef times KL(student || frozen initial weights) per token, brute-forced from both models'
    full-vocabulary forwards, averaged as the policy term is."""
    from torch.nn.utils.rnn import pad_sequence

    from lt_opd_ray.core.rl import CLIP_RANGES, TOKEN_MEAN, policy_loss

    job, trainer, prompts, rollouts = rl_rollouts(tiny_dirs, samples, mode, kl_coef)
    assert job.objective.teacher_scores == (kl_coef > 0)  # the frozen weights are the teacher pool's
    for i, r in enumerate(rollouts):
        r.reward = [1.0, 0.0, 0.5, 0.0][i % 4] + 0.25 * r.prompt_index  # varied within each prompt's group
    by_prompt = [[r.reward for r in rollouts if r.prompt_index == p] for p in (0, 1)]
    expected = torch.tensor([(v - statistics.fmean(g)) / (statistics.stdev(g) + 1e-6) for g in by_prompt for v in g])
    lm_head = trainer.student.model.lm_head.weight
    low, high = CLIP_RANGES[mode]
    for on_policy in (True, False):
        if not on_policy:  # the lagged policy: its log-probs a little off the student's, some ratios past the clip
            for r in rollouts:
                r.old_logp = r.old_logp + 0.3 * torch.randn(r.old_logp.shape, generator=torch.Generator().manual_seed(r.response_ids.numel()))
        policy = ReferenceTrainer.policy_inputs(rollouts, on_policy)
        torch.testing.assert_close(policy.advantages, expected, rtol=1e-6, atol=1e-6)
        centred = ReferenceTrainer.policy_inputs(rollouts, on_policy, scale=False).advantages  # Dr. GRPO's: not divided
        torch.testing.assert_close(centred, torch.tensor([v - statistics.fmean(g) for g in by_prompt for v in g]), rtol=1e-6, atol=1e-6)
        scores = teacher_scores(trainer.teacher, prompts, rollouts, 8, 16, 4096) if kl_coef else None
        loss, stats = student_loss(trainer.student, prompts, rollouts, scores, job.objective, policy=policy)
        (grad,) = torch.autograd.grad(loss, lm_head)
        full = [_hf_log_probs(trainer.student.model, prompts[r.prompt_index], r.response_ids) for r in rollouts]
        logp = pad_sequence([lp.gather(-1, r.response_ids[:, None])[:, 0] for lp, r in zip(full, rollouts)], batch_first=True)
        old = logp.detach() if on_policy else pad_sequence([r.old_logp.double() for r in rollouts], batch_first=True)
        mask = pad_sequence([torch.ones(r.response_ids.numel()) for r in rollouts], batch_first=True)
        reference = policy_loss(logp, old, expected.double(), mask.double(), kind=mode, clip_low=low, clip_high=high,
                                dual_clip=job.objective.dual_clip)
        if kl_coef:
            with torch.no_grad():
                frozen = [_hf_log_probs(trainer.teacher.model, prompts[r.prompt_index], r.response_ids) for r in rollouts]
            kl = [brute_force_reverse_kl(s, t, r.student_top_ids, r.response_ids, 8) for s, t, r in zip(full, frozen, rollouts)]
            assert min(float(v.min()) for v in kl) > 0  # the perturbed student is off the frozen weights at every token
            per_response = torch.stack([v.sum() if mode in TOKEN_MEAN else v.mean() for v in kl])
            reference = reference + kl_coef * per_response.sum() / (mask.sum() if mode in TOKEN_MEAN else len(rollouts))
            assert stats.divergence == pytest.approx(float(torch.cat(kl).mean()), rel=1e-4)
        (reference_grad,) = torch.autograd.grad(reference, lm_head)
        assert float(loss.detach()) == pytest.approx(float(reference.detach()), rel=1e-4, abs=1e-7), on_policy
        torch.testing.assert_close(grad.double(), reference_grad.double(), rtol=1e-3, atol=1e-7)
        assert float(grad.norm()) > 0
        if on_policy:
            assert stats.importance_weight == 1.0 and stats.clipped == 0.0  # exp(0): one optimizer step per update
        else:
            assert stats.clipped > 0  # the clip binds somewhere (for GSPO, on whole responses)
            # objective.clip_low / clip_high replace the paper's range, dual_clip verl's 3 (a cap that binds at these
            # ratios, σ 0.3): the loss is the formula's at the job's settings
            moved = job.objective.model_copy(update={"clip_low": low / 2, "clip_high": high * 2, "dual_clip": 1.05})
            assert moved.clip_range == (low / 2, high * 2)
            at_range, _ = student_loss(trainer.student, prompts, rollouts, scores, moved, policy=policy)
            formula = policy_loss(logp, old, expected.double(), mask.double(), kind=mode, clip_low=low / 2, clip_high=high * 2,
                                  dual_clip=1.05)
            if mode != "gspo":  # the cap acts here (GSPO has none)
                uncapped = policy_loss(logp, old, expected.double(), mask.double(), kind=mode, clip_low=low / 2, clip_high=high * 2,
                                       dual_clip=None)
                assert float(uncapped.detach()) > float(formula.detach()) + 1e-3
            if kl_coef:
                formula = formula + (reference - policy_loss(logp, old, expected.double(), mask.double(), kind=mode, clip_low=low,
                                                             clip_high=high, dual_clip=job.objective.dual_clip))
            assert float(at_range.detach()) == pytest.approx(float(formula.detach()), rel=1e-4, abs=1e-7)
            assert float(at_range.detach()) != pytest.approx(float(loss.detach()), rel=1e-4, abs=1e-7)  # the range acts here


def test_a_flat_group_left_out_of_the_step_neither_adds_to_its_loss_nor_dilutes_it(tiny_dirs, samples):
    """Dynamic sampling's filter (DAPO's): a prompt whose responses all got one reward after the last round takes no
    part in the step. With a KL term (where a flat group still has a loss) the step's loss over both prompts is the
    loss of the other prompt's rollouts alone, divided by their count; kept in, the flat group adds its KL term and
    counts in the normaliser, and the loss is another."""
    from lt_opd_ray.models.loss import trained_count

    for mode in ("grpo", "dapo"):
        job, trainer, prompts, rollouts = rl_rollouts(tiny_dirs, samples, mode, kl_coef=0.5)
        for i, r in enumerate(rollouts):
            r.reward = [1.0, 0.0, 0.5, 0.0][i % 4] if r.prompt_index == 0 else 1.0  # prompt 1's group is flat
        scores = teacher_scores(trainer.teacher, prompts, rollouts, 8, 16, 4096)
        policy = ReferenceTrainer.policy_inputs(rollouts, True, leave_flat_out=True)
        assert policy.trained.tolist() == [float(r.prompt_index == 0) for r in rollouts]
        kept = [i for i, r in enumerate(rollouts) if r.prompt_index == 0]
        whole, _ = student_loss(trainer.student, prompts, rollouts, scores, job.objective,
                                trained_count(job.objective, rollouts, policy.trained.tolist()), policy)
        alone, _ = student_loss(trainer.student, prompts, [rollouts[i] for i in kept], [scores[i] for i in kept], job.objective,
                                trained_count(job.objective, [rollouts[i] for i in kept], [1.0] * len(kept)), policy.of(kept))
        assert float(whole) == pytest.approx(float(alone), rel=1e-6), mode
        diluted = ReferenceTrainer.policy_inputs(rollouts, True)
        old, _ = student_loss(trainer.student, prompts, rollouts, scores, job.objective,
                              trained_count(job.objective, rollouts, diluted.trained.tolist()), diluted)
        assert abs(float(old) - float(whole)) > 1e-4, mode


def test_later_steps_of_an_update_compare_with_the_weights_it_started_from(tiny_dirs, samples):
    """optimizer.steps_per_update 2 (GRPO, one rank: prompt 0, then prompt 1), at full tokens so that transformers'
    own forward replays each rollout: the reference's update equals two AdamW steps written here on plain forwards,
    the first against its own log-probs, the second against the log-probs the starting weights gave its responses;
    the second step's ratios are off 1 (the first step moved the weights), so its own log-probs as the old policy
    would give another loss."""
    from torch.nn.utils.rnn import pad_sequence

    from lt_opd_ray.core.rl import CLIP_RANGES, policy_loss
    from lt_opd_ray.engines.rollout_engines import response_texts

    job = tiny_job(tiny_dirs["qwen3_5"], mode="grpo", n=4, reward="'user_rewards:letters'", steps=2, start_bps=10_000, target_bps=10_000)
    assert job.pools.learner.ranks == 1
    trainer, mirror = ReferenceTrainer(job), ReferenceTrainer(job)
    batch = samples[:2]
    report = trainer.update(batch)

    prompts = mirror.encode(batch)
    with torch.no_grad():
        rollouts = rollout(mirror.student, mirror.processor.tokenizer, prompts, [s.uid for s in batch], mirror.selector,
                           10_000, 2, mirror.params, 4, job.seed, 0)
    rewards = mirror.reward([batch[r.prompt_index] for r in rollouts], response_texts(mirror.processor, rollouts),
                            [r.response_ids.numel() for r in rollouts])
    by_prompt = [[v for r, v in zip(rollouts, rewards) if r.prompt_index == p] for p in (0, 1)]
    assert all(len(set(group)) > 1 for group in by_prompt)  # a gradient to follow in each step
    model = mirror.student.model
    initial = state(model)

    def log_probs(members):
        return pad_sequence([_hf_log_probs(model, prompts[r.prompt_index], r.response_ids).gather(-1, r.response_ids[:, None])[:, 0]
                             for r in members], batch_first=True)

    low, high = CLIP_RANGES["grpo"]
    start = {p: log_probs([r for r in rollouts if r.prompt_index == p]).detach() for p in (0, 1)}
    losses = []
    for p in (0, 1):
        members = [r for r in rollouts if r.prompt_index == p]
        advantages = torch.tensor([(v - statistics.fmean(by_prompt[p])) / (statistics.stdev(by_prompt[p]) + 1e-6) for v in by_prompt[p]])
        mask = pad_sequence([torch.ones(r.response_ids.numel()) for r in members], batch_first=True).double()
        logp = log_probs(members)
        loss = policy_loss(logp, start[p], advantages.double(), mask, kind="grpo", clip_low=low, clip_high=high,
                           dual_clip=job.objective.dual_clip)
        if p == 1:
            ratios = torch.exp(logp.detach() - start[p])[mask.bool()]
            assert float((ratios - 1).abs().max()) > 1e-3  # the first step moved the weights
            own = policy_loss(logp, logp.detach(), advantages.double(), mask, kind="grpo", clip_low=low, clip_high=high,
                              dual_clip=job.objective.dual_clip)
            assert float(own) != pytest.approx(float(loss), rel=1e-3)  # the wrong old policy shows
        mirror.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), job.optimizer.grad_clip)
        mirror.optimizer.step()
        mirror.scheduler.step()
        losses.append(float(loss.detach()))
    # Adam moves an entry whose gradient is rounding noise (fp32 here, fp64 there) by ~lr either way, which moves the
    # second step's log-probs a little: the loss to 1%, the weights to a few percent of how far the update moved them
    # (the second step against its own log-probs gives loss 0: every ratio 1, advantages of mean 0)
    assert losses[0] == pytest.approx(0.0, abs=1e-6) and losses[1] > 0.005
    assert report.stats.loss == pytest.approx(sum(losses) / 2, rel=1e-2)
    assert report.stats.importance_weight != 1.0  # the second step's ratios
    got, expected = state(trainer.student.model), state(model)
    moved = sum(float((expected[k] - initial[k]).square().sum()) for k in got) ** 0.5
    off = sum(float((got[k] - expected[k]).square().sum()) for k in got) ** 0.5
    assert off < 0.02 * moved, (off, moved)
