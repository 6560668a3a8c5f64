"""The toy tasks, their trained teachers and the ablation through the distributed runtime."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from lt_opd_ray.config.loading import load_job
from lt_opd_ray.core.curriculum import BPS
from lt_opd_ray.runtime.learner_group import free_port
from lt_opd_ray.sources.toy import board, circles, discs, sizes
from lt_opd_ray.sources.toy.base import TILE
from lt_opd_ray.sources.resolve import load_samples
from lt_opd_ray.sources.toy.tasks import toy_task
from lt_opd_ray.tools.ablation import arm_job
from lt_opd_ray.tools.ablation_report import retain_rows

BASE_JOB = "jobs/toy_circles.yaml"  # design 3, the study's


def test_boards_are_seeded_and_the_answer_is_the_colour_on_the_most_tiles():
    from lt_opd_ray.sources.toy.board import COLOURS, GRID, MAJORITY, QUESTION, TILES_PER_IMAGE

    for index in range(20):
        sample, again = board.TASK.item(index, seed=0).sample, board.TASK.item(index, seed=0).sample
        assert sample.question == again.question == QUESTION and sample.answer == again.answer
        assert np.array_equal(np.asarray(sample.images[0].read()), np.asarray(again.images[0].read()))
        tiles = np.asarray(sample.images[0].read()).reshape(GRID, TILE, GRID, TILE, 3).transpose(0, 2, 1, 3, 4).reshape(GRID * GRID, -1, 3)
        counts = {name: 0 for name in COLOURS}
        for tile in tiles:
            present = [name for name, rgb in COLOURS.items() if (tile == rgb).all(-1).any()]
            assert len(present) <= 1  # one colour per tile (or background)
            for name in present:
                counts[name] += 1
        assert sum(counts.values()) == TILES_PER_IMAGE
        assert counts[sample.answer] == MAJORITY and all(n < MAJORITY for c, n in counts.items() if c != sample.answer)
    assert board.TASK.item(0, 0, "train").sample.images[0].read().tobytes() != board.TASK.item(0, 0, "test").sample.images[0].read().tobytes()


def _nearest_colour(rgb: np.ndarray) -> str | None:
    """The task colour a shaded tile was drawn from (shading scales all channels alike), None for background."""
    if (rgb == sizes.BACKGROUND).all():
        return None
    direction = rgb / np.linalg.norm(rgb)
    return max(sizes.COLOURS, key=lambda name: direction @ (np.array(sizes.COLOURS[name]) / np.linalg.norm(sizes.COLOURS[name])))


def _nearest_colours(rgb: np.ndarray) -> np.ndarray:
    """`_nearest_colour` of each of [N, 3] non-background pixels at once (the largest cosine with a task colour)."""
    names = list(sizes.COLOURS)
    palette = np.array([sizes.COLOURS[n] for n in names], dtype=float)
    cosines = (rgb / np.linalg.norm(rgb, axis=1, keepdims=True)) @ (palette / np.linalg.norm(palette, axis=1, keepdims=True)).T
    return np.array(names)[cosines.argmax(axis=1)]


def test_sizes_items_answer_the_biggest_square_after_listing_colours_in_reading_order():
    for index in range(30):
        item, again = sizes.TASK.item(index, seed=0), sizes.TASK.item(index, seed=0)
        assert item == dataclasses.replace(again, sample=dataclasses.replace(again.sample, images=item.sample.images))
        assert np.array_equal(np.asarray(item.sample.images[0].read()), np.asarray(again.sample.images[0].read()))
        pixels = np.asarray(item.sample.images[0].read()).astype(float)
        tiles: dict[str, list[tuple[int, int]]] = {}
        for row in range(sizes.GRID):
            for col in range(sizes.GRID):
                block = pixels[row * TILE : (row + 1) * TILE, col * TILE : (col + 1) * TILE].reshape(-1, 3)
                assert (block == block[0]).all()  # one flat shade per tile
                colour = _nearest_colour(block[0])
                if colour:
                    tiles.setdefault(colour, []).append((row, col))
        assert sorted(len(t) for t in tiles.values()) == sorted(side * side for side in sizes.SIDES)
        biggest = max(tiles, key=lambda c: len(tiles[c]))
        reading_order = sorted(tiles, key=lambda c: min(tiles[c]))
        assert item.sample.answer == biggest and item.sample.question == sizes.QUESTION
        assert item.response == " ".join(reading_order) + f" <answer>{biggest}</answer>"
    assert sizes.TASK.item(0, 0, "train").sample.images[0].read().tobytes() != sizes.TASK.item(0, 0, "test").sample.images[0].read().tobytes()


def test_circles_items_answer_the_biggest_disc_after_listing_colours_in_reading_order():
    for index in range(30):
        item, again = circles.TASK.item(index, seed=0), circles.TASK.item(index, seed=0)
        assert item == dataclasses.replace(again, sample=dataclasses.replace(again.sample, images=item.sample.images))
        pixels = np.asarray(item.sample.images[0].read()).astype(float)
        assert np.array_equal(pixels, np.asarray(again.sample.images[0].read()))
        rows, cols = np.indices(pixels.shape[:2])
        on = ~(pixels == circles.BACKGROUND).all(-1)
        colour_of = _nearest_colours(pixels[on])
        discs = {}  # colour -> (radius in tiles from the area, centroid row, centroid col)
        for colour in set(colour_of):
            mask = colour_of == colour
            discs[colour] = ((mask.sum() / np.pi) ** 0.5 / TILE, rows[on][mask].mean(), cols[on][mask].mean())
        assert len(discs) == len(circles.RADII)
        for (low, high), radius in zip(circles.RADII, sorted(r for r, _, _ in discs.values())):
            assert low - 0.05 <= radius <= high + 0.05  # one disc per band (the area of a pixelated disc, to ~1%)
        biggest = max(discs, key=lambda c: discs[c][0])
        assert item.sample.answer == biggest and item.sample.question == circles.QUESTION
        listed = item.response.removesuffix(f" <answer>{biggest}</answer>").split()
        centre_rows = [discs[c][1] for c in listed]
        assert sorted(listed) == sorted(discs) and all(a <= b + 1.0 for a, b in zip(centre_rows, centre_rows[1:]))  # reading order
    assert circles.TASK.item(0, 0, "train").sample.images[0].read().tobytes() != circles.TASK.item(0, 0, "test").sample.images[0].read().tobytes()


def painted_whole_image(item) -> bytes:
    """The discs' board by whole-image masks (no bounding boxes): each pixel centre inside a disc takes its colour
    (a later disc over an earlier one), then the disc pixels times their tile's factor in float32, capped at 255."""
    from lt_opd_ray.sources.toy.base import BACKGROUND, COLOURS

    size = circles.IMAGE_SIZE
    ys, xs = (np.mgrid[0:size, 0:size] + 0.5) / TILE
    pixels = np.empty((size, size, 3), dtype=np.float32)
    pixels[:] = BACKGROUND
    on_disc = np.zeros((size, size), dtype=bool)
    for colour, (x, y, radius) in zip(item.colours, item.discs):
        inside = (xs - x) ** 2 + (ys - y) ** 2 <= radius**2
        pixels[inside], on_disc = COLOURS[colour], on_disc | inside
    factor = np.kron(np.array(item.shade, dtype=np.float32), np.ones((TILE, TILE), dtype=np.float32))
    pixels[on_disc] = np.minimum(pixels[on_disc] * factor[on_disc][:, None], 255.0)
    return pixels.astype(np.uint8).tobytes()


