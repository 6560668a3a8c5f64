"""The toy board task, its trained teacher and the ablation through the distributed runtime."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from lt_opd_ray.config import BPS, load_job
from lt_opd_ray.toy.ablation import arm_job, retain_rows
from lt_opd_ray.toy.task import COLOURS, GRID, MAJORITY, QUESTION, TILE, TILES_PER_IMAGE, board_sample

BASE_JOB = "jobs/toy_board.yaml"


def test_boards_are_seeded_and_the_answer_is_the_colour_on_the_most_tiles():
    for index in range(20):
        sample, again = board_sample(index, seed=0), board_sample(index, seed=0)
        assert sample.question == again.question == QUESTION and sample.answer == again.answer
        assert np.array_equal(np.asarray(sample.image), np.asarray(again.image))
        tiles = np.asarray(sample.image).reshape(GRID, TILE, GRID, TILE, 3).transpose(0, 2, 1, 3, 4).reshape(GRID * GRID, -1, 3)
        counts = {name: 0 for name in COLOURS}
        for tile in tiles:
            present = [name for name, rgb in COLOURS.items() if (tile == rgb).all(-1).any()]
            assert len(present) <= 1  # one colour per tile (or background)
            for name in present:
                counts[name] += 1
        assert sum(counts.values()) == TILES_PER_IMAGE
        assert counts[sample.answer] == MAJORITY and all(n < MAJORITY for c, n in counts.items() if c != sample.answer)
    assert board_sample(0, 0, "train").image.tobytes() != board_sample(0, 0, "test").image.tobytes()


def test_arm_jobs_change_only_what_the_arm_is_about(tmp_path):
    base = load_job(BASE_JOB)
    lt_opd = arm_job(base, "lt_opd", 1, tmp_path)
    assert lt_opd.objective == base.objective and lt_opd.budget == base.budget and lt_opd.seed == 1
    assert arm_job(base, "sft", 0, tmp_path).objective.mode == "sft"
    assert arm_job(base, "fixed_prefix", 0, tmp_path).objective.mode == "fixed_prefix"
    assert arm_job(base, "lt_opd_reverse_kl", 0, tmp_path).objective.divergence == "reverse_kl"
    flat = arm_job(base, "lt_opd_no_curriculum", 0, tmp_path).budget
    assert flat.start_bps == flat.target_bps == base.budget.target_bps and flat.warm_steps == flat.decay_end == 0
    short = arm_job(base, "lt_opd", 0, tmp_path, steps=base.budget.total_steps // 2).budget
    assert short.total_steps == base.budget.total_steps // 2 and short.decay_end == round(base.budget.decay_end / 2)
    assert {arm_job(base, "lt_opd", s, tmp_path).checkpoint.dir for s in (0, 1)} == {str(tmp_path / "lt_opd" / "seed0"), str(tmp_path / "lt_opd" / "seed1")}


def test_retain_rows_average_over_seeds():
    results = {
        "selectors": ["cdpruner"],
        "trained_with": "divprune",
        "teacher": {"full": 0.8, "cdpruner": 0.4},
        "runs": [{"arm": "lt_opd", "final": {"cdpruner": 0.6}}, {"arm": "lt_opd", "final": {"cdpruner": 0.7}}],
    }
    untrained, trained = retain_rows(results)
    assert untrained["retain_mean"] == pytest.approx(0.5)
    assert (trained["trained_with"], trained["evaluated_with"]) == ("divprune", "cdpruner")
    assert trained["retain_mean"] == pytest.approx(0.8125) and trained["retain_std"] == pytest.approx(0.0884, abs=1e-4)


# ---------------------------------------------------------------- trained teacher (slow: trains it once)
@pytest.fixture(scope="module")
def teacher():
    from lt_opd_ray.data import load_samples
    from lt_opd_ray.models.adapter import QwenVLM
    from lt_opd_ray.models.loading import load_vlm
    from lt_opd_ray.models.processor import VLMProcessor

    job = load_job(BASE_JOB)
    model_dir, model = load_vlm(job.model.path, "cpu")  # trains the toy teacher on first use (cached)
    return job, model.eval(), VLMProcessor(model_dir), QwenVLM(model), load_samples(job.eval.data)


@pytest.mark.slow
def test_teacher_answers_at_full_tokens_and_drops_when_pruned(teacher):
    from lt_opd_ray.evaluation import evaluate_answers

    job, _, processor, vlm, samples = teacher
    full = evaluate_answers(vlm, processor, samples, BPS).accuracy
    pruned = evaluate_answers(vlm, processor, samples, job.budget.target_bps, "cdpruner", job.budget.k_min).accuracy
    assert full >= 0.9
    assert pruned <= full - 0.5


@pytest.mark.slow
@torch.no_grad()
def test_evaluation_at_full_tokens_agrees_with_transformers_generate(teacher):
    from lt_opd_ray.evaluation import evaluate_answers, parse_answer
    from lt_opd_ray.models.processor import question_messages

    _, model, processor, vlm, samples = teacher
    samples = samples[:24]
    ours = evaluate_answers(vlm, processor, samples, BPS)
    for sample, correct in zip(samples, ours.correct):
        prompt = processor.encode(question_messages(sample.question), [sample.image], sample.uid)
        out = model.generate(
            input_ids=prompt.input_ids[None], mm_token_type_ids=prompt.mm_token_type_ids[None],
            pixel_values=prompt.pixel_values, image_grid_thw=prompt.image_grid_thw,
            attention_mask=torch.ones(1, prompt.input_ids.numel(), dtype=torch.long),
            max_new_tokens=16, do_sample=False, stop_strings=["</answer>"], tokenizer=processor.tokenizer,
        )
        text = processor.tokenizer.decode(out[0, prompt.input_ids.numel() :], skip_special_tokens=True)
        assert correct == (parse_answer(text) == sample.answer)


@pytest.mark.slow
def test_reduced_ablation_lt_opd_beats_the_untrained_student(teacher, tmp_path):
    """CI's regression run: one seed, a shortened curriculum, LT-OPD only, through Ray + DeepSpeed + Serve."""
    from lt_opd_ray.toy.ablation import run_ablation

    results = run_ablation(BASE_JOB, str(tmp_path), seeds=[0], steps=REDUCED_STEPS, arms=["lt_opd"])
    untrained, _, lt_opd, _ = retain_rows(results)
    assert (untrained["arm"], lt_opd["arm"]) == ("untrained", "lt_opd")
    assert lt_opd["retain_mean"] >= untrained["retain_mean"] + RETAIN_MARGIN
    assert json.loads((tmp_path / "results.json").read_text())["runs"][0]["arm"] == "lt_opd"
    assert (tmp_path / "curves.png").stat().st_size > 0 and "LT-OPD" in (tmp_path / "retain_table.md").read_text()


REDUCED_STEPS = 20
# measured (lt-opd ablation --seeds 3 --steps 20 --arms lt_opd): untrained 0.023, LT-OPD 0.156 / 0.180 / 0.195
RETAIN_MARGIN = 0.1
