"""Adapters for the nine benchmarks of the paper and its multi-image and video ones, stored locally in their usual release layouts.

Each adapter reads one benchmark file into items (a prompt with its images and its
references) and scores a list of responses with the benchmark's own metric
(`scoring`). Every problem of a file is collected (row id, field) and reported at
once: a file with any bad row is refused whole, so no score is ever computed on a
silently shortened benchmark.

| name      | file                                   | fields                                             | score |
|-----------|----------------------------------------|----------------------------------------------------|-------|
| mmbench   | TSV (VLMEvalKit)                       | index, question, [hint], A, B, C, D.., answer, image (base64) | accuracy x 100 |
| hrbench   | TSV (VLMEvalKit)                       | as mmbench                                         | accuracy x 100 |
| mmmu      | JSONL                                  | id, question, options (list), answer (letter), image | accuracy x 100 |
| vstar     | JSONL                                  | as mmmu                                            | accuracy x 100 |
| pope      | JSONL                                  | question_id, image, text, label (yes/no)           | F1 x 100 (+ accuracy, precision, recall) |
| gqa       | JSON {qid: {imageId, question, answer}}| images in images/<imageId>.jpg                      | exact match x 100 |
| textvqa   | JSON {"data": [...]}                   | question_id, question, image_id, answers (10); images/<image_id>.jpg | VQA accuracy x 100 |
| mme       | TSV (VLMEvalKit)                       | index, image (base64), question, answer (Yes/No), category, [image_path] | perception + cognition |
| ocrbench  | JSON list                              | dataset_name, image_path, question, answers         | correct count |
| muirbench | JSONL (the release's rows)             | idx, question (`<image>` marks each image), options (list), answer (letter), image_list (list) | accuracy x 100 |
| mvbench   | JSON list (a task's file) or JSONL     | video (file or folder of frames), question, candidates (list), answer (a candidate's text) | accuracy x 100 |

Images are base64 strings or paths relative to the benchmark file's folder; videos are paths relative to it (sampled
to `data.frames` frames, 16 by default, as MVBench is evaluated).
"""

from __future__ import annotations

import abc
import ast
import csv
import hashlib
from dataclasses import dataclass, field
from pathlib import Path

from lt_opd_ray.core.samples import Sample
from lt_opd_ray.evals import scoring
from lt_opd_ray.evals.reading import (
    BenchmarkError,
    Problems,
    image_of,
    read_json,
    read_jsonl,
    read_tsv,
    required,
    row_id_of,
    video_of,
)
from lt_opd_ray.sources.rows import MAX_QUESTION_CHARS

MC_INSTRUCTION = "Answer with the option's letter from the given choices directly."
SHORT_INSTRUCTION = "Answer the question using a single word or phrase."
YES_NO_INSTRUCTION = "Please answer yes or no."


@dataclass
class Item:
    sample: Sample  # uid, image (bytes or path), the full prompt text
    reference: dict = field(default_factory=dict)


class Benchmark(abc.ABC):
    name: str
    headline: str

    def load(self, path: str | Path) -> list[Item]:
        path = Path(path)
        if not path.exists():
            raise BenchmarkError(f"{path}: benchmark file not found")
        if not path.is_file():
            raise BenchmarkError(f"{path}: a folder, not a benchmark file")
        problems = Problems(path)
        try:
            items = self._read(path, problems)
        except UnicodeDecodeError as exc:
            raise BenchmarkError(f"{path}: not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset {exc.start}); save it as UTF-8") from None
        except (csv.Error, RecursionError) as exc:
            raise BenchmarkError(f"{path}: not a readable {path.suffix.lstrip('.') or 'benchmark'} file ({exc!r:.200})") from None
        seen: set[str] = set()
        for item in items:
            if item.sample.uid in seen:
                problems.add(item.sample.uid, "duplicate id")
            seen.add(item.sample.uid)
            if len(item.sample.question) > MAX_QUESTION_CHARS:  # refused before the model loads, not by the OOM killer
                problems.add(item.sample.uid, f"prompt has {len(item.sample.question):,} characters, above the {MAX_QUESTION_CHARS:,} a row may have")
        if not items and not problems.items:
            problems.add("-", "no rows")
        problems.raise_if_any()
        return items

    @abc.abstractmethod
    def _read(self, path: Path, problems: Problems) -> list[Item]: ...

    @abc.abstractmethod
    def score(self, items: list[Item], responses: list[str]) -> dict[str, float]:
        """Metrics, with the headline under "score"."""