def test_the_painted_boards_are_the_whole_image_masks_byte_for_byte():
    layouts = [circles.layout(i, seed, split) for i in range(8) for seed in (0, 3) for split in ("train", "test")]
    layouts += [discs.layout(i, 0, split) for i in range(8) for split in ("train", "teacher", "test")]
    for item in layouts:
        assert np.asarray(circles.paint(item)).tobytes() == painted_whole_image(item), item


def test_discs_items_answer_their_kind_of_question_as_the_pixels_do():
    """Each kind's answer from the drawn pixels alone: the colour with the most (fewest) pixels, the one whose pixels
    reach the highest row (the lowest column). Close items are close, clear ones clearly apart; the training rows
    never ask "left", the held-out ones ask all four kinds in turn."""
    from collections import Counter

    for split, kinds in (("train", discs.TRAINING_KINDS), ("test", tuple(discs.KINDS))):
        items = discs.TASK.items(48, split)
        assert [discs.TASK.kind_of(i.sample) for i in items] == [kinds[i % len(kinds)] for i in range(48)]
        closes = 0
        for index, item in enumerate(items):
            kind, layout = kinds[index % len(kinds)], discs.layout(index, 0, split)
            pixels = np.asarray(item.sample.images[0].read()).astype(float)
            rows, cols = np.indices(pixels.shape[:2])
            on = ~(pixels == circles.BACKGROUND).all(-1)
            colour_of = _nearest_colours(pixels[on])
            area = Counter(colour_of.tolist())
            first_row = {c: rows[on][colour_of == c].min() for c in area}
            first_col = {c: cols[on][colour_of == c].min() for c in area}
            by_pixels = {"biggest": max(area, key=area.get), "smallest": min(area, key=area.get),
                         "top": min(first_row, key=first_row.get), "left": min(first_col, key=first_col.get)}[kind]
            assert item.sample.answer == by_pixels and item.sample.question == discs.KINDS[kind][0], (split, index, kind)
            assert item.sample.response == f"{discs.KINDS[kind][1]} {by_pixels}. <answer>{by_pixels}</answer>"
            assert item.response.endswith(f"<answer>{by_pixels}</answer>") and item.response != item.sample.response
            radii = sorted(r for _, _, r in layout.discs)
            compared = {"biggest": radii[2] / radii[1], "smallest": radii[1] / radii[0]}.get(kind)
            if compared is not None:
                assert (compared <= discs.CLOSE_RADII[1] + 1e-9) == layout.close, (compared, layout.close)
            else:
                gap = discs._edges_gap(list(layout.discs), kind)
                assert discs.CLOSE_EDGES[0] < gap < discs.CLOSE_EDGES[1] if layout.close else gap > discs.APART_EDGES
            closes += layout.close
        assert 8 <= closes <= 24  # about a third of 48


@pytest.mark.parametrize(("task", "accuracy"), [("circles", (0.95, 1.0)), ("discs", (0.75, 0.92))])
def test_the_shipped_teachers_were_trained_by_their_recipes_on_this_task_code(task, accuracy):
    """Editing a task's module or its recipe without shipping a new teacher (`python -m lt_opd_ray.sources.toy.teacher
    --ship <task>`) would silently train one on first use instead: this fails first. The discs teacher is good, not
    an oracle (its record: 128 held-out items; 0.840 on the study's 512)."""
    from lt_opd_ray.sources.resolve import resolve_model_dir
    from lt_opd_ray.sources.toy.teacher import RECIPES, SHIPPED, shipped_teacher

    assert shipped_teacher(RECIPES[task]) == SHIPPED / task == resolve_model_dir(f"toy:{task}")
    record = json.loads((SHIPPED / task / "training.json").read_text())
    assert accuracy[0] <= record["full_token_accuracy"] <= accuracy[1] and record["recipe"]["task"] == task
    changed = dataclasses.replace(RECIPES[task], steps=RECIPES[task].steps + 1)
    assert shipped_teacher(changed) is None


def test_toy_rows_are_drawn_when_read_so_a_data_set_is_small_until_used():
    """2048 rows cost a few numbers each until an engine reads an image; what is read is what the task draws."""
    import pickle

    from lt_opd_ray.models.processor import load_image

    rows = load_samples("toy-circles:2048")
    assert len(pickle.dumps(rows)) < 2048 * 400, "a row pickles as where to draw it from, not its 300 KB of pixels"
    assert np.array_equal(np.asarray(load_image(rows[7].images[0])), np.asarray(circles.draw(7, 0, "train")))


def test_toy_data_specs_name_the_task_and_the_split():
    from lt_opd_ray.core.errors import InputError

    assert [s.uid for s in load_samples("toy-sizes-test:3")] == [f"sizes-test-0-{i}" for i in range(3)]
    assert load_samples("toy-board:2")[1].uid == "board-train-0-1"
    with pytest.raises(InputError, match="unknown toy task 'shapes'; known: board, sizes, circles, discs"):
        load_samples("toy-shapes:4")
    assert toy_task("sizes").image_size == sizes.GRID * TILE


def test_toy_rows_carry_a_written_response_that_answers_and_fits_the_tasks_response_tokens():
    """What the paper's baselines train on: correct, within a response's token bound, and (where the bound leaves room)
    in other words than the teacher's."""
    from lt_opd_ray.core.answers import parse_answer
    from lt_opd_ray.models.tiny import build_tokenizer

    tokenizer = build_tokenizer()  # the toy teachers' tokenizer
    for name in ("board", "sizes", "circles", "discs"):
        task = toy_task(name)
        for item in task.items(64):
            written = item.sample.response
            assert parse_answer(written) == item.sample.answer, (name, written)
            assert len(tokenizer(written, add_special_tokens=False)["input_ids"]) <= task.response_tokens, (name, written)
            assert (written == item.response) == (name == "board"), (name, written, item.response)


