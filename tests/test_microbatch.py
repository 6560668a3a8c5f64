"""Micro-batches, vision once per prompt and the teacher's shared prompt cache, against brute-force references.

The brute force runs every rollout alone: its own vision-tower pass, its own
full-sequence forward, its own loss; the update's loss is the mean of those.
"""

import random

import pytest
import torch
from conftest import FAMILIES
from device_reads import DeviceReads
from test_reference_update import tiny_job

from lt_opd_ray.core.microbatch import MicroBatch, Sequence, pack
from lt_opd_ray.core.objective import gather_log_probs, lt_opd_token_losses, top_k_log_probs
from lt_opd_ray.engines.transformers.teacher import teacher_scores
from lt_opd_ray.models.loss import loss_on_forward, reduced_length, student_forward, student_loss, supports_of
from lt_opd_ray.reference import ReferenceTrainer


# ------------------------------------------------------------------ packing
@pytest.mark.parametrize("packed", [False, True])
def test_pack_covers_every_sequence_once_within_the_budget(packed):
    """Padded, a micro-batch computes rows x longest; packed (one row end to end), its sequences' tokens. Either stays
    within the budget, and packed rows never need more micro-batches than padded ones."""
    rng = random.Random(0)
    for trial in range(200):
        sequences = [Sequence(i, rng.randrange(6), rng.randint(1, 60)) for i in range(rng.randint(1, 40))]
        budget = rng.randint(1, 300)
        batches = pack(sequences, budget, packed)
        placed = [i for b in batches for i in b.sequences]
        assert sorted(placed) == list(range(len(sequences))), trial
        if packed:  # never more micro-batches than padded rows need
            assert len(batches) <= len(pack(sequences, budget)), trial
        for b in batches:
            tokens = [sequences[i].tokens for i in b.sequences]
            assert b.computed_tokens == (sum(tokens) if packed else len(tokens) * max(tokens))
            assert b.computed_tokens <= budget or len(b.sequences) == 1  # only a sequence longer than the budget exceeds it
            assert list(b.sequences) == sorted(b.sequences)
            assert b.prompts == tuple(dict.fromkeys(sequences[i].prompt for i in b.sequences))


def test_pack_keeps_a_prompts_group_together_when_it_fits():
    # 3 prompts x 4 responses of 100..130 tokens, budget = one group
    sequences = [Sequence(4 * p + j, p, 100 + 10 * j) for p in range(3) for j in range(4)]
    batches = pack(sequences, 4 * 130)
    assert [b.prompts for b in batches] == [(0,), (1,), (2,)]
    assert pack(sequences, 10**6) == [MicroBatch(tuple(range(12)), (0, 1, 2), 12 * 130)]


def test_pack_buckets_by_length():
    """Long groups first, short ones together: less padding than packing in arrival order."""
    lengths = [1000, 20, 1000, 20, 1000, 20, 1000, 20]
    sequences = [Sequence(i, i, t) for i, t in enumerate(lengths)]
    bucketed = sum(b.computed_tokens for b in pack(sequences, 2000))
    assert bucketed == 2 * 2000 + 80  # [1000, 1000] x 2, then the four 20s in one batch
    in_order = 4 * (2 * 1000)  # arrival order pairs every 20 with a 1000
    assert bucketed < in_order


def test_pack_refuses_a_non_positive_budget():
    with pytest.raises(ValueError, match="token budget"):
        pack([Sequence(0, 0, 3)], 0)


# --------------------------------------------------------- student and teacher
@pytest.fixture(scope="module")
def updates(tiny_dirs):
    """family -> (trainer, prompts, rollouts, scores): 2 prompts x 3 rollouts at 25%, scored by the teacher."""
    from lt_opd_ray.engines.transformers.rollout import rollout
    from lt_opd_ray.sources.resolve import load_samples

    samples = load_samples("synthetic:4")[:2]
    out = {}
    for family in FAMILIES:
        trainer = ReferenceTrainer(tiny_job(tiny_dirs[family]))
        prompts = trainer.encode(samples)
        rollouts = rollout(trainer.student, trainer.processor.tokenizer, prompts, ["a", "b"], trainer.selector, 2500, 2, trainer.params, 3, 0, 0)
        scores = teacher_scores(trainer.teacher, prompts, rollouts, 8, 16)
        out[family] = (trainer, prompts, rollouts, scores)
    return out


