"""Training rows: (sample_uid, image, question) from JSONL/parquet files or a seeded synthetic set.

The synthetic set is the embedded default: coloured shapes on a grid, questions
that name what to look at, short answers. It needs no files and is identical on
every machine for a given seed.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import InputError

COLOURS = {"red": (220, 40, 40), "green": (40, 180, 60), "blue": (40, 80, 220), "yellow": (235, 210, 40)}
SHAPES = ("square", "circle")
DATA_SUFFIXES = (".jsonl", ".parquet")  # the row files `load_samples` reads
PREPARED_MANIFEST = "manifest.json"  # what marks a folder `lt-opd data` prepared (written last)
MAX_QUESTION_CHARS = 65_536  # a question is a sentence or a page, never a document: longer is refused per row
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


def question_problem(question: object) -> str | None:
    if not isinstance(question, str):
        return f"question must be text, got {type(question).__name__}"
    if len(question) > MAX_QUESTION_CHARS:
        return f"question has {len(question):,} characters, above the {MAX_QUESTION_CHARS:,} a row may have"
    return None


SHOWN_PROBLEMS = 10  # a file's problems named in one error; the rest counted


def listed(path: Path, problems: list[str]) -> str:
    """One error naming a file's problems, the first SHOWN_PROBLEMS of them."""
    more = f"; ... and {len(problems) - SHOWN_PROBLEMS} more" if len(problems) > SHOWN_PROBLEMS else ""
    return f"{path}: {'; '.join(problems[:SHOWN_PROBLEMS])}{more}"