def test_arm_jobs_change_only_what_the_arm_is_about(tmp_path):
    base = load_job(BASE_JOB)
    lt_opd = arm_job(base, "lt_opd", 1, tmp_path)
    assert lt_opd.objective == base.objective and lt_opd.budget == base.budget and lt_opd.seed == 1
    for arm, prefixes, n in (("sft", "dataset", 1), ("fixed_prefix", "dataset", 1), ("sequence_kd", "teacher", base.sampling.n),
                             ("teacher_prefix", "teacher", base.sampling.n)):
        job = arm_job(base, arm, 0, tmp_path)
        assert (job.objective.mode, job.objective.prefixes, job.sampling.n) == (arm, prefixes, n)
    assert arm_job(base, "sft", 0, tmp_path).objective.cross_entropy and not arm_job(base, "fixed_prefix", 0, tmp_path).objective.cross_entropy
    assert arm_job(base, "lt_opd_reverse_kl", 0, tmp_path).objective.divergence == "reverse_kl"
    assert arm_job(base, "lt_opd_token_merge", 0, tmp_path).selector.merge == "learnable"
    flat = arm_job(base, "lt_opd_no_curriculum", 0, tmp_path).budget
    assert flat.start_bps == flat.target_bps == base.budget.target_bps and flat.warm_steps == flat.decay_end == 0
    no_hold = arm_job(base, "lt_opd_no_hold", 0, tmp_path).budget  # the decay ends at the last update: no plateau at the target
    assert no_hold.model_copy(update={"decay_end": base.budget.decay_end}) == base.budget and no_hold.decay_end == base.budget.total_steps - 1
    from lt_opd_ray.core.curriculum import BudgetSchedule

    schedule = BudgetSchedule.from_config(no_hold)
    assert schedule.budget_bps(no_hold.total_steps - 1) == no_hold.target_bps < schedule.budget_bps(base.budget.decay_end)  # no plateau
    for arm in ("grpo", "dapo", "gspo"):  # the same rollouts, curriculum and sampling; a reward instead of a teacher
        job = arm_job(base, arm, 0, tmp_path)
        assert (job.objective.mode, job.reward.name, job.budget, job.sampling) == (arm, "answer", base.budget, base.sampling)
        assert job.objective.policy_gradient and not job.objective.teacher_scores
        assert job.reward.overlong_buffer == (round(0.2 * base.sampling.max_new_tokens) if arm == "dapo" else 0)
        assert job.reward.dynamic_sampling_rounds == (3 if arm == "dapo" else 0)  # DAPO's flat groups given to drawn rows
        assert job.optimizer.steps_per_update == 4 and job.optimizer.model_copy(update={"steps_per_update": 1}) == base.optimizer  # PPO's mini-batches
    assert arm_job(base.model_copy(update={"sampling": base.sampling.model_copy(update={"prompts_per_step": 2})}), "grpo", 0,
                   tmp_path).optimizer.steps_per_update == 2  # a prompt per mini-batch at least
    oracle = arm_job(base, "oracle_sft", 0, tmp_path)  # the bound: SFT on the true labels, in the teacher's format
    assert (oracle.objective.mode, oracle.sampling.n, oracle.data.path, oracle.budget) == ("sft", 1, base.data.path.replace(":", "-reference:"), base.budget)
    truth, written = load_samples("toy-discs-reference:4"), load_samples("toy-discs:4")
    assert [s.uid for s in truth] == [s.uid for s in written] and all(s.response != w.response for s, w in zip(truth, written))
    assert all(s.response.endswith(f"<answer>{s.answer}</answer>") and s.response == toy_task("discs").item(i).response for i, s in enumerate(truth))
    with pytest.raises(ValueError, match="names no toy task's training rows"):
        arm_job(base.model_copy(update={"data": base.data.model_copy(update={"path": "synthetic:64"})}), "oracle_sft", 0, tmp_path)
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
    assert trained["retain_se"] == pytest.approx(0.0884 / 2**0.5, abs=1e-4) and untrained["retain_se"] == 0.0  # no item count
    results["eval_items"] = 100
    assert retain_rows(results)[0]["retain_se"] == pytest.approx((0.4 * 0.6 / 100) ** 0.5 / 0.8)


def test_each_arm_is_a_share_of_the_gap_the_oracle_bound_recovers():
    from lt_opd_ray.tools.ablation_report import gap_share_lines

    results = {"selectors": ["cdpruner"], "trained_with": "cdpruner", "teacher": {"full": 0.8, "cdpruner": 0.4},
               "runs": [{"arm": "lt_opd", "final": {"cdpruner": 0.5}}, {"arm": "oracle_sft", "final": {"cdpruner": 0.72}},
                        {"arm": "grpo", "final": {"cdpruner": 0.368}}]}
    lines = gap_share_lines(retain_rows(results), "cdpruner")  # retain: untrained 0.5, LT-OPD 0.625, bound 0.9, GRPO 0.46
    assert lines[-2:] == ["- LT-OPD: +31%", "- GRPO (answer reward): -10%"]  # 0.125 / 0.4, -0.04 / 0.4
    results["runs"][1]["final"]["cdpruner"] = 0.4  # the oracle no better than the untrained student: no shares
    assert gap_share_lines(retain_rows(results), "cdpruner")[-1].startswith("SFT on the true labels (oracle) is not above the untrained")
    results["runs"][1]["final"]["cdpruner"] = 0.72
    assert "(one seed, the gap not weighed)" in gap_share_lines(retain_rows(results), "cdpruner")[1]  # one run each: no SE
    results["runs"] = results["runs"][:1] + results["runs"][2:]
    assert gap_share_lines(retain_rows(results), "cdpruner") == []  # no oracle, no share


def test_a_study_cut_short_keeps_its_finished_runs_and_says_so(tmp_path):
    import time

    from lt_opd_ray.tools.ablation import save_results

    curve = [{"step": 1, "budget_bps": 500, "loss": 0.1, "divergence": 0.1, "eval": {"cdpruner": 0.5}}]
    results = {"base_job": "jobs/toy_sizes.yaml", "seeds": [0, 1], "steps": 1, "budget_bps": 500, "selectors": ["cdpruner"],
               "trained_with": "cdpruner", "teacher": {"full": 1.0, "cdpruner": 0.4}, "eval_items": 512,
               "runs": [{"arm": "lt_opd", "seed": 0, "seconds": 1.0, "final": {"cdpruner": 0.5}, "curve": curve}],
               "seconds": 0.0, "complete": False}
    save_results(results, tmp_path, time.perf_counter())
    assert json.loads((tmp_path / "results.json").read_text())["runs"] == results["runs"]
    assert "PARTIAL" in (tmp_path / "retain_table.md").read_text() and not (tmp_path / "results.json.tmp").exists()
    results["complete"] = True
    save_results(results, tmp_path, time.perf_counter())
    assert "PARTIAL" not in (tmp_path / "retain_table.md").read_text()


def test_the_study_evaluates_by_kind_of_question_where_the_held_out_rows_ask_several():
    from lt_opd_ray.tools.ablation import eval_sets

    by_kind = eval_sets(load_job("jobs/toy_discs.yaml"))
    assert {kind: len(rows) for kind, rows in by_kind.items()} == {kind: 128 for kind in discs.KINDS}
    assert all(row.question == discs.KINDS[kind][0] for kind, rows in by_kind.items() for row in rows)
    assert list(eval_sets(load_job(BASE_JOB))) == ["all"]  # circles asks one kind


def test_retain_by_kind_averages_each_kinds_retain_as_the_paper_averages_benchmarks(tmp_path):
    from lt_opd_ray.tools.ablation_report import kind_rows, write_report

    def run(seed, a, b):
        return {"arm": "lt_opd", "seed": seed, "final": {"cdpruner": 0.0}, "final_by_kind": {"a": {"cdpruner": a}, "b": {"cdpruner": b}},
                "curve": [{"step": 1, "loss": 1.0, "eval": {"cdpruner": 0.5}}]}

    results = {"base_job": "jobs/toy_discs.yaml", "seeds": [0, 1], "steps": 1, "budget_bps": 500, "selectors": ["cdpruner"],
               "trained_with": "cdpruner", "teacher": {"full": 0.9, "cdpruner": 0.6}, "eval_items": 200, "seconds": 60.0,
               "teacher_by_kind": {"a": {"full": 0.8, "cdpruner": 0.4}, "b": {"full": 1.0, "cdpruner": 0.8}}, "kind_items": {"a": 100, "b": 100},
               "runs": [run(0, 0.6, 0.9), run(1, 0.64, 0.86)]}
    untrained, trained = kind_rows(results)
    assert untrained["by_kind"] == pytest.approx({"a": 0.5, "b": 0.8}) and untrained["retain_mean"] == pytest.approx(0.65)
    assert untrained["retain_se"] == pytest.approx(((0.4 * 0.6 / 100 / 0.64 + 0.8 * 0.2 / 100) / 4) ** 0.5)
    assert trained["by_kind"] == pytest.approx({"a": 0.775, "b": 0.88})  # (0.75 + 0.8) / 2, (0.9 + 0.86) / 2
    assert trained["retain_mean"] == pytest.approx(0.8275) and trained["retain_se"] == pytest.approx(0.0025)  # seeds 0.825, 0.83
    write_report(results, tmp_path)
    table = (tmp_path / "retain_table.md").read_text()
    assert "| LT-OPD | cdpruner | 0.775 | 0.880 | 0.827 ± 0.003 (0.004) |" in table and "ordering on the mean over kinds" in table
    assert "- untrained < LT-OPD: difference +0.177 ± 0.037 (SE): holds" in table