def brute_force_loss(student, prompts, rollouts, scores, objective) -> torch.Tensor:
    """Mean over rollouts of each rollout's token-mean loss, every rollout with its own vision pass and forward."""
    per_rollout = []
    for r, s in zip(rollouts, scores):
        prompt = prompts[r.prompt_index]
        reduced = student.reduce(prompt, student.visual_features(prompt), r.selected)
        (hidden,) = student.response_hidden([reduced], [r.response_ids])
        (ids, valid, teacher_logp), = supports_of([r], [s], torch.device("cpu"))  # one rollout alone: no rows of others
        student_logp = gather_log_probs(hidden, student.lm_head.weight, ids, 4)
        token_loss, _, _ = lt_opd_token_losses(
            student_logp, teacher_logp, valid, ids.shape[1] - 1, r.old_logp, objective.divergence, objective.alpha, objective.importance_clip
        )
        per_rollout.append(token_loss.mean())
    return torch.stack(per_rollout).mean()


def gradients(model, loss_fn) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    loss_fn().backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("family", FAMILIES)
def test_micro_batched_gradients_equal_the_brute_force(updates, family, packed):
    """Micro-batches of left-padded rows, or of packed rows (the learner's default, `pools.learner.packing`)."""
    trainer, prompts, rollouts, scores = updates[family]
    student, objective = trainer.student, trainer.job.objective
    total = len(rollouts)

    def micro_batched(budget):
        sequences = [Sequence(i, r.prompt_index, reduced_length(prompts[r.prompt_index], r.selected) + r.response_ids.numel())
                     for i, r in enumerate(rollouts)]
        batches = pack(sequences, budget, packed)
        loss = 0.0
        for b in batches:
            chosen = [rollouts[i] for i in b.sequences]
            loss = loss + loss_on_forward(student, student_forward(student, prompts, chosen, packed), chosen, [scores[i] for i in b.sequences],
                                          objective, total)[0]
        return loss, batches

    expected = gradients(student.model, lambda: brute_force_loss(student, prompts, rollouts, scores, objective))
    one_per_prompt = max(reduced_length(prompts[r.prompt_index], r.selected) + r.response_ids.numel() for r in rollouts) * 3
    for budget, shape in [(10**6, 1), (one_per_prompt, 2), (1, 6)]:  # everything at once, one prompt each, one sequence each
        loss, batches = micro_batched(budget)
        assert len(batches) == shape
        got = gradients(student.model, lambda: micro_batched(budget)[0])
        assert got.keys() == expected.keys()
        assert any(n.startswith("model.visual") for n in got)  # the vision tower and merger are trained
        for name, grad in expected.items():
            # fp32: a row forwarded alone rounds differently from the same row in a padded batch
            # (measured: up to 2e-5 relative on Qwen2.5-VL's merger); a wrong normalisation or a
            # gradient lost through the shared vision features is off by O(1)
            torch.testing.assert_close(got[name], grad, rtol=1e-4, atol=1e-7, msg=lambda m: f"{family} budget {budget}: {name}: {m}")
        # a ~6e-5 loss (student = teacher but for the pruning): fp32 rounding of the per-token JSD is ~1e-9 absolute
        assert float(loss) == pytest.approx(float(brute_force_loss(student, prompts, rollouts, scores, objective)), rel=1e-5, abs=1e-8)