def _mc_prompt(question: str, options: list[str], hint: str = "") -> str:
    lines = [hint.strip()] if hint and hint.strip() and hint.strip().lower() != "nan" else []
    lines.append(question.strip())
    lines += [f"{scoring.LETTERS[i]}. {option}" for i, option in enumerate(options)]
    lines.append(MC_INSTRUCTION)
    return "\n".join(lines)


# ----------------------------------------------------------------------- multiple choice
def _choices_hold(options, answer, row_id, problems) -> bool:
    """A JSONL row's options list at least two choices and its answer is one of their letters; a problem otherwise."""
    if not isinstance(options, list) or len(options) < 2:
        problems.add(row_id, "options must list at least two choices")
        return False
    if answer not in scoring.LETTERS[: len(options)]:
        problems.add(row_id, f"answer {answer!r} is not one of the option letters")
        return False
    return True


class _MultipleChoice(Benchmark):
    headline = "accuracy x 100"

    def score(self, items, responses):
        accuracy = scoring.multiple_choice_accuracy(
            responses, [i.reference["options"] for i in items], [i.reference["answer"] for i in items]
        )
        return {"score": 100 * accuracy, "accuracy": accuracy}


class MMBench(_MultipleChoice):
    name = "mmbench"

    def _read(self, path, problems):
        items = []
        for row in read_tsv(path):
            row_id = row.get("index") or "?"
            if not required(row, ("index", "question", "answer", "image"), row_id, problems):
                continue
            options = [row[letter] for letter in scoring.LETTERS if row.get(letter) not in (None, "", "nan")]
            if len(options) < 2:
                problems.add(row_id, "fewer than two options (columns A, B, ...)")
                continue
            if row["answer"] not in scoring.LETTERS[: len(options)]:
                problems.add(row_id, f"answer {row['answer']!r} is not one of the option letters")
                continue
            image = image_of(row["image"], path.parent, row_id, problems)
            if image is not None:
                prompt = _mc_prompt(row["question"], options, row.get("hint", ""))
                items.append(Item(Sample(f"{self.name}-{row_id}", (image,), prompt), {"options": options, "answer": row["answer"]}))
        return items


class HRBench(MMBench):
    name = "hrbench"


class MMMU(_MultipleChoice):
    name = "mmmu"

    def _read(self, path, problems):
        items = []
        for row in read_jsonl(path, problems):
            row_id = row_id_of(row, "id", "?")
            if not required(row, ("id", "question", "options", "answer", "image"), row_id, problems):
                continue
            options = row["options"]
            if isinstance(options, str):  # MMMU releases store the list as its Python repr
                try:
                    options = ast.literal_eval(options)
                except (ValueError, SyntaxError):
                    problems.add(row_id, "options is neither a list nor a list literal")
                    continue
            if not _choices_hold(options, row["answer"], row_id, problems):
                continue
            image = image_of(row["image"], path.parent, row_id, problems)
            if image is not None:
                question = str(row["question"]).replace("<image 1>", "the image")
                items.append(Item(Sample(f"{self.name}-{row_id}", (image,), _mc_prompt(question, [str(o) for o in options])),
                                  {"options": [str(o) for o in options], "answer": row["answer"]}))
        return items


class VStarBench(MMMU):
    name = "vstar"