def test_the_ordering_report_weighs_each_step_against_its_standard_error():
    from lt_opd_ray.tools.ablation_report import ordering_lines

    def row(arm, mean, se):
        return {"arm": arm, "evaluated_with": "cdpruner", "retain_mean": mean, "retain_se": se}

    rows = [row("untrained", 0.40, 0.02), row("sft", 0.50, 0.03), row("fixed_prefix", 0.52, 0.03),
            row("lt_opd_no_curriculum", 0.70, 0.01), row("lt_opd", 0.69, 0.01)]
    lines = ordering_lines(rows + [dict(row("sft", 0.9, 0.0), evaluated_with="divprune")], "cdpruner")
    assert [line.rsplit(": ", 1)[1] for line in lines] == ["holds", "does not hold", "holds", "holds"]
    assert lines[0] == "- untrained < SFT on the data's responses: difference +0.100 ± 0.036 (SE): holds"
    assert lines[3].startswith("- LT-OPD, no curriculum <= LT-OPD: difference -0.010")
    assert len(ordering_lines([r for r in rows if r["arm"] != "sft"], "cdpruner")) == 3  # a missing arm is skipped
    assert ordering_lines([rows[0], rows[4]], "cdpruner")[0].startswith("- untrained < LT-OPD: difference +0.290")
    one_run = dict(rows[4], seeds=1)  # a trained arm from one run has no standard error: weighed by nothing
    assert ordering_lines([rows[0], one_run], "cdpruner") == ["- untrained < LT-OPD: difference +0.290, one seed: not weighed"]


def test_the_arms_the_paper_puts_below_lt_opd_are_weighed_against_their_standard_error():
    from lt_opd_ray.tools.ablation_report import below_lt_opd_lines

    def row(arm, mean, se):
        return {"arm": arm, "evaluated_with": "cdpruner", "retain_mean": mean, "retain_se": se}

    rows = [row("untrained", 0.5, 0.02), row("lt_opd", 0.75, 0.0625), row("grpo", 0.5, 0.0), row("gspo", 0.6875, 0.0),
            row("dapo", 0.875, 0.0), row("lt_opd_no_hold", 0.625, 0.0625), row("sft", 0.1, 0.0)]  # binary fractions: exact d and SE
    lines = below_lt_opd_lines(rows, "cdpruner")
    assert lines[-4:] == ["- GRPO (answer reward) < LT-OPD: d = +0.250 ± 0.062 (SE): shown",
                          "- DAPO (answer reward) < LT-OPD: d = -0.125 ± 0.062 (SE): not shown",  # exactly -2 SE: not beyond it
                          "- GSPO (answer reward) < LT-OPD: d = +0.062 ± 0.062 (SE): not shown",
                          "- LT-OPD, no final plateau < LT-OPD: d = +0.125 ± 0.088 (SE): not shown"]
    rows[2]["retain_mean"], rows[3]["retain_mean"], rows[4]["retain_mean"] = 0.625, 0.625 - 2**-20, 0.875 + 2**-20  # GRPO, GSPO, DAPO
    assert [line.rsplit(": ", 1)[1] for line in below_lt_opd_lines(rows, "cdpruner")[-4:-1]] == ["not shown", "reversed", "shown"]
    assert below_lt_opd_lines(rows, "cdpruner")[-4].endswith("d = +0.125 ± 0.062 (SE): not shown")  # exactly 2 SE: not above it
    assert below_lt_opd_lines([r for r in rows if r["arm"] != "lt_opd"], "cdpruner") == []  # nothing to weigh against
    rows[2]["seeds"] = 1  # GRPO from one run: no standard error, no verdict (its SE of 0 would make any d "shown")
    assert below_lt_opd_lines(rows, "cdpruner")[-4] == "- GRPO (answer reward) < LT-OPD: d = +0.125, one seed: not weighed"
    assert below_lt_opd_lines(rows[:2], "cdpruner") == [] and below_lt_opd_lines(rows, "divprune") == []


def test_a_curve_is_flat_when_its_last_two_evaluations_are_within_2_se_of_the_two_before():
    from lt_opd_ray.tools.ablation_report import flatness, flatness_lines

    def run(arm, seed, evals):  # evaluated every 20 updates, as the study's job; updates between carry no evaluation
        curve = [{"step": step, "loss": 0.1, "eval": {}} for step in range(1, 21 * len(evals))]
        for n, accuracy in enumerate(evals):
            curve[20 * (n + 1) - 1]["eval"] = {"cdpruner": accuracy}
        return {"arm": arm, "seed": seed, "curve": curve}

    rising = [[0.1, 0.40, 0.42, 0.48, 0.50], [0.1, 0.41, 0.41, 0.47, 0.51], [0.1, 0.40, 0.43, 0.49, 0.48]]
    level = [[0.1, 0.50, 0.48, 0.52, 0.47], [0.1, 0.45, 0.50, 0.46, 0.50], [0.1, 0.49, 0.47, 0.46, 0.47]]
    results = {"teacher": {"full": 0.8}, "runs": [run("lt_opd", s, e) for s, e in enumerate(rising)] + [run("grpo", s, e) for s, e in enumerate(level)]}
    for arm, seeds in (("lt_opd", rising), ("grpo", level)):  # brute force: each seed's difference, its mean and SE
        d = [((e[3] + e[4]) - (e[1] + e[2])) / 2 / 0.8 for e in seeds]
        mean = sum(d) / 3
        se = (sum((x - mean) ** 2 for x in d) / 2) ** 0.5 / 3**0.5
        weighed = flatness(results, arm, "cdpruner")
        assert weighed["d"] == pytest.approx(mean) and weighed["se"] == pytest.approx(se) and weighed["steps"] == [40, 60, 80, 100]
        assert weighed["flat"] == (abs(mean) <= 2 * se)
    assert not flatness(results, "lt_opd", "cdpruner")["flat"] and flatness(results, "grpo", "cdpruner")["flat"]
    lines = flatness_lines(results, "cdpruner")
    assert "updates 80 and 100 minus the mean at 40 and 60" in lines[1] and lines[-1] == "Not flat: LT-OPD."
    results["runs"] = results["runs"][:1] + results["runs"][3:]  # one LT-OPD seed: no standard error, no verdict for it
    assert flatness(results, "lt_opd", "cdpruner") is None and flatness_lines(results, "cdpruner")[-1] == "Every arm's curve is flat."


# ---------------------------------------------------------------- trained teacher (slow: trains it once)
@pytest.fixture(scope="module")
def study_cluster():
    """One local Ray cluster for the module's studies (run_ablation uses a session that is up; it starts and stops
    its own otherwise), as `lt-opd ablation` starts it for the study's job, and the pools its studies' runs keep for
    the next study's (`run_ablation(roles=...)`; a run on kept pools computes what it would on new ones:
    test_runtime.py)."""
    import ray
    from ray import serve

    from lt_opd_ray.runtime.kept_roles import KeptRoles
    from lt_opd_ray.runtime.launch import init_ray

    job = load_job(BASE_JOB)
    init_ray(job.model_copy(update={"metrics": job.metrics.model_copy(update={"export_port": STUDY_METRICS_PORT})}))
    roles = KeptRoles()
    try:
        yield roles
    finally:
        try:
            roles.close()
        finally:
            serve.shutdown()
            ray.shutdown()


STUDY_METRICS_PORT = free_port()  # not the port of a study running on this machine (8091), nor any other taken one