def test_student_loss_runs_the_vision_tower_once_per_prompt(updates):
    trainer, prompts, rollouts, scores = updates["qwen3_5"]
    calls = []
    hook = trainer.student.model.model.visual.register_forward_hook(lambda *_: calls.append(1))
    try:
        _, stats = student_loss(trainer.student, prompts, rollouts, scores, trainer.job.objective)
    finally:
        hook.remove()
    assert len(calls) == stats.vision_forwards == 2 and stats.sequences == 6


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("family", FAMILIES)
def test_shared_prompt_teacher_scores_equal_one_forward_per_rollout(updates, family, packed):
    """The prompt's cache continued by right-padded rows, or by one packed row (the transformers engine's default)."""
    trainer, prompts, rollouts, _ = updates[family]
    teacher = trainer.teacher
    weight = teacher.lm_head.weight
    expected = []
    with torch.no_grad():
        for r in rollouts:  # brute force: the full-token prompt + response in one forward, per rollout
            prompt = prompts[r.prompt_index]
            features = teacher.visual_features(prompt)
            (hidden,) = teacher.response_hidden([teacher.reduce(prompt, features, teacher.keep_all(features))], [r.response_ids])
            requested = torch.cat([r.student_top_ids, r.response_ids[:, None]], dim=-1)
            expected.append(top_k_log_probs(hidden, weight, 8, 16, requested))
    for budget in (10**6, 7, 1):  # one micro-batch per prompt, several, one response each
        got = teacher_scores(teacher, prompts, rollouts, 8, 16, token_budget=budget, packed=packed)
        for score, (ids, logp, requested_logp) in zip(got, expected):
            torch.testing.assert_close(score.top_logp, logp, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(score.requested_logp, requested_logp, rtol=1e-5, atol=1e-5)
            gathered = torch.gather(torch.full((ids.shape[0], weight.shape[0]), -1e9).scatter(1, ids, logp), 1, score.top_ids.long())
            torch.testing.assert_close(gathered, score.top_logp, rtol=1e-5, atol=1e-5)  # same ids up to ties


def test_prompt_prefixes_run_ahead_give_the_teachers_scores_bit_for_bit(updates):
    """The teacher service's head start (`TeacherEngine.prefill`, while the rollouts are sampled): scores from
    prefixes run ahead equal scores computed in one call, each prefix is used once, and old updates' are let go."""
    from lt_opd_ray.engines.teacher_engines import TransformersTeacherEngine
    from lt_opd_ray.sources.resolve import load_samples

    trainer, _, rollouts, _ = updates["qwen3_5"]
    samples = dict(enumerate(load_samples("synthetic:4")[:2]))
    engine = TransformersTeacherEngine(trainer.job)
    expected = engine.score(samples, rollouts, update=3)  # no head start: each prefix run inside the call
    assert engine.prefill(3, {0: samples[0]}) == 1 and engine.prefill(3, {0: samples[0]}) == 0  # already there
    assert engine.prefill(2, samples) == 2 and set(engine.prefixes) == {(3, 0), (2, 0), (2, 1)}
    got = engine.score(samples, rollouts, update=3)  # prompt 0 from its head start, prompt 1 run here
    assert set(engine.prefixes) == {(2, 0), (2, 1)}  # update 3's used once; update 2's wait for their own score
    for a, b in zip(got, expected):
        assert torch.equal(a.top_ids, b.top_ids) and torch.equal(a.top_logp, b.top_logp) and torch.equal(a.requested_logp, b.requested_logp)
    engine.prefill(4, {0: samples[0]})
    assert set(engine.prefixes) == {(4, 0)}  # at most two updates are in flight: update 2's were scored elsewhere


def test_frozen_engines_hold_the_compute_dtype_and_the_teacher_scores_as_fp32_weights_under_autocast(updates):
    """A bf16 job's teacher and transformers rollout engine (and its frozen copy that writes prefixes) hold bf16
    weights, half the bytes (autocast would re-cast fp32 weights on every op: it caches casts only of weights that
    require grad). The teacher's scores equal those of fp32 weights under bf16 autocast up to the bf16 rounding of
    what autocast leaves in fp32 (norms, the residual stream)."""
    from lt_opd_ray.engines.rollout_engines import TransformersRolloutEngine
    from lt_opd_ray.engines.teacher_engines import TransformersTeacherEngine
    from lt_opd_ray.sources.resolve import load_samples

    trainer, _, rollouts, _ = updates["qwen3_5"]
    bf16 = trainer.job.model_copy(update={"model": trainer.job.model.model_copy(update={"dtype": "bfloat16"}),
                                          "objective": trainer.job.objective.model_copy(update={"mode": "teacher_prefix"})})
    teacher, rollout_engine = TransformersTeacherEngine(bf16), TransformersRolloutEngine(bf16)
    for vlm in (teacher.vlm, rollout_engine.vlm, rollout_engine.behaviour):
        assert {p.dtype for p in vlm.model.parameters()} == {torch.bfloat16}
    samples = dict(enumerate(load_samples("synthetic:4")[:2]))
    held = teacher.score(samples, rollouts, update=0)
    teacher.vlm.model.float()  # fp32 weights: what the teacher held before, computing in bf16 under autocast
    autocast = teacher.score(samples, rollouts, update=0)
    print("largest log-prob difference", max(float((a.requested_logp - b.requested_logp).abs().max()) for a, b in zip(held, autocast)))
    for a, b in zip(held, autocast):
        torch.testing.assert_close(a.requested_logp, b.requested_logp, rtol=0.0, atol=0.1)
        torch.testing.assert_close(a.top_logp, b.top_logp, rtol=0.0, atol=0.1)


def test_the_steps_health_figures_and_a_masked_cut_response_against_a_count_by_hand(updates):
    """Per update: the share of importance weights cut to the clip, the mean |learner - rollout| log-prob of the
    sampled tokens, the responses cut at max_new_tokens and the longest, each against the same count from the
    learner's own log-probs. `objective.truncated: mask` gives a cut response no loss (or gradient) and leaves the
    others' terms as they were (the update still divides by all its sequences)."""
    import dataclasses

    trainer, prompts, rollouts, scores = updates["qwen3_5"]
    student, objective = trainer.student, trainer.job.objective
    # the rollout engine's log-probs moved on a few positions, so some ratios pass the clip; two responses cut at the cap
    rollouts = [dataclasses.replace(r, old_logp=r.old_logp - (3.0 if i % 2 else 0.0), finish_reason="length" if i in (1, 4) else "eos")
                for i, r in enumerate(rollouts)]
    with torch.no_grad():
        loss, stats = student_loss(student, prompts, rollouts, scores, objective)
        own = [student_loss(student, prompts, [r], [s], objective)[1] for r, s in zip(rollouts, scores)]
    sampled = [None] * len(rollouts)  # the learner's log-prob of each sampled token, by hand: a full log-softmax per rollout
    for i, r in enumerate(rollouts):
        prompt = prompts[r.prompt_index]
        reduced = student.reduce(prompt, student.visual_features(prompt), r.selected)
        with torch.no_grad():
            (hidden,) = student.response_hidden([reduced], [r.response_ids])
            sampled[i] = torch.log_softmax(hidden @ student.lm_head.weight.T, -1).gather(-1, r.response_ids[:, None])[:, 0]
    ratios = torch.cat([(lp - r.old_logp).exp() for lp, r in zip(sampled, rollouts)])
    assert 0 < (ratios >= objective.importance_clip).sum() < ratios.numel()
    assert stats.clipped == pytest.approx(float((ratios >= objective.importance_clip).double().mean()), abs=1e-6)  # an fp32 mean
    assert stats.logprob_gap == pytest.approx(float(torch.cat([(lp - r.old_logp).abs() for lp, r in zip(sampled, rollouts)]).mean()), rel=1e-4)
    assert stats.truncated == 2 and stats.longest == max(r.response_ids.numel() for r in rollouts)
    masked = objective.model_copy(update={"truncated": "mask"})
    with torch.no_grad():
        masked_loss, _ = student_loss(student, prompts, rollouts, scores, masked)
    kept = sum(o.loss for i, o in enumerate(own) if i not in (1, 4)) / len(rollouts)  # each alone: its token mean / 1
    # a divergence of near-equal distributions (~1e-4): a batched forward's fp32 rounding shows at ~1e-4 of it
    assert float(masked_loss) == pytest.approx(kept, rel=1e-3)
    assert float(loss) - kept > 0.05 * kept  # the two cut responses carried more than the tolerance
    # objective.importance: prefix reaches the loss (weights of the prefix's ratios; the first position's is 1)
    with torch.no_grad():
        _, prefix = student_loss(student, prompts, rollouts, scores, objective.model_copy(update={"importance": "prefix"}))
    firsts = torch.stack([(lp[0] - r.old_logp[0]).exp().clamp(max=objective.importance_clip) for lp, r in zip(sampled, rollouts)])
    assert prefix.importance_weight != pytest.approx(stats.importance_weight) and bool((firsts != 1).any())


def test_activation_checkpointing_recomputes_blocks_and_keeps_the_gradients(updates):
    """pools.learner.activation_checkpointing: each decoder and vision block runs again in the backward; same gradients."""
    trainer, prompts, rollouts, scores = updates["qwen3_5"]
    student, objective = trainer.student, trainer.job.objective
    model = student.model
    loss = lambda: student_loss(student, prompts, rollouts, scores, objective)[0]  # noqa: E731
    expected = gradients(model, loss)
    calls = {"decoder": 0, "vision": 0}

    def counted(module, key):  # forward itself: the recompute in the backward does not run module hooks
        forward = module.forward

        def wrapper(*args, **kwargs):
            calls[key] += 1
            return forward(*args, **kwargs)

        module.forward = wrapper

    decoder, block = model.model.language_model.layers[0], model.model.visual.blocks[0]
    counted(decoder, "decoder")
    counted(block, "vision")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    try:
        got = gradients(model, loss)
    finally:
        model.gradient_checkpointing_disable()
        del decoder.forward, block.forward
    assert calls == {"decoder": 2, "vision": 4}  # forward + recompute; the vision tower runs once for each of the 2 prompts
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-5, atol=1e-8, msg=name)


