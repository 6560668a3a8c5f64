"""Training rows: (sample_uid, image, question) from JSONL/parquet files or a seeded synthetic set.

The synthetic set is the embedded default: coloured shapes on a grid, questions
that name what to look at, short answers. It needs no files and is identical on
every machine for a given seed.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .models.processor import InputError

COLOURS = {"red": (220, 40, 40), "green": (40, 180, 60), "blue": (40, 80, 220), "yellow": (235, 210, 40)}
SHAPES = ("square", "circle")
REQUIRED_FIELDS = ("sample_uid", "image", "question")


@dataclass(frozen=True)
class Sample:
    uid: str
    image: Any  # a path, bytes or a PIL image
    question: str
    answer: str | None = None


def stable_seed(*parts: object) -> int:
    """A 63-bit seed from any parts, identical across processes and machines (unlike hash())."""
    digest = hashlib.blake2b("/".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def synthetic_sample(index: int, seed: int = 0, size: int | tuple[int, int] = 128) -> Sample:
    """One image (size: side, or (width, height)) with a shape in each quadrant; the question asks for the colour at one."""
    import random

    from PIL import Image, ImageDraw

    rng = random.Random(stable_seed("synthetic", seed, index))
    width, height = (size, size) if isinstance(size, int) else size
    image = Image.new("RGB", (width, height), (245, 245, 245))
    draw = ImageDraw.Draw(image)
    quadrants = ["top left", "top right", "bottom left", "bottom right"]
    answers = {}
    half_w, half_h = width // 2, height // 2
    for q, name in enumerate(quadrants):
        colour = rng.choice(list(COLOURS))
        shape = rng.choice(SHAPES)
        x0, y0 = (q % 2) * half_w + half_w // 4, (q // 2) * half_h + half_h // 4
        box = (x0, y0, x0 + half_w // 2, y0 + half_h // 2)
        (draw.rectangle if shape == "square" else draw.ellipse)(box, fill=COLOURS[colour])
        answers[name] = colour
    asked = rng.choice(quadrants)
    question = f"What colour is the shape in the {asked} corner? Answer with one word."
    return Sample(uid=f"synthetic-{seed}-{index}", image=image, question=question, answer=answers[asked])


def read_rows_raw(path: str | Path) -> list[tuple[int, dict]]:
    """(line or row number, record) of a JSONL or parquet file, unchecked."""
    path = Path(path)
    if not path.exists():
        raise InputError(f"{path}: data file not found")
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return [(i + 1, row) for i, row in enumerate(pq.read_table(path).to_pylist())]
    records = []
    for line_no, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            records.append((line_no, json.loads(line)))
        except json.JSONDecodeError as exc:
            raise InputError(f"{path}: line {line_no}: not valid JSON: {exc.msg}") from None
    return records


def read_rows(path: str | Path, image_root: str | Path = ".") -> list[Sample]:
    """Rows of a JSONL or parquet file; each must have sample_uid, image (path), question."""
    path = Path(path)
    records = read_rows_raw(path)
    where = "row" if path.suffix == ".parquet" else "line"
    samples, seen = [], {}
    for number, row in records:
        missing = [f for f in REQUIRED_FIELDS if not row.get(f)]
        if missing:
            raise InputError(f"{path}: {where} {number}: missing field(s) {', '.join(missing)}")
        uid = str(row["sample_uid"])
        if uid in seen:
            raise InputError(f"{path}: {where} {number}: duplicate sample_uid {uid!r} (first at {where} {seen[uid]})")
        seen[uid] = number
        image = row["image"]
        if isinstance(image, str):
            image = Path(image_root) / image
        samples.append(Sample(uid=uid, image=image, question=str(row["question"]), answer=row.get("answer")))
    return samples


def load_samples(spec: str, image_root: str | Path = ".", seed: int = 0) -> list[Sample]:
    """`synthetic:<n>` (coloured quadrants, 128x128; `synthetic:<n>@<W>x<H>` at another size),
    `toy-<task>:<n>` / `toy-<task>-test:<n>` (a toy task's training / held-out split, lt_opd_ray/toy),
    a folder prepared by `lt-opd data`, or a JSONL / parquet file."""
    kind, _, count = spec.partition(":")
    if kind == "synthetic" or kind.startswith("toy-"):
        count, _, size = count.partition("@")
        if not count.isdigit() or int(count) < 1:
            raise InputError(f"data {spec!r}: expected {kind}:<positive count>")
        if size:
            width, _, height = size.partition("x")
            if kind != "synthetic" or not (width.isdigit() and height.isdigit() and int(width) >= 32 and int(height) >= 32):
                raise InputError(f"data {spec!r}: expected synthetic:<n>@<width>x<height>, sides of at least 32 pixels")
            return [synthetic_sample(i, seed, (int(width), int(height))) for i in range(int(count))]
        if kind.startswith("toy-"):
            from .toy.tasks import toy_task

            name = kind.removeprefix("toy-").removesuffix("-test")
            return toy_task(name).samples(int(count), "test" if kind.endswith("-test") else "train")
        return [synthetic_sample(i, seed) for i in range(int(count))]
    if (Path(spec) / "manifest.json").exists():  # prepared by `lt-opd data`
        from .prepare import read_prepared

        return read_prepared(spec)
    return read_rows(spec, image_root)
