"""Benchmark adapters on small fixtures in each benchmark's release layout, and `lt-opd eval` end to end."""

from __future__ import annotations

import base64
import csv
import io
import json

import pytest
from conftest import bomb_png, random_image

from lt_opd_ray.evals.benchmarks import BENCHMARKS, benchmark
from lt_opd_ray.evals.reading import BenchmarkError


def _b64(seed: int) -> str:
    buffer = io.BytesIO()
    random_image(seed, 64, 64).save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()


def _save(folder, name: str, seed: int) -> str:
    (folder / "images").mkdir(exist_ok=True)
    random_image(seed, 64, 64).save(folder / "images" / name)
    return f"images/{name}"


def _tsv(path, rows):
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]), delimiter="\t")
        writer.writeheader()
        writer.writerows(rows)
    return path


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def fixture(name: str, folder):
    """(file, responses that score perfectly, expected perfect score) for each format."""
    if name in ("mmbench", "hrbench"):
        rows = [
            {"index": i, "question": f"Q{i}?", "hint": "", "A": "cat", "B": "dog", "C": "bird", "D": "", "answer": "ABC"[i],
             "category": "x", "image": _b64(i)}
            for i in range(3)
        ]
        return _tsv(folder / f"{name}.tsv", rows), ["A", "(B)", "The answer is C."], 100.0
    if name in ("mmmu", "vstar"):
        rows = [{"id": f"v{i}", "question": "What is in <image 1>?", "options": "['cat', 'dog']" if i else ["cat", "dog"],
                 "answer": "AB"[i], "image": _save(folder, f"{i}.png", i)} for i in range(2)]
        return _jsonl(folder / f"{name}.jsonl", rows), ["A", "dog"], 100.0
    if name == "pope":
        rows = [{"question_id": i, "image": _save(folder, f"{i}.png", i), "text": "Is there a cat?", "label": "yes" if i % 2 else "no"}
                for i in range(4)]
        return _jsonl(folder / "pope.jsonl", rows), ["No.", "Yes", "no", "yes, there is"], 100.0
    if name == "gqa":
        questions = {f"q{i}": {"imageId": f"n{i}", "question": "What colour?", "answer": "red"} for i in range(2)}
        for i in range(2):
            _save(folder, f"n{i}.jpg", i)
        (folder / "gqa.json").write_text(json.dumps(questions))
        return folder / "gqa.json", ["Red.", "the red"], 100.0
    if name == "textvqa":
        data = [{"question_id": i, "question": "What does it say?", "image_id": f"t{i}", "answers": ["stop"] * 10} for i in range(2)]
        for i in range(2):
            _save(folder, f"t{i}.jpg", i)
        (folder / "textvqa.json").write_text(json.dumps({"data": data}))
        return folder / "textvqa.json", ["STOP", "stop"], 100.0
    if name == "mme":
        rows = [{"index": i, "image": _b64(i // 2), "image_path": f"img{i // 2}", "question": "Is there a cat? Please answer yes or no.",
                 "answer": "Yes" if i % 2 == 0 else "No", "category": "existence" if i < 2 else "code_reasoning"} for i in range(4)]
        return _tsv(folder / "mme.tsv", rows), ["Yes", "No", "yes", "no"], 400.0  # 200 per subtask
    if name == "ocrbench":
        rows = [{"dataset_name": "IIIT5K", "image_path": _save(folder, f"o{i}.png", i), "question": "What is written?",
                 "answers": ["hello"], "type": "Regular Text Recognition"} for i in range(2)]
        (folder / "ocrbench.json").write_text(json.dumps(rows))
        return folder / "ocrbench.json", ["It says Hello.", "hello world"], 2.0
    if name == "muirbench":
        rows = [{"idx": f"m{i}", "task": "Image-Text Matching", "question": "Which of <image> and <image> shows a cat?",
                 "options": ["the first", "the second", "neither"], "answer": "AB"[i],
                 "image_list": [_save(folder, f"m{i}a.png", i), _b64(i + 5)]} for i in range(2)]
        return _jsonl(folder / "muirbench.jsonl", rows), ["A", "(B)"], 100.0
    if name == "mvbench":  # a task's JSON list: one clip as a video file, one as a folder of frames
        rows = [{"video": _video(folder, "v0.avi", 0), "question": "What does the person do?", "candidates": ["sit down", "stand up"],
                 "answer": "stand up"},
                {"video": _frames(folder, "v1", 1), "question": "What moves?", "candidates": ["a ball", "a car", "nothing"], "answer": "a ball"}]
        (folder / "action_sequence.json").write_text(json.dumps(rows))
        return folder / "action_sequence.json", ["(B)", "A"], 100.0
    raise KeyError(name)


def _video(folder, name: str, seed: int, frames: int = 20) -> str:
    import cv2
    import numpy as np

    (folder / "videos").mkdir(exist_ok=True)
    writer = cv2.VideoWriter(str(folder / "videos" / name), cv2.VideoWriter_fourcc(*"MJPG"), 4.0, (64, 64))
    for i in range(frames):
        writer.write(np.asarray(random_image(seed * 100 + i, 64, 64)))
    writer.release()
    return f"videos/{name}"


def _frames(folder, name: str, seed: int, frames: int = 16) -> str:
    (folder / "videos" / name).mkdir(parents=True)
    for i in range(frames):
        random_image(seed * 100 + i, 64, 64).save(folder / "videos" / name / f"{i:05d}.jpg")
    return f"videos/{name}"


@pytest.mark.parametrize("name", sorted(BENCHMARKS))
def test_each_adapter_reads_its_format_and_scores_perfect_answers(name, tmp_path):
    path, perfect, best = fixture(name, tmp_path)
    adapter = benchmark(name)
    items = adapter.load(path)
    assert len(items) == len(perfect) and len({i.sample.uid for i in items}) == len(items)
    assert adapter.score(items, perfect)["score"] == pytest.approx(best)
    assert adapter.score(items, ["unrelated"] * len(items))["score"] < best
    if name in ("mmbench", "hrbench", "mmmu", "vstar"):
        assert "A. cat" in items[0].sample.question and "letter" in items[0].sample.question
    if name == "muirbench":  # every image of a row, in order; the question names them
        assert all(len(i.sample.images) == 2 for i in items) and items[0].sample.question.startswith("Which of image 1 and image 2")
    if name == "mvbench":  # the clip after no image; the answer's candidate as its letter
        assert all(i.sample.images == () and i.sample.video is not None for i in items)
        assert [i.reference["answer"] for i in items] == ["B", "A"] and "B. stand up" in items[0].sample.question
        assert len(items[1].sample.video.frames) == 16


def test_an_mvbench_row_with_a_bad_video_or_answer_is_named(tmp_path):
    (tmp_path / "videos").mkdir()
    (tmp_path / "videos" / "junk.mp4").write_bytes(b"not a video")
    (tmp_path / "videos" / "empty").mkdir()
    rows = [{"video": "videos/gone.mp4", "question": "q?", "candidates": ["a", "b"], "answer": "a"},
            {"video": "videos/junk.mp4", "question": "q?", "candidates": ["a", "b"], "answer": "a"},
            {"video": "videos/empty", "question": "q?", "candidates": ["a", "b"], "answer": "a"},
            {"video": _video(tmp_path, "ok.avi", 0), "question": "q?", "candidates": ["a", "b"], "answer": "c"},
            {"video": "videos/ok.avi", "question": "q?", "candidates": ["a"], "answer": "a"}]
    (tmp_path / "task.json").write_text(json.dumps(rows))
    with pytest.raises(BenchmarkError) as info:
        benchmark("mvbench").load(tmp_path / "task.json")
    message = str(info.value)
    for expected in ("row 1: video 'videos/gone.mp4' is neither a file nor a folder of frames", "row 2: video (",
                     "row 3: video folder", "row 4: answer 'c' is not one of the candidates", "row 5: candidates must list at least two"):
        assert expected in message, message
    (tmp_path / "task.json").write_text(json.dumps({"video": "videos/ok.avi"}))
    with pytest.raises(BenchmarkError, match="a JSON list of rows, got dict"):
        benchmark("mvbench").load(tmp_path / "task.json")


def test_a_muirbench_row_with_a_bad_image_is_named_with_its_position(tmp_path):
    rows = [{"idx": "m0", "question": "<image> or <image>?", "options": ["a", "b"], "answer": "A",
             "image_list": [_save(tmp_path, "ok.png", 0), "images/gone.png"]},
            {"idx": "m1", "question": "<image>?", "options": ["a", "b"], "answer": "A", "image_list": []}]
    with pytest.raises(BenchmarkError) as info:
        benchmark("muirbench").load(_jsonl(tmp_path / "muirbench.jsonl", rows))
    assert "m0 image 1: image 'images/gone.png' is neither a file" in str(info.value)
    assert "m1: image_list must be a non-empty list of images" in str(info.value)


def test_the_job_schema_knows_every_benchmark():
    from typing import get_args

    from lt_opd_ray.config.schema import BenchmarkName

    assert set(get_args(BenchmarkName)) == set(BENCHMARKS)


def test_a_bad_file_is_refused_naming_every_bad_row(tmp_path):
    rows = [
        {"question_id": 1, "image": "images/missing.png", "text": "Is there a cat?", "label": "yes"},
        {"question_id": 2, "image": _save(tmp_path, "ok.png", 0), "text": "", "label": "yes"},
        {"question_id": 3, "image": "images/ok.png", "text": "Is there a dog?", "label": "maybe"},
        {"question_id": 5, "image": "images/ok.png", "text": "Is there a dog?", "label": "no"},
        {"question_id": 5, "image": "images/ok.png", "text": "Is there a cat?", "label": "no"},
        {"question_id": 4, "image": base64.b64encode(b"not an image").decode(), "text": "A cat?", "label": "no"},
        {"question_id": 6, "image": base64.b64encode(bomb_png()).decode(), "text": "A cat?", "label": "no"},
        {"question_id": 7, "image": base64.b64encode((tmp_path / "images" / "ok.png").read_bytes()[:-200]).decode(), "text": "A cat?", "label": "no"},
        {"question_id": 8, "image": "images/ok.png", "text": {"a": 1}, "label": "no"},
        {"question_id": 9, "image": "images/ok.png", "text": "A cat? " * 10_000, "label": "no"},
        {"question_id": 10, "image": "images/ok.png", "text": "A cat?", "label": ["yes"]},
    ]
    path = _jsonl(tmp_path / "pope.jsonl", rows)
    with path.open("a") as handle:
        handle.write("{broken\n[1, 2]\n")
    with pytest.raises(BenchmarkError) as info:
        benchmark("pope").load(path)
    message = str(info.value)
    for expected in ("1: image 'images/missing.png' is neither a file", "2: no text", "3: label 'maybe' is not yes/no",
                     "4: image (the base64 data) does not decode", "line 12: not JSON", "pope-5: duplicate id",
                     "8: text must be text, got dict", "pope-9: prompt has 70,0", "10: label must be text, got list",
                     "line 13: a row must be a JSON object, got list",
                     "6: image (the base64 data) refused, too many pixels (a decompression bomb?)",
                     "7: image (the base64 data) does not decode"):  # truncated: only a full decode finds it
        assert expected in message, message
    with pytest.raises(BenchmarkError, match="unknown benchmark format 'seedbench'"):
        benchmark("seedbench")


@pytest.mark.slow
def test_eval_command_writes_the_retain_table_and_plot(tiny_dirs, tmp_path, capsys):
    from lt_opd_ray.cli.main import main
    from lt_opd_ray.models.tiny import build_tiny_model

    mmbench, _, _ = fixture("mmbench", tmp_path)
    pope, _, _ = fixture("pope", tmp_path)
    muirbench, _, _ = fixture("muirbench", tmp_path)  # two images per question
    mvbench, _, _ = fixture("mvbench", tmp_path)  # a clip per question
    out = tmp_path / "eval"
    model = build_tiny_model("qwen3_vl", tmp_path / "model", layers=4)  # room after FastV's scoring layer
    argv = ["eval", str(model), "--bench", f"mmbench={mmbench}", "--bench", f"pope={pope}", "--bench", f"muirbench={muirbench}",
            "--bench", f"mvbench={mvbench}", "--frames", "8",
            "--budgets", "500", "2500", "--selectors", "cdpruner", "hiprune", "fastv", "--max-new-tokens", "4", "--out", str(out)]
    assert main(argv) == 0
    results = json.loads((out / "results.json").read_text())
    assert set(results["benchmarks"]) == {"mmbench", "pope", "muirbench", "mvbench"}
    for key, retain in results["retain"].items():
        scored = {n: e for n, e in results["benchmarks"].items() if e["full"]["score"] > 0}
        ratios = [scored[n]["pruned"][key]["score"] / scored[n]["full"]["score"] for n in scored]
        assert retain["retain"] == (pytest.approx(sum(ratios) / len(ratios)) if ratios else None)
        assert sorted(retain["without_full_score"]) == sorted(set(results["benchmarks"]) - set(scored))
    table = (out / "retain_table.md").read_text()
    assert table.count("\n") == 2 + 1 + 6  # header, rule, full tokens, 3 selectors x 2 budgets
    assert (out / "retain.png").read_bytes()[:4] == b"\x89PNG" and (out / "retain_table.csv").exists()
    assert main(["eval", str(tiny_dirs["qwen3_vl"]), "--bench", f"nope={pope}", "--out", str(tmp_path / "x")]) == 2
    assert not (tmp_path / "x").exists()


def test_retain_plot_says_why_a_selector_has_no_curve(tmp_path):
    from lt_opd_ray.evals.run import _plot

    results = {"retain": {"cdpruner@500": {"retain": None}, "cdpruner@2500": {"retain": None},
                          "random@500": {"retain": 0.5}, "random@2500": {"retain": 0.8}}}
    notes = _plot(results, ["cdpruner", "random"], [500, 2500], tmp_path / "retain.png")
    assert notes == ["cdpruner: retain undefined, the full-token score is 0 on every benchmark"]
    assert (tmp_path / "retain.png").read_bytes()[:4] == b"\x89PNG"