# ------------------------------------------- the loss on a real model, from plain forwards
@pytest.fixture(scope="module")
def moved_student(tiny_dirs):
    """(trainer, prompts, rollouts, scores): a tiny Qwen3.5 whose student is moved away from its teacher (loss ~1e-1,
    not ~1e-5, so fp32 rounding of near-equal log-probs does not hide an error), 2 prompts x 3 rollouts at 25% whose
    recorded log-probs are moved (a rollout engine a version behind): the importance weights pass any clip above
    e^-0.5 on half the positions and stay under it on the other half."""
    from dataclasses import replace

    from lt_opd_ray.engines.transformers.rollout import rollout
    from lt_opd_ray.sources.resolve import load_samples

    trainer = ReferenceTrainer(tiny_job(tiny_dirs["qwen3_5"]))
    generator = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for parameter in trainer.student.model.parameters():
            parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator))
    prompts = trainer.encode(load_samples("synthetic:4")[:2])
    rollouts = rollout(trainer.student, trainer.processor.tokenizer, prompts, ["a", "b"], trainer.selector, 2500, 2, trainer.params, 3, 0, 0)
    rollouts = [replace(r, old_logp=r.old_logp + torch.tensor([-1.0, 0.5]).repeat(r.old_logp.numel())[: r.old_logp.numel()]) for r in rollouts]
    scores = teacher_scores(trainer.teacher, prompts, rollouts, trainer.job.objective.top_k, 16)
    return trainer, prompts, rollouts, scores


