"""Reading a benchmark file: rows from TSV, JSONL or JSON, their required fields and images checked, every problem
collected by row id and reported at once (`Problems`)."""

from __future__ import annotations

import base64
import binascii
import csv
import json
from pathlib import Path


class BenchmarkError(ValueError):
    """A benchmark file that cannot be evaluated; the message lists every bad row by id."""


class Problems:
    def __init__(self, path: Path):
        self.path, self.items = path, []

    def add(self, row_id, message: str) -> None:
        self.items.append(f"{row_id}: {message}")

    def raise_if_any(self) -> None:
        if self.items:
            shown = "\n  ".join(self.items[:20])
            more = f"\n  ... and {len(self.items) - 20} more" if len(self.items) > 20 else ""
            raise BenchmarkError(f"{self.path}: {len(self.items)} problem(s)\n  {shown}{more}")


# ----------------------------------------------------------------------------- helpers
def outside(name: str) -> str | None:
    """Why a path a row names does not stay under the benchmark file's folder (a URL, absolute, climbing out with
    `..`): a benchmark reads only its own folder (a link placed in it is the user's to make); None where it stays."""
    from lt_opd_ray.sources.rows import path_problem

    problem = path_problem("file", name)
    if problem is None:
        return None
    return problem.replace("the data folder", "the benchmark's folder") + ": a benchmark reads only its own folder"


def image_of(value, folder: Path, row_id, problems: Problems):
    """bytes of a base64 image, or the path of an image file, that decodes; None (and a problem) otherwise."""
    from lt_opd_ray.models.processor import ImageError, decode_image

    if not value:
        problems.add(row_id, "no image")
        return None
    text = str(value)
    candidate = folder / text
    if len(text) < 512 and candidate.exists():
        if problem := outside(text):  # a file, but not the benchmark's (base64 may begin with "/": only files are judged)
            problems.add(row_id, problem)
            return None
        image = candidate
    else:
        try:
            image = base64.b64decode(text, validate=True)
        except (binascii.Error, ValueError):
            problems.add(row_id, f"image {text[:60]!r} is neither a file under {folder} nor base64")
            return None
    try:
        decode_image(image).close()  # decoded in full here, not first after the model has loaded
    except ImageError as exc:
        source = "the base64 data" if isinstance(image, bytes) else f"{image}"
        problems.add(row_id, f"image ({source}) {exc}")
        return None
    return image


FRAME_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp", ".bmp")


def video_of(value, folder: Path, row_id, problems: Problems, fps: float = 1.0):
    """A video file under `folder` that OpenCV opens with at least one frame (its path), or a folder of frame images
    (a Clip of them in name order, `fps` apart); None (and a problem) otherwise."""
    from lt_opd_ray.core.errors import InputError
    from lt_opd_ray.core.samples import Clip
    from lt_opd_ray.models.processor import read_clip

    if not value or not isinstance(value, str):
        problems.add(row_id, "no video")
        return None
    if problem := outside(value):
        problems.add(row_id, problem)
        return None
    path = folder / value
    if path.is_dir():
        frames = sorted(f for f in path.iterdir() if f.suffix.lower() in FRAME_SUFFIXES)
        if not frames:
            problems.add(row_id, f"video folder {path} holds no frame images ({', '.join(FRAME_SUFFIXES)})")
            return None
        return Clip.at_rate(frames, fps)
    if not path.is_file():
        problems.add(row_id, f"video {value!r} is neither a file nor a folder of frames under {folder}")
        return None
    try:
        read_clip(path, 1, "video")  # opens and decodes a frame, here rather than after the model has loaded
    except InputError as exc:
        problems.add(row_id, str(exc))
        return None
    return path


def row_id_of(row, key: str, default):
    """A row's id for messages, also when the row is not an object (`required` then names that)."""
    return row.get(key, default) if isinstance(row, dict) else default


LIST_FIELDS = ("options", "answers", "image_list", "candidates")  # text, or a list
ID_FIELDS = ("id", "index", "question_id")  # text, or an integer


def required(row, names: tuple[str, ...], row_id, problems: Problems) -> bool:
    """The row is an object whose `names` are present and text (ids may be integers, options and answers lists)."""
    if not isinstance(row, dict):
        problems.add(row_id, f"a row must be an object, got {type(row).__name__}")
        return False
    bad = [n for n in names if row.get(n) in (None, "")]
    for name in bad:
        problems.add(row_id, f"no {name}")
    for name in (n for n in names if n not in bad):
        value = row[name]
        allowed = (str, list) if name in LIST_FIELDS else (str, int) if name in ID_FIELDS else (str,)
        if not isinstance(value, allowed) or isinstance(value, bool):
            problems.add(row_id, f"{name} must be {' or '.join('a list' if t is list else 'text' if t is str else 'an integer' for t in allowed)},"
                                 f" got {type(value).__name__}")
            bad.append(name)
    return not bad


def read_tsv(path: Path) -> list[dict]:
    csv.field_size_limit(1 << 30)  # base64 images
    with path.open(newline="") as handle:
        return list(csv.DictReader(handle, delimiter="\t"))


def read_jsonl(path: Path, problems: Problems) -> list[dict]:
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            problems.add(f"line {number}", f"not JSON ({exc.msg})")
            continue
        if isinstance(row, dict):
            rows.append(row)
        else:
            problems.add(f"line {number}", f"a row must be a JSON object, got {type(row).__name__}")
    return rows


def read_json(path: Path, problems: Problems):
    """The parsed file, or None (and a problem) when it is not JSON."""
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        problems.add("file", f"not JSON ({exc.msg})")
        return None