def read_records(path: str | Path) -> list[tuple[int, dict | None, str | None]]:
    """(line or row number, record, None) for every JSON object of a JSONL or parquet file (its fields unchecked),
    (number, None, problem) for every line that is not one; blank lines skipped. A file that cannot be read as
    rows at all is an InputError."""
    path = Path(path)
    if not path.exists():
        raise InputError(f"{path}: data file not found")
    if path.is_dir():
        raise InputError(f"{path}: a folder without {PREPARED_MANIFEST}: give a JSONL or parquet file, or the folder `lt-opd data` wrote")
    if path.suffix not in DATA_SUFFIXES:
        raise InputError(f"{path}: a {path.suffix or 'suffix-less'} file; rows are read from {' or '.join(DATA_SUFFIXES)} files")
    if not os.access(path, os.R_OK):
        raise InputError(f"{path}: data file not readable (permission denied)")
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            return [(i + 1, row, None) for i, row in enumerate(pq.read_table(path).to_pylist())]
        except (pa.ArrowException, OSError) as exc:
            raise InputError(f"{path}: not a readable parquet file ({str(exc).splitlines()[0][:200]})") from None
    entries = []
    with path.open("rb") as handle:
        for line_no, raw in enumerate(handle, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                entries.append((line_no, None, f"not UTF-8 text (byte 0x{raw[exc.start]:02x}); save the file as UTF-8"))
                continue
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                entries.append((line_no, None, f"not valid JSON: {exc.msg}"))
                continue
            except RecursionError:
                entries.append((line_no, None, "JSON nested too deeply to be a row"))
                continue
            if not isinstance(record, dict):
                entries.append((line_no, None, f"a row must be a JSON object, got {type(record).__name__}"))
                continue
            entries.append((line_no, record, None))
    return entries


def read_rows_raw(path: str | Path) -> list[tuple[int, dict]]:
    """(line or row number, record) of a JSONL or parquet file whose every line is a JSON object; otherwise one
    InputError naming the lines that are not."""
    entries = read_records(path)
    if problems := [f"line {number}: {problem}" for number, _, problem in entries if problem]:
        raise InputError(listed(Path(path), problems))
    return [(number, record) for number, record, _ in entries]


def read_rows(path: str | Path, image_root: str | Path = ".") -> list[Sample]:
    """Rows of a JSONL or parquet file; each must have sample_uid, image (path), question. Every problem of the file
    is named in one InputError."""
    path = Path(path)
    where = "row" if path.suffix == ".parquet" else "line"
    samples, numbers, seen, problems = [], [], {}, []
    for number, row, problem in read_records(path):
        if problem := problem or _row_problem(row, seen, where):
            problems.append(f"{where} {number}: {problem}")
            continue
        uid = str(row["sample_uid"])
        seen[uid] = number
        image = row["image"]
        if isinstance(image, str):
            image = Path(image_root) / image
        samples.append(Sample(uid=uid, image=image, question=str(row["question"]), answer=row.get("answer")))
        numbers.append(number)
    missing = [(number, sample.image) for number, sample in zip(numbers, samples) if isinstance(sample.image, Path) and not sample.image.is_file()]
    if missing:
        shown = "; ".join(f"{where} {number}: {image}" for number, image in missing[:3])
        problems.append(f"{len(missing)} of {len(samples)} image file(s) not found under image_root {image_root}"
                        f" ({shown}{'; ...' if len(missing) > 3 else ''})")
    if problems:
        raise InputError(listed(path, problems))
    return samples


def _row_problem(row: dict, seen: dict[str, int], where: str) -> str | None:
    if missing := [f for f in REQUIRED_FIELDS if not row.get(f)]:
        return f"missing field(s) {', '.join(missing)}"
    if (uid := str(row["sample_uid"])) in seen:
        return f"duplicate sample_uid {uid!r} (first at {where} {seen[uid]})"
    return question_problem(row["question"])


MAX_GENERATED_ROWS = 100_000  # synthetic and toy rows are drawn in memory at start: more is a typo, not a data set


@dataclass(frozen=True)
class GeneratedRows:
    """A data spec that draws its rows: `synthetic:<n>[@<W>x<H>]` or `toy-<task>[-test]:<n>`."""

    kind: str  # "synthetic" or "toy-<task>[-test]"
    count: int
    size: tuple[int, int] | None = None  # (width, height) of synthetic images; None: 128 x 128

    @property
    def toy_task(self) -> str | None:
        return self.kind.removeprefix("toy-").removesuffix("-test") if self.kind.startswith("toy-") else None


def generated_rows(spec: str) -> GeneratedRows | None:
    """The generated form `spec` names, or None for a file or folder (read later, with its own named errors);
    a malformed generated form is an InputError saying the expected shape."""
    kind, _, rest = spec.partition(":")
    if kind != "synthetic" and not kind.startswith("toy-"):
        return None
    count, _, size = rest.partition("@")
    if not count.isdigit() or not 1 <= int(count) <= MAX_GENERATED_ROWS:
        raise InputError(f"{spec!r}: expected {kind}:<count from 1 to {MAX_GENERATED_ROWS:,}>")
    width, _, height = size.partition("x")
    if size and (kind != "synthetic" or not (width.isdigit() and height.isdigit() and min(int(width), int(height)) >= 32)):
        raise InputError(f"{spec!r}: expected synthetic:<n>@<width>x<height>, sides of at least 32 pixels")
    rows = GeneratedRows(kind, int(count), (int(width), int(height)) if size else None)
    if rows.toy_task is not None:
        from .toy.tasks import toy_task

        toy_task(rows.toy_task)  # a known task, or an InputError naming the known ones
    return rows


def load_samples(spec: str, image_root: str | Path = ".", seed: int = 0) -> list[Sample]:
    """`synthetic:<n>` (coloured quadrants, 128x128; `synthetic:<n>@<W>x<H>` at another size),
    `toy-<task>:<n>` / `toy-<task>-test:<n>` (a toy task's training / held-out split, lt_opd_ray/toy),
    a folder prepared by `lt-opd data`, or a JSONL / parquet file."""
    if (generated := generated_rows(spec)) is not None:
        if generated.toy_task is not None:
            from .toy.tasks import toy_task

            return toy_task(generated.toy_task).samples(generated.count, "test" if generated.kind.endswith("-test") else "train")
        return [synthetic_sample(i, seed, generated.size or 128) for i in range(generated.count)]
    if (Path(spec) / PREPARED_MANIFEST).exists():
        from .prepare import read_prepared

        return read_prepared(spec)
    return read_rows(spec, image_root)