# Settings away from the defaults, where a learner that reads another value (the default, the mixture's weights
# swapped, the other importance weight, no clip) gives another loss by far more than the tolerance.
LOSS_SETTINGS = {
    "jsd-alpha0.2-token-clip1.5": {"divergence": "jsd", "alpha": 0.2, "importance": "token", "importance_clip": 1.5},
    "jsd-alpha0.8-prefix-clip1.5": {"divergence": "jsd", "alpha": 0.8, "importance": "prefix", "importance_clip": 1.5},
    "reverse_kl-token-clip1.2": {"divergence": "reverse_kl", "importance": "token", "importance_clip": 1.2},
    "forward_kl-prefix-clip3": {"divergence": "forward_kl", "importance": "prefix", "importance_clip": 3.0},
}


@pytest.mark.parametrize("settings", LOSS_SETTINGS.values(), ids=LOSS_SETTINGS.keys())
def test_student_loss_equals_the_loss_by_hand_at_the_jobs_objective_settings(moved_student, settings):
    """student_loss (the union's columns in models/loss.py, the chunked gather, the objective) against loss_by_hand
    (tests/loss_by_hand.py: plain forwards, full vocabulary, the support as a set, the tail bin, the divergence and the
    importance weight written token by token) at the job's divergence, mixture weight, importance weight and clip,
    where the clip binds on some tokens; each setting read as another value (its default, α swapped, no clip) gives a
    loss off by far more than the tolerance, and teacher scores whose top-k columns are shifted by one do not pass."""
    from dataclasses import replace

    from loss_by_hand import loss_by_hand

    trainer, prompts, rollouts, scores = moved_student
    objective = trainer.job.objective.model_copy(update=settings)
    assert objective.top_k == 8  # away from the default 100, as the teacher scored it
    with torch.no_grad():
        loss, stats = student_loss(trainer.student, prompts, rollouts, scores, objective)
    expected = loss_by_hand(trainer, prompts, rollouts, objective)
    assert expected > 1e-2 and 0 < stats.clipped < 1  # the clip binds on some tokens, not all
    assert float(loss) == pytest.approx(expected, rel=1e-5)
    defaults = type(objective).model_fields
    misread = [{name: defaults[name].default} for name in settings if settings[name] != defaults[name].default]
    misread += [{"importance_clip": float("inf")}] + ([{"alpha": 1 - objective.alpha}] if objective.divergence == "jsd" else [])
    for wrong in misread:
        with torch.no_grad():
            off, _ = student_loss(trainer.student, prompts, rollouts, scores, objective.model_copy(update=wrong))
        assert abs(float(off) - expected) > 1e-3 * expected, wrong  # 100 times the tolerance
    shifted = [replace(s, top_logp=s.top_logp.roll(1, dims=-1)) for s in scores]  # a column-order slip
    with torch.no_grad():
        wrong, _ = student_loss(trainer.student, prompts, rollouts, shifted, objective)
    assert float(wrong) != pytest.approx(expected, rel=1e-3)