class MuirBench(_MultipleChoice):
    """MuirBench: multiple choice over several images per question (the paper's multi-image evaluation). Each
    `<image>` in the question becomes "image i" (the images come first in the prompt, in order)."""

    name = "muirbench"

    def _read(self, path, problems):
        items = []
        for row in read_jsonl(path, problems):
            row_id = row_id_of(row, "idx", "?")
            if not required(row, ("idx", "question", "options", "answer", "image_list"), row_id, problems):
                continue
            options, listed = row["options"], row["image_list"]
            if not _choices_hold(options, row["answer"], row_id, problems):
                continue
            if not isinstance(listed, list) or not listed:
                problems.add(row_id, "image_list must be a non-empty list of images")
                continue
            images = [image_of(value, path.parent, f"{row_id} image {i}", problems) for i, value in enumerate(listed)]
            if any(image is None for image in images):
                continue
            question = str(row["question"])
            for i in range(len(images)):
                question = question.replace("<image>", f"image {i + 1}", 1)
            items.append(Item(Sample(f"{self.name}-{row_id}", tuple(images), _mc_prompt(question, [str(o) for o in options])),
                              {"options": [str(o) for o in options], "answer": row["answer"]}))
        return items


class MVBench(_MultipleChoice):
    """MVBench: multiple choice about a short clip (the paper's video evaluation, 16 frames). A task's file lists rows
    without ids: each is named by its position (`row N`); the answer is the right candidate's text."""

    name = "mvbench"

    def _read(self, path, problems):
        rows = read_jsonl(path, problems) if path.suffix == ".jsonl" else read_json(path, problems)
        if rows is not None and not isinstance(rows, list):
            problems.add("file", f"an MVBench task file is a JSON list of rows, got {type(rows).__name__}")
            return []
        items = []
        for number, row in enumerate(rows or [], 1):
            row_id = f"row {number}"
            if not required(row, ("video", "question", "candidates", "answer"), row_id, problems):
                continue
            candidates = [str(c) for c in row["candidates"]] if isinstance(row["candidates"], list) else []
            if len(candidates) < 2:
                problems.add(row_id, "candidates must list at least two choices")
                continue
            if str(row["answer"]) not in candidates:
                problems.add(row_id, f"answer {row['answer']!r} is not one of the candidates")
                continue
            video = video_of(row["video"], path.parent, row_id, problems)
            if video is not None:
                answer = scoring.LETTERS[candidates.index(str(row["answer"]))]
                items.append(Item(Sample(f"{self.name}-{path.stem}-{number}", (), _mc_prompt(str(row["question"]), candidates), video=video),
                                  {"options": candidates, "answer": answer}))
        return items


# --------------------------------------------------------------------------------- POPE
class POPE(Benchmark):
    name = "pope"
    headline = "F1 x 100"

    def _read(self, path, problems):
        items = []
        for row in read_jsonl(path, problems):
            row_id = row_id_of(row, "question_id", "?")
            if not required(row, ("question_id", "image", "text", "label"), row_id, problems):
                continue
            if str(row["label"]).strip().lower() not in ("yes", "no"):
                problems.add(row_id, f"label {row['label']!r} is not yes/no")
                continue
            image = image_of(row["image"], path.parent, row_id, problems)
            if image is not None:
                prompt = f"{row['text'].strip()} {YES_NO_INSTRUCTION}"
                items.append(Item(Sample(f"{self.name}-{row_id}", (image,), prompt), {"label": str(row["label"])}))
        return items

    def score(self, items, responses):
        metrics = scoring.pope_scores(responses, [i.reference["label"] for i in items])
        return {"score": 100 * metrics["f1"], **metrics}


# ------------------------------------------------------------------------- short answers
class GQA(Benchmark):
    name = "gqa"
    headline = "exact match x 100"

    def _read(self, path, problems):
        questions = read_json(path, problems)
        if not isinstance(questions, dict):
            problems.add("file", "expected a JSON object of questions keyed by question id")
            return []
        items = []
        for qid, row in questions.items():
            if not required(row, ("imageId", "question", "answer"), qid, problems):
                continue
            image = image_of(f"images/{row['imageId']}.jpg", path.parent, qid, problems)
            if image is not None:
                items.append(Item(Sample(f"{self.name}-{qid}", (image,), f"{row['question']}\n{SHORT_INSTRUCTION}"), {"answer": row["answer"]}))
        return items

    def score(self, items, responses):
        accuracy = sum(scoring.exact_match(r, i.reference["answer"]) for r, i in zip(responses, items, strict=True)) / len(items)
        return {"score": 100 * accuracy, "accuracy": accuracy}