@pytest.fixture(scope="module")
def teacher():
    from lt_opd_ray.models.adapter import QwenVLM
    from lt_opd_ray.models.loading import load_vlm
    from lt_opd_ray.models.processor import VLMProcessor
    from lt_opd_ray.sources.resolve import load_samples, resolve_model_dir

    job = load_job(BASE_JOB)
    model_dir, model = load_vlm(resolve_model_dir(job.model.path), "cpu")  # trains the toy teacher on first use (cached)
    return job, model.eval(), VLMProcessor(model_dir), QwenVLM(model), load_samples(job.eval.data)


@pytest.mark.slow
def test_teacher_is_right_at_full_tokens_and_pruning_hurts_but_leaves_much(teacher):
    """The regime the toy exists for (the paper's: at 5% an untrained student keeps 68.6%)."""
    from lt_opd_ray.models.evaluation import evaluate_answers

    job, _, processor, vlm, samples = teacher
    settings = dict(k_min=job.budget.k_min, max_new_tokens=job.eval.max_new_tokens)
    full = evaluate_answers(vlm, processor, samples, BPS, **settings).accuracy
    assert full >= 0.95
    for selector in job.eval.selectors:
        retain = evaluate_answers(vlm, processor, samples, job.budget.target_bps, selector, **settings).accuracy / full
        assert 0.35 <= retain <= 0.75, selector


@pytest.mark.slow
@torch.no_grad()
def test_evaluation_at_full_tokens_agrees_with_transformers_generate(teacher):
    from lt_opd_ray.core.answers import parse_answer
    from lt_opd_ray.models.evaluation import evaluate_answers
    from lt_opd_ray.models.processor import question_messages

    _, model, processor, vlm, samples = teacher
    samples = samples[:24]
    ours = evaluate_answers(vlm, processor, samples, BPS)
    for sample, correct in zip(samples, ours.correct):
        prompt = processor.encode(question_messages(sample.question), list(sample.images), sample.uid)
        out = model.generate(
            input_ids=prompt.input_ids[None], mm_token_type_ids=prompt.mm_token_type_ids[None],
            pixel_values=prompt.pixel_values, image_grid_thw=prompt.image_grid_thw,
            attention_mask=torch.ones(1, prompt.input_ids.numel(), dtype=torch.long),
            max_new_tokens=16, do_sample=False, stop_strings=["</answer>"], tokenizer=processor.tokenizer,
        )
        text = processor.tokenizer.decode(out[0, prompt.input_ids.numel() :], skip_special_tokens=True)
        assert correct == (parse_answer(text) == sample.answer)


@pytest.mark.slow
def test_the_study_trains_each_arm_through_the_real_system_and_writes_its_report(teacher, study_cluster, tmp_path, monkeypatch):
    """Two arms, two updates each, through Ray + DeepSpeed + Serve, the second added by a resume (a study cut short,
    then run on: the finished run is kept as it was, only the missing one trains): every finished run's curve, the
    table and the figure are written. Whether training recovers what pruning loses is the first run's test
    (test_main_job.py) and the study's (docs/ablation/README.md)."""
    from lt_opd_ray.tools import ablation
    from lt_opd_ray.tools.ablation import run_ablation

    def refuse_to_evaluate(*args, **kwargs):
        raise AssertionError("evaluated before the resume was checked")

    base = tmp_path / "toy_circles.yaml"  # the study's job, evaluated on 64 held-out items instead of 512 (for time)
    base.write_text(Path(BASE_JOB).read_text().replace("data: toy-circles-test:512", "data: toy-circles-test:64")
                    .replace("export_port: 8091", f"export_port: {STUDY_METRICS_PORT}"))  # not the port of a study running on this machine
    study = tmp_path / "study"  # a new study's --out is new or empty
    first = run_ablation(str(base), str(study), seeds=[0], steps=2, arms=["sft"], roles=study_cluster)
    saved = json.loads((study / "results.json").read_text())
    assert saved["complete"] and [(r["arm"], r["seed"]) for r in saved["runs"]] == [("sft", 0)]
    assert saved["teacher"]["full"] == first["teacher"]["full"] >= 0.95 and saved["eval_items"] == 64
    with monkeypatch.context() as patched, pytest.raises(ValueError, match=r"another study \(steps 2 \(now 3\)\)"):
        patched.setattr(ablation, "evaluate", refuse_to_evaluate)  # refused before the teacher is evaluated
        run_ablation(str(base), str(study), seeds=[0], steps=3, arms=["sft", "lt_opd"], resume=True, roles=study_cluster)
    resumed = run_ablation(str(base), str(study), seeds=[0], steps=2, arms=["sft", "lt_opd"], resume=True, roles=study_cluster)
    final = json.loads((study / "results.json").read_text())
    assert resumed["runs"][:1] == saved["runs"] and [(r["arm"], r["seed"]) for r in final["runs"]] == [("sft", 0), ("lt_opd", 0)]
    assert resumed["seconds"] > saved["seconds"] and final["complete"]
    assert all([p["step"] for p in r["curve"]] == [1, 2] and set(r["final"]) == {"cdpruner", "divprune"} for r in final["runs"])
    assert [r["arm"] for r in retain_rows(final)] == ["untrained", "untrained", "sft", "sft", "lt_opd", "lt_opd"]
    assert (study / "curves.png").stat().st_size > 0 and "LT-OPD" in (study / "retain_table.md").read_text()