@pytest.mark.parametrize("mode, packed", [("lt_opd", True), ("grpo", True), ("lt_opd", False)])
def test_a_learner_micro_batch_reads_nothing_back_from_the_device(updates, mode, packed):
    """The learner's micro-batch as its DeepSpeed module runs it (the student's forward on the replayed rollouts, the
    loss, its statistics, the backward) waits for the device nowhere in this package: the statistics stay on the
    device until the step reads them all at once (`LossStats.on_host`), the top-k union is built there, the replayed
    selection indexes with integer positions computed on the host, not with a mask."""
    from lt_opd_ray.models.loss import PolicyInputs

    trainer, prompts, rollouts, scores = updates["qwen3_5"]
    objective = trainer.job.objective.model_copy(update={"mode": mode})
    policy = PolicyInputs(torch.tensor([0.5, -0.5, 0.0] * 2), [None] * len(rollouts), torch.ones(len(rollouts))) if mode == "grpo" else None
    if mode == "grpo":
        scores = None
    with DeviceReads(trainer.student.model.parameters()) as reads:
        forward = student_forward(trainer.student, prompts, rollouts, packed)
        loss, stats = loss_on_forward(trainer.student, forward, rollouts, scores, objective, policy=policy)
        loss.backward()
    ours = [read for read in reads.seen if "lt_opd_ray/" in read[1]]
    print(f"\n{mode}: {len(reads.seen)} device reads in a micro-batch, {len(ours)} in this package: {sorted(set(reads.seen))}")
    assert ours == [], ours
    assert isinstance(stats.on_host().loss, float) and isinstance(stats.importance_weight, torch.Tensor)
