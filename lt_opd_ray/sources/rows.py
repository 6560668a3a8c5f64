"""Training rows read from JSONL / parquet files: (sample_uid, image or images and/or video, question[, answer][,
response]), every problem of a file named at once. `image` is one path; `images` a list of paths, shown in that order
(MuirBench-style prompts); `video` a video file's path, or a list of its frames' paths (with `fps`, default 1: the
frames' rate), shown after the images (MVBench-style prompts; sampled to `data.frames` frames)."""

from __future__ import annotations

import errno
import json
import os
import re
import stat
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import BinaryIO

from lt_opd_ray.core.errors import InputError
from lt_opd_ray.core.samples import Clip, Sample

DATA_SUFFIXES = (".jsonl", ".parquet")  # the row files `load_samples` reads
PREPARED_MANIFEST = "manifest.json"  # what marks a folder `lt-opd data` prepared (written last)
MAX_QUESTION_CHARS = 65_536  # a question is a sentence or a page, never a document: longer is refused per row
URL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*://")
REQUIRED_FIELDS = ("sample_uid", "question")  # and an image (`image`: one path, or `images`: a list of paths) or a `video`


def question_problem(question: object) -> str | None:
    if not isinstance(question, str):
        return f"question must be text, got {type(question).__name__}"
    if len(question) > MAX_QUESTION_CHARS:
        return f"question has {len(question):,} characters, above the {MAX_QUESTION_CHARS:,} a row may have"
    return None


def response_problem(response: object) -> str | None:
    """A row's optional `response` (the whole answer written for it) is text when given."""
    if response is not None and not isinstance(response, str):
        return f"response must be text, got {type(response).__name__}"
    if isinstance(response, str) and len(response) > MAX_QUESTION_CHARS:
        return f"response has {len(response):,} characters, above the {MAX_QUESTION_CHARS:,} a row may have"
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


def read_rows(path: str | Path, image_root: str | Path = ".", allow_outside_root: bool = False) -> list[Sample]:
    """Rows of a JSONL or parquet file; each must have sample_uid, image (path), question, its files regular files
    under `image_root` (followed through their links) unless `allow_outside_root`. Every problem of the file is named
    in one InputError."""
    path = Path(path)
    where = "row" if path.suffix == ".parquet" else "line"
    samples, seen, problems, missing, files = [], {}, [], [], 0
    for number, row, problem in read_records(path):
        if problem := problem or _row_problem(row, seen, where) or outside_problem(row, allow_outside_root):
            problems.append(f"{where} {number}: {problem}")
            continue
        absent, problem = _files_problem(row, image_root, allow_outside_root)
        if problem:
            problems.append(f"{where} {number}: {problem}")
            continue
        uid = str(row["sample_uid"])
        seen[uid] = number
        images = tuple(Path(image_root) / image if isinstance(image, str) else image for image in row_images(row))
        samples.append(Sample(uid=uid, images=images, question=str(row["question"]), answer=row.get("answer"), response=row.get("response"),
                              video=row_video(row, image_root)))
        missing += [(number, position, file) for position, file in absent]
        files += len(_named_files(row))
    if missing:
        shown = "; ".join(f"{where} {number}" + (f" image {position}" if isinstance(position, int) and position else f" {position}" if position else "")
                          + f": {image}" for number, position, image in missing[:3])
        kinds = "image or video" if any(sample.video is not None for sample in samples) else "image"
        problems.append(f"{len(missing)} of {files} {kinds} file(s) not found under image_root {image_root}"
                        f" ({shown}{'; ...' if len(missing) > 3 else ''})")
    if problems:
        raise InputError(listed(path, problems))
    return samples


def _named_files(row: dict) -> list[tuple[int | str, str, str]]:
    """(position, kind, name) of every file a row names: its images (position 0, 1, ...), then its video file
    ("video") or each of its frames ("video frame N")."""
    video = row.get("video")
    frames = [("video", "video", video)] if isinstance(video, str) else [(f"video frame {i}", "video frame", f) for i, f in enumerate(video or [])]
    return [(position, "image", image) for position, image in enumerate(row_images(row)) if isinstance(image, str)] + frames