def test_each_arm_trains_at_the_learning_rates_its_validation_rows_chose(teacher, study_cluster, tmp_path):
    """`lr_scales`: the arm trains once per scale (its own seed, not a study seed), each student scored on the toy
    task's validation rows (a split apart from the training and held-out rows); the study's seed trains at the scale
    that scored highest, and the report's table shows every score and the choice."""
    from lt_opd_ray.sources.resolve import load_samples
    from lt_opd_ray.config.loading import load_job
    import ray

    from lt_opd_ray.tools.ablation import TUNING_SEED, arm_job, run_ablation

    base = tmp_path / "toy_circles.yaml"
    base.write_text(Path(BASE_JOB).read_text().replace("data: toy-circles-test:512", "data: toy-circles-test:16")
                    .replace("prompts_per_step: 16", "prompts_per_step: 4").replace("export_port: 8091", f"export_port: {STUDY_METRICS_PORT}"))
    with pytest.raises(ValueError, match=r"--lr-scales 1.0 1.0: distinct positive scales"):
        run_ablation(str(base), str(tmp_path / "refused"), seeds=[0], steps=1, arms=["sft"], lr_scales=[1.0, 1.0], roles=study_cluster)
    rows = tmp_path / "rows.yaml"  # held-out rows that are not a toy task's: no validation split to choose on
    rows.write_text(base.read_text().replace("data: toy-circles-test:16", "data: synthetic:16"))
    with pytest.raises(ValueError, match=r"eval.data 'synthetic:16' is not a toy task's rows"):
        run_ablation(str(rows), str(tmp_path / "refused"), seeds=[0], steps=1, arms=["sft"], lr_scales=[1.0], roles=study_cluster)
    assert not (tmp_path / "refused").exists()  # refused before anything was written
    with pytest.raises(ValueError, match=r"--rl-variants are tried at each RL arm's learning rates chosen on validation rows"):
        run_ablation(str(base), str(tmp_path / "refused"), seeds=[0], steps=1, arms=["grpo"], rl_variants=["2x_clip"], roles=study_cluster)
    with pytest.raises(ValueError, match=r"--rl-variants 2x_clip 3x_clip: distinct names of 2x_group, 0.5x_clip, 2x_clip"):
        run_ablation(str(base), str(tmp_path / "refused"), seeds=[0], steps=1, arms=["grpo"], lr_scales=[1.0], rl_variants=["2x_clip", "3x_clip"], roles=study_cluster)
    grid = run_ablation(str(base), str(tmp_path / "study"), seeds=[], steps=1, arms=["grpo"], lr_scales=[3.0], roles=study_cluster)
    assert grid["complete"] and "grid_ends" not in grid and ray.is_initialized()  # one scale has no end; the module's Ray stays up
    # the grid extended on resume (its chosen scale was an end of it), and an RL variant added, before any seed
    # trained: 3.0's run is kept (the study's variants, RL_VARIANTS, test_the_rl_arms_variants_...)
    # of two scales the chosen one is an end of the grid where it scores above the other (the stop: the next test)
    study = run_ablation(str(base), str(tmp_path / "study"), seeds=[0], steps=1, arms=["grpo"], lr_scales=[0.1, 3.0], resume=True,
                         rl_variants=["2x_group"], accept_grid_ends=True, roles=study_cluster)
    assert study["tuning_runs"][0] == grid["tuning_runs"][0] and [r["lr_scale"] for r in study["tuning_runs"]][:2] == [3.0, 0.1]
    assert study["seconds"] > grid["seconds"] + study["tuning_runs"][1]["seconds"] and study["complete"] and ray.is_initialized()
    with pytest.raises(ValueError, match=r"another study \(lr_scales \[0.1, 3.0\] \(now \[0.1, 0.3, 3.0\]\) after its seeds trained"):
        run_ablation(str(base), str(tmp_path / "study"), seeds=[0], steps=1, arms=["grpo"], lr_scales=[0.1, 0.3, 3.0], resume=True,
                     rl_variants=["2x_group"], roles=study_cluster)
    assert study["validation"]["rows"] == "toy-circles-validation:16"
    validation, held_out = (load_samples(f"toy-circles-{split}:16") for split in ("validation", "test"))
    assert not {s.uid for s in validation} & {s.uid for s in held_out} and all("-validation-" in s.uid for s in validation)
    tuned = {r["lr_scale"]: r["retain"] for r in study["tuning_runs"] if r["variant"] is None}
    assert sorted(tuned) == [0.1, 3.0] and all(0 <= r <= 1.5 for r in tuned.values())
    chosen = max(tuned, key=lambda scale: (tuned[scale], -[0.1, 3.0].index(scale)))
    varied = {r["variant"]: r["retain"] for r in study["tuning_runs"] if r["lr_scale"] == chosen}  # its own settings and each variant
    assert list(varied) == [None, "2x_group"] and len(study["tuning_runs"]) == 3
    variant = max(varied, key=lambda v: (varied[v], -list(varied).index(v)))
    assert (study["chosen_lr_scale"], study["chosen_variant"]) == ({"grpo": chosen}, {"grpo": variant})
    assert [(r["lr_scale"], r["variant"]) for r in study["runs"]] == [(chosen, variant)]
    assert (tmp_path / "study" / "tuning" / "lr0.1" / "grpo" / f"seed{TUNING_SEED}" / "final").is_dir()
    assert (tmp_path / "study" / "tuning" / f"lr{chosen:g}-2x_group" / "grpo" / f"seed{TUNING_SEED}" / "final").is_dir()
    table = (tmp_path / "study" / "retain_table.md").read_text()
    assert f"| GRPO (answer reward) | {tuned[0.1]:.3f} | {tuned[3.0]:.3f} | {chosen}x |" in table
    assert (f"| GRPO (answer reward) | {chosen:g}x | " + " | ".join(f"{varied[v]:.3f}" for v in varied) + f" | {variant or 'its own'} |") in table
    # a longer run of the same arm trains at the study's choices and tunes nothing again
    with pytest.raises(ValueError, match=r"no learning rates chosen on validation rows for sft"):
        run_ablation(str(base), str(tmp_path / "refused"), seeds=[0], steps=2, arms=["grpo", "sft"], choices_from=str(tmp_path / "study" / "results.json"), roles=study_cluster)
    for name, earlier, refusal in [("other-budget", {**study, "budget_bps": 1000}, r"a study of another task \(budget_bps 1000 \(here 500\)\)"),
                                   ("variants-cut-short", {**study, "chosen_variant": {}}, r"no RL variant chosen for grpo \(that study stopped before"),
                                   ("a-list", [study], r"not a study's results.json \(no study's fields in it\)")]:
        (tmp_path / f"{name}.json").write_text(json.dumps(earlier))
        with pytest.raises(ValueError, match=refusal):
            run_ablation(str(base), str(tmp_path / "refused"), seeds=[0], steps=2, arms=["grpo"], choices_from=str(tmp_path / f"{name}.json"), roles=study_cluster)
    assert not (tmp_path / "refused").exists()
    starts, takeovers = dict(study_cluster.starts), dict(study_cluster.takeovers)  # the module's studies start their runs in the pools the last one kept
    longer = run_ablation(str(base), str(tmp_path / "longer"), seeds=[0], steps=2, arms=["grpo"], choices_from=str(tmp_path / "study" / "results.json"), roles=study_cluster)
    assert study_cluster.starts == starts and {pool: study_cluster.takeovers[pool] - n for pool, n in takeovers.items()} == {"rollout": 1, "learner": 1, "teacher": 0}
    # resumed with the same choices, the file named another way: nothing trains again; with other choices: refused
    again = run_ablation(str(base), str(tmp_path / "longer"), seeds=[0], steps=2, arms=["grpo"], resume=True, roles=study_cluster,
                         choices_from=str(tmp_path / "study" / ".." / "study" / "results.json"))
    assert again["runs"] == longer["runs"] and study_cluster.takeovers["rollout"] == takeovers["rollout"] + 1
    other_scale = 0.1 if chosen == 3.0 else 3.0
    (tmp_path / "other-choice.json").write_text(json.dumps({**study, "chosen_lr_scale": {"grpo": other_scale}}))
    with pytest.raises(ValueError, match=r"another study \(choices carried over .*'lr_scale': \{'grpo': " + f"{chosen}" + r"\}"):
        run_ablation(str(base), str(tmp_path / "longer"), seeds=[0], steps=2, arms=["grpo"], resume=True, roles=study_cluster,
                     choices_from=str(tmp_path / "other-choice.json"))
    assert longer["tuning_runs"] == [] and [(r["lr_scale"], r["variant"], len(r["curve"])) for r in longer["runs"]] == [(chosen, variant, 2)]
    assert longer["choices_from"] == {"results": str(tmp_path / "study" / "results.json"), "steps": 1, "lr_scale": {"grpo": chosen}, "variant": {"grpo": variant}}
    assert f"| GRPO (answer reward) | {chosen:g}x the job's | {variant or 'its own'} |" in (tmp_path / "longer" / "retain_table.md").read_text()
    job = load_job(base)
    scaled = arm_job(job, "sft", 0, tmp_path, steps=1, lr_scale=3.0).optimizer.lr
    assert scaled.model_dump() == pytest.approx({module: 3.0 * rate for module, rate in job.optimizer.lr.model_dump().items()})


