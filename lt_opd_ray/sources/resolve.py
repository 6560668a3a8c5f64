"""What a job's `data.*` and `model.path` strings name, resolved in one place (the schema checks them with it).

Data: `synthetic:<n>[@<W>x<H>][*<images>]`, `synthetic-video:<n>[@<W>x<H>]`, `toy-<task>[-test|-validation]:<n>`, a folder prepared by `lt-opd data`, or a JSONL /
parquet file. Models: `tiny:<family>[-vocab<N>]` (an embedded tiny random model, built once), `toy:<task>` (a toy
task's teacher: shipped, or trained once), or a local Hugging Face folder.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from lt_opd_ray.core.errors import InputError
from lt_opd_ray.core.samples import Sample
from lt_opd_ray.sources.rows import PREPARED_MANIFEST, read_rows
from lt_opd_ray.sources.synthetic import synthetic_sample, synthetic_video_sample

MAX_GENERATED_ROWS = 100_000  # synthetic and toy rows are drawn in memory at start: more is a typo, not a data set
MAX_SYNTHETIC_IMAGES = 16  # images per synthetic row (MVBench's frame count)


TOY_SPLITS = ("test", "validation")  # besides "train"
# toy-<task>-reference:<n>: the training rows, each carrying the response the full-token teacher is trained to write
# (its format, the true answer) instead of an annotator's sentence: what the oracle bound's SFT trains on
REFERENCE_RESPONSES = "-reference"


@dataclass(frozen=True)
class GeneratedRows:
    """A data spec that draws its rows: `synthetic:<n>[@<W>x<H>][*<images>]`, `synthetic-video:<n>[@<W>x<H>]` or
    `toy-<task>[-test|-validation|-reference]:<n>`."""

    kind: str  # "synthetic", "synthetic-video" or "toy-<task>[-test|-validation|-reference]"
    count: int
    size: tuple[int, int] | None = None  # (width, height) of synthetic images; None: 128 x 128
    images: int = 1  # images per synthetic row (0: a synthetic clip)

    @property
    def video(self) -> bool:
        return self.kind == "synthetic-video"

    @property
    def toy_task(self) -> str | None:
        if not self.kind.startswith("toy-"):
            return None
        return self.kind.removeprefix("toy-").removesuffix(REFERENCE_RESPONSES).removesuffix(f"-{self.split}")

    @property
    def reference_responses(self) -> bool:
        """A toy task's training rows with the full-token teacher's responses (`toy-<task>-reference:<n>`)."""
        return self.kind.startswith("toy-") and self.kind.endswith(REFERENCE_RESPONSES)

    @property
    def split(self) -> str:
        """A toy task's split: its training rows, its held-out rows ("test"), or rows for choosing settings on
        ("validation", drawn apart from both)."""
        return next((split for split in TOY_SPLITS if self.kind.endswith(f"-{split}")), "train")


def generated_rows(spec: str) -> GeneratedRows | None:
    """The generated form `spec` names, or None for a file or folder (read later, with its own named errors);
    a malformed generated form is an InputError saying the expected shape."""
    kind, _, rest = spec.partition(":")
    synthetic = kind in ("synthetic", "synthetic-video")
    if not synthetic and not kind.startswith("toy-"):
        return None
    rest, _, images = rest.partition("*")
    if images and (kind != "synthetic" or not images.isdigit() or not 1 <= int(images) <= MAX_SYNTHETIC_IMAGES):
        raise InputError(f"{spec!r}: expected synthetic:<n>[@<width>x<height>]*<images from 1 to {MAX_SYNTHETIC_IMAGES}>")
    count, _, size = rest.partition("@")
    if not count.isdigit() or not 1 <= int(count) <= MAX_GENERATED_ROWS:
        raise InputError(f"{spec!r}: expected {kind}:<count from 1 to {MAX_GENERATED_ROWS:,}>")
    width, _, height = size.partition("x")
    if size and (not synthetic or not (width.isdigit() and height.isdigit() and min(int(width), int(height)) >= 32)):
        raise InputError(f"{spec!r}: expected {kind}:<n>@<width>x<height>, sides of at least 32 pixels")
    rows = GeneratedRows(kind, int(count), (int(width), int(height)) if size else None, 0 if kind == "synthetic-video" else int(images or 1))
    if rows.toy_task is not None:
        from lt_opd_ray.sources.toy.tasks import toy_task

        toy_task(rows.toy_task)  # a known task, or an InputError naming the known ones
    return rows


def load_samples(spec: str, image_root: str | Path = ".", seed: int = 0, allow_outside_root: bool = False) -> list[Sample]:
    """`synthetic:<n>` (coloured quadrants, 128x128; `synthetic:<n>@<W>x<H>` at another size, `synthetic:<n>*<I>` with
    I images per row, the question naming one), `synthetic-video:<n>` (16-frame clips whose board changes once, the
    question asking about its start or end),
    `toy-<task>:<n>` / `toy-<task>-test:<n>` / `toy-<task>-validation:<n>` (a toy task's training / held-out /
    validation split, lt_opd_ray/toy; `toy-<task>-reference:<n>` its training rows, each carrying the response the
    full-token teacher is trained to write instead of an annotator's sentence),
    a folder prepared by `lt-opd data`, or a JSONL / parquet file."""
    if (generated := generated_rows(spec)) is not None:
        if generated.toy_task is not None:
            from lt_opd_ray.sources.toy.tasks import toy_task

            task = toy_task(generated.toy_task)
            if generated.reference_responses:
                return [dataclasses.replace(item.sample, response=item.response) for item in task.items(generated.count)]
            return task.samples(generated.count, generated.split)
        if generated.video:
            return [synthetic_video_sample(i, seed, generated.size or 128) for i in range(generated.count)]
        return [synthetic_sample(i, seed, generated.size or 128, generated.images) for i in range(generated.count)]
    if (Path(spec) / PREPARED_MANIFEST).exists():
        from lt_opd_ray.sources.prepare import read_prepared

        return read_prepared(spec)
    return read_rows(spec, image_root, allow_outside_root)


def embedded_model(path: str) -> bool:
    """Whether `model.path` names a model the package builds (`tiny:`, `toy:`) rather than a folder."""
    return path.startswith(("tiny:", "toy:"))


def resolve_model_dir(path: str) -> Path:
    """The local folder `model.path` names, built or trained first where it is embedded (`tiny:`, `toy:`)."""
    from lt_opd_ray.models.loading import model_folder

    if path.startswith("tiny:"):
        from lt_opd_ray.models.tiny import tiny_model_dir

        return tiny_model_dir(path.split(":", 1)[1])
    if path.startswith("toy:"):
        from lt_opd_ray.sources.toy.teacher import RECIPES, toy_teacher_dir

        task = path.split(":", 1)[1]
        if task not in RECIPES:
            raise FileNotFoundError(f"model.path {path!r}: no toy task {task!r} (known: {', '.join(RECIPES)})")
        return toy_teacher_dir(RECIPES[task])
    return model_folder(path)