class TextVQA(Benchmark):
    name = "textvqa"
    headline = "VQA accuracy x 100"

    def _read(self, path, problems):
        data = read_json(path, problems)
        if not isinstance(data, dict) or not isinstance(data.get("data"), list):
            problems.add("file", 'expected a TextVQA JSON object with a "data" list')
            return []
        rows = data["data"]
        items = []
        for row in rows:
            row_id = row_id_of(row, "question_id", "?")
            if not required(row, ("question_id", "question", "image_id", "answers"), row_id, problems):
                continue
            image = image_of(f"images/{row['image_id']}.jpg", path.parent, row_id, problems)
            if image is not None:
                prompt = f"{row['question']}\n{SHORT_INSTRUCTION}"
                answers = row["answers"] if isinstance(row["answers"], list) else [row["answers"]]
                items.append(Item(Sample(f"{self.name}-{row_id}", (image,), prompt), {"answers": [str(a) for a in answers]}))
        return items

    def score(self, items, responses):
        accuracy = sum(scoring.vqa_accuracy(r, i.reference["answers"]) for r, i in zip(responses, items, strict=True)) / len(items)
        return {"score": 100 * accuracy, "accuracy": accuracy}


# ----------------------------------------------------------------------------------- MME
class MME(Benchmark):
    name = "mme"
    headline = "perception + cognition"

    def _read(self, path, problems):
        items = []
        for row in read_tsv(path):
            row_id = row.get("index") or "?"
            if not required(row, ("index", "image", "question", "answer", "category"), row_id, problems):
                continue
            if row["answer"].strip().lower() not in ("yes", "no"):
                problems.add(row_id, f"answer {row['answer']!r} is not Yes/No")
                continue
            if row["category"] not in scoring.MME_PERCEPTION + scoring.MME_COGNITION:
                problems.add(row_id, f"unknown category {row['category']!r}")
                continue
            image = image_of(row["image"], path.parent, row_id, problems)
            if image is not None:
                question = row["question"].strip()
                prompt = question if YES_NO_INSTRUCTION.lower() in question.lower() else f"{question} {YES_NO_INSTRUCTION}"
                key = row.get("image_path") or hashlib.sha256(str(row["image"]).encode()).hexdigest()
                items.append(Item(Sample(f"{self.name}-{row_id}", (image,), prompt),
                                  {"subtask": row["category"], "image": key, "answer": row["answer"]}))
        return items

    def score(self, items, responses):
        records = [{**i.reference, "response": r} for i, r in zip(items, responses, strict=True)]
        scores = scoring.mme_scores(records)
        return {"score": scores["perception"] + scores["cognition"], **scores}


# ------------------------------------------------------------------------------ OCRBench
class OCRBench(Benchmark):
    name = "ocrbench"
    headline = "correct answers (of the file's questions)"

    def _read(self, path, problems):
        rows = read_json(path, problems)
        if not isinstance(rows, list):
            problems.add("file", "expected a JSON list of questions")
            return []
        items = []
        for number, row in enumerate(rows):
            row_id = row_id_of(row, "id", number)
            if not required(row, ("dataset_name", "image_path", "question", "answers"), row_id, problems):
                continue
            image = image_of(row["image_path"], path.parent, row_id, problems)
            answers = row["answers"] if isinstance(row["answers"], list) else [row["answers"]]
            if image is not None:
                items.append(Item(Sample(f"{self.name}-{row_id}", (image,), row["question"]),
                                  {"answers": [str(a) for a in answers], "dataset": row["dataset_name"]}))
        return items

    def score(self, items, responses):
        correct = scoring.ocrbench_score(
            responses, [i.reference["answers"] for i in items], [i.reference["dataset"] for i in items]
        )
        return {"score": float(correct), "correct": float(correct)}


BENCHMARKS: dict[str, type[Benchmark]] = {
    cls.name: cls for cls in (MMBench, MMMU, VStarBench, HRBench, POPE, GQA, TextVQA, MME, OCRBench, MuirBench, MVBench)
}


def benchmark(name: str) -> Benchmark:
    try:
        return BENCHMARKS[name]()
    except KeyError:
        raise BenchmarkError(f"unknown benchmark format {name!r}; known: {', '.join(sorted(BENCHMARKS))}") from None