def _files_problem(row: dict, root: str | Path, allow_outside: bool) -> tuple[list[tuple[int | str, Path]], str | None]:
    """(the row's files that are not there, as (position, path)), or the first of its files that `confined_file`
    refuses (a link out of the root, a dangling link or a loop, no regular file)."""
    absent = []
    for position, kind, name in _named_files(row):
        try:
            confined_file(kind, name, root, allow_outside)
        except FileNotFoundError:
            absent.append((position, Path(root) / name))
        except ValueError as exc:
            return [], str(exc)
    return absent, None


def row_images(row: dict) -> list:
    """A row's images: its `images` list, or its one `image`, or none (a video row)."""
    return list(row["images"]) if "images" in row else [row["image"]] if "image" in row else []


def row_video(row: dict, root: str | Path = ".") -> Path | Clip | None:
    """A row's video: a file's path, or its listed frames (paths) at the row's `fps` (default 1), or None."""
    video = row.get("video")
    if video is None:
        return None
    if isinstance(video, str):
        return Path(root) / video
    fps = float(row.get("fps") or 1.0)
    return Clip.at_rate((Path(root) / frame for frame in video), fps)


def video_files(video) -> list[Path]:
    """The files a row's video reads: the video file, or each listed frame."""
    if isinstance(video, Path):
        return [video]
    return [frame for frame in video.frames if isinstance(frame, Path)] if isinstance(video, Clip) else []


def video_problem(row: dict) -> str | None:
    """What is wrong with a row's `video` (a non-empty path, or a non-empty list of frame paths) and `fps` (a positive
    number, with a frames list)."""
    video, fps = row.get("video"), row.get("fps")
    if video is None:
        return None if fps is None else "`fps` without a `video` list of frames"
    if isinstance(video, str):
        return None if video and fps is None else "`video` is an empty path" if not video else "`fps` is for a `video` list of frames; a video file carries its own"
    if not isinstance(video, (list, tuple)) or not video:
        return f"`video` must be a video file's path or a non-empty list of frame paths, got {type(video).__name__ if video else 'an empty one'}"
    if empty := [str(position) for position, frame in enumerate(video) if not isinstance(frame, str) or not frame]:
        return f"`video` frames {', '.join(empty)} are not paths"
    if fps is not None and (isinstance(fps, bool) or not isinstance(fps, (int, float)) or fps <= 0):
        return f"`fps` must be a positive number, got {fps!r}"
    return None


def outside_problem(row: dict, allowed: bool = False) -> str | None:
    """The first of a row's image and video paths that does not stay under its data folder (`path_problem`), with
    the way out; a URL is refused even where paths outside the folder are `allowed` (training rows fetch nothing)."""
    video = row.get("video")
    named = [("image", p) for p in row_images(row)] + ([("video", video)] if isinstance(video, str) else [("video frame", f) for f in video or []])
    for kind, name in named:
        if isinstance(name, str) and (problem := path_problem(kind, name)):
            if URL.match(name):
                return f"{problem}; fetch it into the folder first (`lt-opd data --allowed-media-domains HOST` does while preparing)"
            if not allowed:
                return f"{problem}; {OUTSIDE_WAY_OUT}"
    return None


OUTSIDE_WAY_OUT = "keep the files under it, or allow this (data.allow_outside_root: true; lt-opd data --allow-outside-root)"


def path_problem(kind: str, name: str) -> str | None:
    """Why a path a row names does not stay under its data folder: a URL, an absolute path, or one climbing out with
    `..`; None where it stays by its name (where its links lead is `confined_file`'s to judge)."""
    path = PurePosixPath(name.replace("\\", "/"))
    if URL.match(name):
        return f"{kind} {name!r} is a URL, not a file under the data folder"
    if path.is_absolute() or PureWindowsPath(name).is_absolute():
        return f"{kind} {name!r} is an absolute path, outside the data folder"
    if ".." in path.parts:
        return f"{kind} {name!r} climbs out of the data folder with .."
    return None