def test_a_study_whose_learning_rates_are_chosen_at_an_end_of_the_grid_stops_before_its_seeds(teacher, study_cluster, tmp_path):
    """The plan's rule: an arm whose best scale is an end of the grid (above every other) has the grid extended that
    way before anything trains at it. A study holding such validation scores (as a cut-short study would) stops after
    its learning-rate runs, naming the arm, and trains nothing."""
    import ray

    from lt_opd_ray.tools.ablation import run_ablation

    base = tmp_path / "toy_circles.yaml"
    base.write_text(Path(BASE_JOB).read_text().replace("data: toy-circles-test:512", "data: toy-circles-test:16")
                    .replace("export_port: 8091", f"export_port: {STUDY_METRICS_PORT}"))
    job, study = load_job(base), tmp_path / "study"
    study.mkdir()
    held = {"base_job": str(base), "steps": 1, "budget_bps": job.eval_budget_bps, "selectors": list(job.eval.selectors),
            "trained_with": job.selector.name, "lr_scales": [0.3, 1.0], "rl_variants": [], "runs": [], "seconds": 60.0,
            "tuning_runs": [{"arm": "sft", "lr_scale": scale, "variant": None, "seconds": 1.0, "accuracy": {}, "retain": retain}
                            for scale, retain in ((0.3, 0.7), (1.0, 0.6))]}
    (study / "results.json").write_text(json.dumps(held))
    stopped = run_ablation(str(base), str(study), seeds=[0], steps=1, arms=["sft"], lr_scales=[0.3, 1.0], resume=True, roles=study_cluster)
    assert stopped["grid_ends"] == {"sft": 0.3} and not stopped["complete"] and not stopped["runs"] and ray.is_initialized()
    saved = json.loads((study / "results.json").read_text())
    assert saved["grid_ends"] == {"sft": 0.3} and saved["tuning_runs"] == held["tuning_runs"] and not (study / "sft").exists()
    assert saved["seconds"] > held["seconds"]
    with pytest.raises(ValueError, match=r"that study stopped at an end of its learning-rate grid \(sft 0.3x\)"):
        run_ablation(str(base), str(tmp_path / "refused"), seeds=[0], steps=2, arms=["sft"], choices_from=str(study / "results.json"), roles=study_cluster)


def test_a_study_stopped_by_sigterm_inside_a_run_keeps_what_it_finished_and_says_so(teacher, study_cluster, tmp_path):
    """SIGTERM while an arm trains: the run stops after the update in progress (checkpointed), and the study stops
    with it, naming the run, instead of evaluating a student that was not finished; results.json keeps its runs."""
    import os
    import signal
    import threading
    import time

    from lt_opd_ray.tools.ablation import StudyStopped, run_ablation

    base = tmp_path / "toy_circles.yaml"
    base.write_text(Path(BASE_JOB).read_text().replace("data: toy-circles-test:512", "data: toy-circles-test:16")
                    .replace("prompts_per_step: 16", "prompts_per_step: 4").replace("export_port: 8091", f"export_port: {STUDY_METRICS_PORT}"))
    steps_log = tmp_path / "study" / "sft" / "seed1" / "steps.jsonl"  # the second run's (SFT: no teacher pool to start)

    def terminate_after_the_first_update():
        while not (steps_log.exists() and steps_log.read_text().count("\n") >= 1):
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=terminate_after_the_first_update, daemon=True).start()
    with pytest.raises(StudyStopped, match=r"toy-circles-sft-s1 stopped after update [12] of 3: results.json keeps the finished runs"):
        run_ablation(str(base), str(tmp_path / "study"), seeds=[0, 1], steps=3, arms=["sft"], roles=study_cluster)
    saved = json.loads((tmp_path / "study" / "results.json").read_text())
    assert [(r["arm"], r["seed"]) for r in saved["runs"]] == [("sft", 0)] and not saved["complete"] and not (steps_log.parent / "final").exists()


def test_the_rl_arms_variants_change_their_group_size_or_clip_range_and_nothing_else(tmp_path):
    """RL_VARIANTS on the RL arms' jobs: twice the group with half the prompts (the same responses an update), the
    paper's clip range halved or doubled; no other field moves. The choice among an arm's own settings and its
    variants is the highest validation retain at its chosen scale, a tie going to its own settings."""
    from lt_opd_ray.core.rl import CLIP_RANGES
    from lt_opd_ray.tools.ablation import RL_VARIANTS, arm_job
    from lt_opd_ray.tools.ablation_choices import chosen_lr_scale, chosen_variant, grid_ends

    base = load_job("jobs/toy_discs.yaml")
    for arm in ("grpo", "dapo", "gspo"):
        own = arm_job(base, arm, 0, tmp_path).model_dump()
        low, high = CLIP_RANGES[arm]
        for variant, changed in zip(RL_VARIANTS, ({"sampling": {"n": 8, "prompts_per_step": 8}},
                                                  {"objective": {"clip_low": low / 2, "clip_high": high / 2}},
                                                  {"objective": {"clip_low": low * 2, "clip_high": high * 2}})):
            job = arm_job(base, arm, 0, tmp_path, variant=variant)
            expected = {section: {**own[section], **fields} for section, fields in changed.items()}
            assert {section: getattr(job, section).model_dump() for section in changed} == expected
            assert {k: v for k, v in job.model_dump().items() if k not in changed} == {k: v for k, v in own.items() if k not in changed}
            assert job.sampling.n * job.sampling.prompts_per_step == 64 and job.optimizer.steps_per_update == 4  # four mini-batches still
    with pytest.raises(ValueError, match="variant 2x_clip is an RL arm's \\(grpo, dapo, gspo\\), not lt_opd's"):
        arm_job(base, "lt_opd", 0, tmp_path, variant="2x_clip")
    tuning = [{"arm": "grpo", "lr_scale": 1.0, "retain": 0.6}, {"arm": "grpo", "lr_scale": 0.3, "retain": 0.6},  # runs before variants: no key
              {"arm": "grpo", "lr_scale": 1.0, "variant": "2x_group", "retain": 0.9},  # a variant never chooses the scale
              {"arm": "grpo", "lr_scale": 1.0, "variant": "0.5x_clip", "retain": 0.6}, {"arm": "grpo", "lr_scale": 0.3, "variant": "2x_clip", "retain": 0.95}]
    assert chosen_lr_scale(tuning, "grpo", [1.0, 0.3]) == 1.0 and chosen_lr_scale(tuning, "grpo", [0.3, 1.0]) == 0.3  # a tie: listed first
    scores = [{"arm": arm, "lr_scale": scale, "retain": retain} for arm, row in {"a": (0.5, 0.6, 0.4), "b": (0.6, 0.6, 0.4), "c": (0.4, 0.5, 0.6),
                                                                                 "d": (0.6, 0.5, 0.4)}.items() for scale, retain in zip((0.3, 1.0, 3.0), row)]
    scores.append({"arm": "d", "lr_scale": 3.0, "variant": "2x_clip", "retain": 0.9})  # variants choose no scale and make no end
    chosen = {arm: chosen_lr_scale(scores, arm, [0.3, 1.0, 3.0]) for arm in "abcd"}
    assert chosen == {"a": 1.0, "b": 0.3, "c": 3.0, "d": 0.3}  # b: a tie, the scale listed first
    assert grid_ends(scores, chosen, [0.3, 1.0, 3.0]) == {"c": 3.0, "d": 0.3}  # b's end ties an inner scale: nothing beyond to look for
    assert grid_ends(scores, {"c": 3.0}, [3.0]) == {}  # one scale has no ends
    assert chosen_variant(tuning, "grpo", 1.0, list(RL_VARIANTS)) == "2x_group"  # 0.95 was at another scale
    assert chosen_variant(tuning, "grpo", 1.0, ["0.5x_clip"]) is None  # only the variants the study tries; a tie: its own
    tuning[2]["retain"] = 0.6
    assert chosen_variant(tuning, "grpo", 1.0, list(RL_VARIANTS)) is None