NOT_REGULAR = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
               (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def confined_file(kind: str, name: str, root: str | Path, allow_outside: bool = False) -> tuple[Path, os.stat_result]:
    """The real path and the status of the regular file a row's `name` names under `root`, every link on the way
    followed: FileNotFoundError ("<path> not found") where nothing is there; a ValueError, one sentence naming `kind`
    and `name`, where a link leads out of the resolved root (unless `allow_outside`; `path_problem` is checked
    before), dangles or loops, or what is there is no regular file (a FIFO would hang the reader)."""
    file = Path(root) / name
    real, top = Path(os.path.realpath(file)), Path(os.path.realpath(root))
    if not allow_outside and not real.is_relative_to(top):
        raise ValueError(f"{kind} {name!r} leads out of the data folder through a link (to {real}); {OUTSIDE_WAY_OUT}")
    try:
        real = Path(os.path.realpath(file, strict=True))
        status = os.stat(real)
    except FileNotFoundError:
        link = next((p for p in (file, *file.parents) if p.is_symlink() and not p.exists()), None)
        if link is not None:
            raise ValueError(f"{kind} {name!r} goes through the link {link}, whose target {os.readlink(link)} does not exist") from None
        raise FileNotFoundError(f"{file} not found") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise ValueError(f"{kind} {name!r} goes through a loop of links") from None
        raise ValueError(f"{kind} {name!r} cannot be read ({exc.strerror})") from None
    if not allow_outside and not real.is_relative_to(top):  # changed since the first look
        raise ValueError(f"{kind} {name!r} leads out of the data folder through a link (to {real}); {OUTSIDE_WAY_OUT}")
    if not stat.S_ISREG(status.st_mode):
        what = next((what for test, what in NOT_REGULAR if test(status.st_mode)), "of no kind a file is")
        where = f" (at {real})" if str(real) != os.path.normpath(file.absolute()) else ""
        raise ValueError(f"{kind} {name!r} is {what}{where}, not a regular file")
    return real, status


def open_confined(kind: str, name: str, root: str | Path, allow_outside: bool = False) -> BinaryIO:
    """The file `confined_file` checked, opened (binary) as that very file: no link followed in its last component, no
    wait on a FIFO, and a ValueError naming `kind` and `name` where what opened is not the file checked (a path
    component swapped since)."""
    real, checked = confined_file(kind, name, root, allow_outside)
    try:
        fd = os.open(real, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise ValueError(f"{kind} {name!r} changed after it was checked and was not read ({exc.strerror})") from None
    handle = os.fdopen(fd, "rb")
    opened = os.fstat(fd)
    if (opened.st_dev, opened.st_ino) != (checked.st_dev, checked.st_ino) or not stat.S_ISREG(opened.st_mode):
        handle.close()
        raise ValueError(f"{kind} {name!r} changed after it was checked (another file is there now) and was not read")
    return handle


def read_confined(kind: str, name: str, root: str | Path, allow_outside: bool = False) -> bytes:
    """The bytes of the file a row names, under `open_confined`'s rules."""
    with open_confined(kind, name, root, allow_outside) as handle:
        return handle.read()


def images_problem(row: dict) -> str | None:
    """What is wrong with a row's image fields: exactly one of `image` (one path) and `images` (a non-empty list of
    paths), no empty entry."""
    if "image" in row and "images" in row:
        return "both `image` and `images`: give one path as `image` or a list as `images`"
    if "images" in row:
        images = row["images"]
        if not isinstance(images, (list, tuple)) or not images:
            return f"`images` must be a non-empty list of image paths, got {type(images).__name__ if images else 'an empty one'}"
        if empty := [str(position) for position, image in enumerate(images) if not image]:
            return f"`images` entries {', '.join(empty)} are empty"
        return None
    return None if row.get("image") or row.get("video") is not None else "missing field(s) image (or images, or video)"


def _row_problem(row: dict, seen: dict[str, int], where: str) -> str | None:
    if missing := [f for f in REQUIRED_FIELDS if not row.get(f)]:
        return f"missing field(s) {', '.join(missing)}"
    if problem := images_problem(row) or video_problem(row):
        return problem
    if (uid := str(row["sample_uid"])) in seen:
        return f"duplicate sample_uid {uid!r} (first at {where} {seen[uid]})"
    return question_problem(row["question"]) or response_problem(row.get("response"))