def test_curves_have_seed_bands_and_one_loss_axis_per_objective(tmp_path):
    from lt_opd_ray.tools.ablation_report import plot_curves

    def curve(offset, rewarded=False):
        return [{"step": s, "loss": 0.0 if rewarded else 0.1 / s + offset, "reward": 0.1 * s + offset if rewarded else None,
                 "eval": {"cdpruner": 0.5 + offset} if s % 2 == 0 else {}} for s in range(1, 5)]

    runs = [{"arm": arm, "seed": seed, "curve": curve(0.01 * seed, arm == "grpo")} for arm in ("sft", "lt_opd", "grpo") for seed in (0, 1)]
    results = {"selectors": ["cdpruner"], "teacher": {"full": 0.8, "cdpruner": 0.4}, "runs": runs, "budget_bps": 500, "seeds": [0, 1]}
    titles = plot_curves(results, tmp_path / "curves.png")  # GRPO's loss is 0 by construction: its panel shows its reward
    assert titles == ["held-out retain ratio (2 seeds: mean, min-max band)", "SFT on the data's responses", "LT-OPD", "GRPO (answer reward)"]
    assert (tmp_path / "curves.png").stat().st_size > 10_000


@pytest.mark.slow
def small_plan(tmp_path: Path, fields: str) -> Path:
    """A plan file of design 4 at test size (4 prompts an update, 2 seeds of 2 updates, 16 evaluation rows every
    update, the last evaluation the statistic), with `fields` (its arms, out and decision) added."""
    base = tmp_path / "toy_discs.yaml"
    base.write_text(Path("jobs/toy_discs.yaml").read_text().replace("prompts_per_step: 16", "prompts_per_step: 4")
                    .replace("export_port: 8091", f"export_port: {STUDY_METRICS_PORT}"))
    plan = tmp_path / "plan.yaml"
    plan.write_text(f"job: {base}\nseeds: 2\nupdates: 2\neval_rows: toy-discs-test:16\neval_every: 1\nflat_window: 1\n"
                    "statistic: {kinds: [biggest, smallest, top], held_out_kinds: [left], last: 1}\n" + fields)
    return plan


def test_a_cross_plan_trains_each_selector_evaluates_with_each_and_writes_its_verdict(study_cluster, tmp_path):
    """`lt-opd ablation --plan` with `kind: cross`: LT-OPD trained with CDPruner and with DivPrune on paired seeds, every
    run evaluated with both selectors by kind of question, the cross's verdict and the study's table written after
    every run; each pair's crossed statistic re-derived here from its run's curve."""
    from lt_opd_ray.tools.ablation import run_plan
    from lt_opd_ray.tools.study_plan import kind_retain

    plan = small_plan(tmp_path, f"kind: cross\nout: {tmp_path / 'cross'}\ntrained_with: {{cdpruner: lt_opd, divprune: lt_opd_divprune}}\n"
                                "decision: {alpha: 0.05, margin: 0.03, expected_sd: 0.05}\n")
    results, verdict = run_plan(str(plan), roles=study_cluster)
    assert sorted((r["arm"], r["seed"]) for r in results["runs"]) == [("lt_opd", 0), ("lt_opd", 1), ("lt_opd_divprune", 0), ("lt_opd_divprune", 1)]
    assert results["selectors"] == ["cdpruner", "divprune"]
    by_run = {(r["arm"], r["seed"]): r for r in results["runs"]}
    for pair in verdict["pairs"]:
        arm = {"cdpruner": "lt_opd", "divprune": "lt_opd_divprune"}[pair["trained"]]
        by_hand = [kind_retain(by_run[arm, seed]["curve"][-1]["eval_by_kind"][pair["evaluated"]], results["teacher_by_kind"],
                               ["biggest", "smallest", "top"]) for seed in (0, 1)]
        assert pair["crossed"] == pytest.approx(by_hand) and pair["verdict"] in ("transfers", "keeps a gain", "no gain", "no verdict")
    written = (tmp_path / "cross" / "verdict.md").read_text()
    assert written.count("| cdpruner | divprune |") == 1 and written.count("| divprune | cdpruner |") == 1
    assert (tmp_path / "cross" / "retain_table.md").exists() and len((tmp_path / "cross" / "statistic.csv").read_text().splitlines()) == 1 + 4 * 2


def test_a_plan_file_runs_its_paired_study_and_its_rule_writes_the_verdict(study_cluster, tmp_path):
    """`lt-opd ablation --plan`: the two arms of the contrast on paired seeds, every run evaluated on the plan's rows
    every update by kind of question (design 4's kinds), and the verdict, statistic.csv and verdict.md computed from
    the plan alone: each run's statistic re-derived here from its curve."""
    from lt_opd_ray.tools.ablation import run_plan
    from lt_opd_ray.tools.study_plan import kind_retain

    plan = small_plan(tmp_path, f"out: {tmp_path / 'study'}\ncontrast: [lt_opd, grpo]\n"
                                "decision: {alpha: 0.05, minimal_effect: 0.05, expected_sd: 0.05}\n")
    results, verdict = run_plan(str(plan), roles=study_cluster)
    assert sorted((r["arm"], r["seed"]) for r in results["runs"]) == [("grpo", 0), ("grpo", 1), ("lt_opd", 0), ("lt_opd", 1)]
    assert results["eval_items"] == 16 and results["eval_rows"] == "toy-discs-test:16" and results["eval_every"] == 1
    for arm in ("lt_opd", "grpo"):
        runs = sorted((r for r in results["runs"] if r["arm"] == arm), key=lambda r: r["seed"])
        assert all([set(e.get("eval_by_kind", {}).get("cdpruner", {})) for e in r["curve"]] == [{"biggest", "smallest", "top", "left"}] * 2 for r in runs)
        by_hand = [kind_retain(r["curve"][-1]["eval_by_kind"]["cdpruner"], results["teacher_by_kind"], ["biggest", "smallest", "top"]) for r in runs]
        assert verdict[arm]["statistic"] == pytest.approx(by_hand)
    assert verdict["decision"] in ("shown", "not shown", "reversed", "no verdict") and verdict["test"]["n"] == 2
    assert f"Verdict: **{verdict['decision']}**" in (tmp_path / "study" / "verdict.md").read_text()
    assert len((tmp_path / "study" / "statistic.csv").read_text().splitlines()) == 5
    # a study stopped after a run finished and before it was recorded (in the per-kind evaluation of its student, say):
    # --resume takes the finished run from its folder as it is, trains nothing again and moves nothing aside; one
    # recorded but stopped in that evaluation gets it; a folder whose run had other settings (another learning rate in
    # the job it recorded) is trained again, the old one moved aside
    written = json.loads((tmp_path / "study" / "results.json").read_text())
    lost, changed, unevaluated = written["runs"][-1], written["runs"][-2], written["runs"][0]
    written["runs"] = written["runs"][:-2]
    del unevaluated["final_by_kind"]
    (tmp_path / "study" / "results.json").write_text(json.dumps(written))
    other = tmp_path / "study" / changed["arm"] / f"seed{changed['seed']}"
    (other / "job.yaml").write_text((other / "job.yaml").read_text().replace("language_model: ", "language_model: 1", 1))
    resumed, again = run_plan(str(plan), resume=True, roles=study_cluster)
    by_run = {(r["arm"], r["seed"]): r for r in resumed["runs"]}
    kept, fresh = by_run[lost["arm"], lost["seed"]], by_run[changed["arm"], changed["seed"]]
    assert kept["recovered"] and kept["run_id"] == lost["run_id"] and kept["curve"] == lost["curve"] and kept["final"] == lost["final"]
    assert kept["final_by_kind"] == lost["final_by_kind"] and len(list((tmp_path / "study" / lost["arm"]).iterdir())) == 2
    assert "recovered" not in fresh and fresh["run_id"] != changed["run_id"] and len(list(other.parent.iterdir())) == 3
    assert by_run[unevaluated["arm"], unevaluated["seed"]]["final_by_kind"] == results["runs"][0]["final_by_kind"]
    assert again["decision"] in ("shown", "not shown", "reversed", "no verdict")