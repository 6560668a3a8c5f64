"""`lt-opd data`: a training set in the LT-14K layout -> verified parquet shards + manifest.

Sources:
- an LT-14K-style folder: `train.parquet` (sample_uid, question, [answer], [response]),
  `media.jsonl` (sample_uid, path, access bundled|url, archive, size_bytes, sha256)
  and the `images/*.tar` archives it names;
- a Hugging Face `datasets` folder (`save_to_disk`; columns sample_uid, question,
  [answer], [response], image or images);
- a JSONL or parquet file (sample_uid, question, [answer], [response], image path
  or images list of paths, [sha256], [video: a video file's path or a list of its
  frames' paths, with fps]) with its images and videos under `--images`.

Every row is checked: a question, a unique sample_uid, images that exist, have
the recorded size and SHA-256 (where the source records them) and decode (a bad one
named by its row and position), a video whose file decodes (OpenCV reads a frame of
it) or whose every frame decodes. Rows go into `shard-NNNNN.parquet` files
(sample_uid, question, answer, response, images: a list of image bytes, sha256: one
per image; a video row's `video` (the file's bytes) or `video_frames` (each frame's
bytes, at `fps`), and `video_sha256`; row groups of 64 so the loader reads one group
per image) written in
`<out>.incoming/`; `manifest.json` is written last and the folder renamed to
`<out>`, so an unfinished preparation never looks complete. An interrupted run
continues from its finished shards (`progress.json` records them and the source
they came from). Any bad row fails the run with a report naming every bad row,
and nothing is written under `<out>`.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from lt_opd_ray.core.regular_files import write_text_nofollow
from lt_opd_ray.core.errors import InputError
from lt_opd_ray.sources.rows import PREPARED_MANIFEST as MANIFEST

PROGRESS = "progress.json"
FORMAT = 2  # 2: an `images` list per row (and the video columns where a row has a video); 1 (read too): one `image` per row
ROW_GROUP = 64
TEXT_COLUMNS = ("sample_uid", "question", "answer", "response")  # a shard's columns beside the image and its sha256


class DataError(ValueError):
    """A source that cannot be prepared; the message lists every bad row."""


@dataclass(frozen=True)
class MediaAccess:
    """What a source's rows may read besides their embedded bytes and the regular files under the source's folder (a
    link in it followed only where it stays in it): web hosts to fetch from (none: a URL is refused), the non-public
    addresses (loopback, private, link-local, ...) those hosts may resolve to (addresses or networks: none, such a host
    is refused), and paths outside the folder (absolute, climbing out with `..`, or through a link)."""

    allowed_domains: tuple[str, ...] = ()
    outside_root: bool = False
    allowed_addresses: tuple = ()

    def read(self, name: str, folder: Path) -> bytes:
        """The bytes a row's path or URL names, under these rules; FileNotFoundError or ValueError saying why not."""
        from lt_opd_ray.sources.fetch import fetch
        from lt_opd_ray.sources.rows import OUTSIDE_WAY_OUT, URL, path_problem, read_confined

        if URL.match(name):
            return fetch(name, self.allowed_domains, self.allowed_addresses)
        if not self.outside_root and (problem := path_problem("path", name)):
            raise ValueError(f"{problem}; {OUTSIDE_WAY_OUT}")
        return read_confined("path", name, folder, self.outside_root)


@dataclass
class SourceRow:
    uid: str
    question: str | None
    answer: str | None
    read_images: list  # per image, () -> bytes, raising FileNotFoundError / ValueError with a reason
    sha256: list | None = None  # per image, where the source records it
    size_bytes: int | None = None  # of a single-image row's image, where the source records it (LT-14K's media.jsonl)
    problem: str | None = None  # why the source's line is not a row at all (then nothing else is checked)
    response: str | None = None  # the whole response written for the row, where the source has one
    read_video: list | None = None  # () -> bytes: one for a video file, one per frame for a video given as frames
    fps: float | None = None  # of a video given as frames (its frames' times are i / fps)


# ------------------------------------------------------------------------------ sources
def _lt14k_rows(folder: Path, access: MediaAccess) -> Iterator[SourceRow]:
    from lt_opd_ray.sources.rows import OUTSIDE_WAY_OUT, open_confined, path_problem, read_rows_raw

    media = {str(entry.get("sample_uid")): entry for _, entry in read_rows_raw(folder / "media.jsonl")}
    archives: dict[str, tarfile.TarFile] = {}

    def reader(entry: dict):
        def read() -> bytes:
            if entry.get("access") == "url":
                raise FileNotFoundError(f"media is a url ({entry.get('url')}); fetch it into a bundled archive first (no network here)")
            if not access.outside_root and (problem := path_problem("archive", str(entry.get("archive") or ""))):
                raise ValueError(f"{problem}; {OUTSIDE_WAY_OUT}")
            archive = folder / str(entry.get("archive") or "")
            if str(archive) not in archives:
                try:
                    handle = open_confined("archive", str(entry.get("archive") or ""), folder, access.outside_root)
                except FileNotFoundError:
                    raise FileNotFoundError(f"archive {entry.get('archive')!r} not found") from None
                archives[str(archive)] = tarfile.open(fileobj=handle)
            try:
                member = archives[str(archive)].extractfile(str(entry["path"]))
            except KeyError:
                member = None
            if member is None:
                raise FileNotFoundError(f"{entry.get('path')!r} is not in {entry.get('archive')}")
            return member.read()

        return read

    for _, row in read_rows_raw(folder / "train.parquet"):
        uid = str(row.get("sample_uid"))
        entry = media.get(uid)
        if entry is None:
            yield SourceRow(uid, row.get("question"), row.get("answer"), [_missing("no media.jsonl entry")], response=row.get("response"))
            continue
        yield SourceRow(uid, row.get("question"), row.get("answer"), [reader(entry)], [entry.get("sha256")], entry.get("size_bytes"),
                        response=row.get("response"))


def _hf_rows(folder: Path, access: MediaAccess) -> Iterator[SourceRow]:
    import datasets

    data = datasets.load_from_disk(str(folder))
    if isinstance(data, datasets.DatasetDict):
        data = data["train"]
    # every column read as stored (an image as {bytes, path}), never decoded: datasets' decoding of an Image, Audio or
    # Video feature opens any path and fetches any URL in it
    rows = (row for batch in data.with_format("arrow").iter(batch_size=64) for row in batch.to_pylist())
    for index, row in enumerate(rows):
        images = row["images"] if row.get("images") is not None else [row.get("image")]

        def reader(image):
            def read() -> bytes:
                if image is None:
                    raise FileNotFoundError("no image")
                if isinstance(image, bytes):
                    return image
                if isinstance(image, dict) and image.get("bytes"):
                    return image["bytes"]
                if isinstance(image, dict) and image.get("path"):
                    return access.read(image["path"], folder)
                raise ValueError(f"image of type {type(image).__name__} holds no bytes")

            return read

        yield SourceRow(str(row.get("sample_uid", index)), row.get("question"), row.get("answer"), [reader(image) for image in images],
                        _recorded(row.get("sha256")), response=row.get("response"))


def _file_rows(path: Path, images: Path, access: MediaAccess) -> Iterator[SourceRow]:
    from lt_opd_ray.sources.rows import images_problem, read_records, row_images, video_problem

    for number, row, problem in read_records(path):
        if problem := problem or images_problem(row) or video_problem(row):
            yield SourceRow(str((row or {}).get("sample_uid") or f"line {number}"), None, None, [], problem=problem)
            continue

        def reader(name):
            return lambda: access.read(str(name), images)

        video = row.get("video")
        yield SourceRow(str(row.get("sample_uid") or f"row {number}"), row.get("question"), row.get("answer"),
                        [reader(image) for image in row_images(row)], _recorded(row.get("sha256")), response=row.get("response"),
                        read_video=None if video is None else [reader(video)] if isinstance(video, str) else [reader(f) for f in video],
                        fps=None if video is None or isinstance(video, str) else float(row.get("fps") or 1.0))


def _recorded(sha256) -> list | None:
    """A row's recorded SHA-256 digests, one per image (a single-image row may give one string)."""
    return None if sha256 is None else [sha256] if isinstance(sha256, str) else list(sha256)


def _missing(reason: str):
    def read() -> bytes:
        raise FileNotFoundError(reason)

    return read


def source_rows(source: Path, images: Path | None = None, access: MediaAccess = MediaAccess()) -> Iterator[SourceRow]:
    if source.is_dir() and (source / "train.parquet").exists() and (source / "media.jsonl").exists():
        return _lt14k_rows(source, access)
    if source.is_dir() and ((source / "dataset_info.json").exists() or (source / "dataset_dict.json").exists()):
        return _hf_rows(source, access)
    if source.is_file() and source.suffix in (".jsonl", ".parquet"):
        return _file_rows(source, images or source.parent, access)
    raise DataError(
        f"{source}: not a source this command reads (an LT-14K folder with train.parquet + media.jsonl,"
        " a datasets save_to_disk folder, or a .jsonl / .parquet file)"
    )


# ------------------------------------------------------------------------------ prepare
def _check(row: SourceRow, seen: set[str]) -> tuple[list[bytes] | None, list[bytes] | None, list[str]]:
    """(images' bytes, video's bytes (the file, or each frame), problems) of one row; nothing where it has problems."""
    from lt_opd_ray.models.processor import ImageError, decode_image
    from lt_opd_ray.sources.rows import question_problem, response_problem

    if row.problem is not None:
        return None, None, [row.problem]
    problems = []
    if not row.question or not str(row.question).strip():
        problems.append("no question")
    elif problem := question_problem(row.question):
        problems.append(problem)
    if problem := response_problem(row.response):
        problems.append(problem)
    if row.uid in seen:
        problems.append("duplicate sample_uid")
    if row.sha256 is not None and len(row.sha256) != len(row.read_images):
        problems.append(f"{len(row.sha256)} recorded SHA-256 digest(s) for {len(row.read_images)} image(s)")
    images = []
    for position, read in enumerate(row.read_images):
        name = f"image {position}" if len(row.read_images) > 1 else "image"
        try:
            data = read()
        except (FileNotFoundError, ValueError, OSError, tarfile.TarError) as exc:
            problems.append(f"{name}: {exc}")
            continue
        if row.size_bytes is not None and len(data) != int(row.size_bytes):
            problems.append(f"{name} has {len(data)} bytes, media.jsonl says {row.size_bytes}")
        digest = hashlib.sha256(data).hexdigest()
        recorded = row.sha256[position] if row.sha256 and position < len(row.sha256) else None
        if recorded and digest != recorded:
            problems.append(f"{name} SHA-256 {digest[:12]}... does not match the recorded {str(recorded)[:12]}...")
        try:
            decode_image(data).close()
        except ImageError as exc:
            problems.append(f"{name} {exc}")
        images.append(data)
    video = _check_video(row, problems)
    if problems:
        return None, None, problems
    return images, video, problems


def _check_video(row: SourceRow, problems: list[str]) -> list[bytes] | None:
    """A row's video bytes (one video file, or each frame), each read and decoded; what fails is added to `problems`."""
    from lt_opd_ray.core.errors import InputError
    from lt_opd_ray.models.processor import ImageError, decode_image, read_clip

    if row.read_video is None:
        return None
    frames = row.fps is not None
    video = []
    for position, read in enumerate(row.read_video):
        name = f"video frame {position}" if frames else "video"
        try:
            data = read()
        except (FileNotFoundError, ValueError, OSError) as exc:
            problems.append(f"{name}: {exc}")
            continue
        try:
            if frames:
                decode_image(data).close()
            else:
                read_clip(VideoBytes(data), 1, name)  # OpenCV reads at least one frame of it
        except ImageError as exc:
            problems.append(f"{name} {exc}")
        except InputError as exc:
            problems.append(str(exc))
        video.append(data)
    return video


@dataclass(frozen=True)
class VideoBytes:
    """A video file's bytes in memory, read as a clip (models/processor.py `read_clip`) like a shard's video."""

    data: bytes

    def read(self) -> bytes:
        return self.data


def _fingerprint(source: Path) -> str:
    parts = [str(source.resolve())]
    for path in sorted([source] if source.is_file() else source.rglob("*")):
        if path.is_file():
            stat = path.stat()
            parts.append(f"{path.name}:{stat.st_size}:{int(stat.st_mtime)}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def prepare(source: str | Path, out: str | Path, images: str | Path | None = None, shard_rows: int = 1000,
            max_shards: int | None = None, progress=None, access: MediaAccess = MediaAccess()) -> dict | None:
    """Prepare `source` into `out`; returns the manifest, or None when `max_shards` stopped it early (run again)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    source, out = Path(source), Path(out)
    if (out / MANIFEST).exists():
        raise DataError(f"{out} is already a prepared data set; remove it or choose another folder")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):  # found now, not after the work
        raise DataError(f"{out} is {'a file' if not out.is_dir() else 'a folder that is not empty'}; --out must be a new or empty folder")
    if not source.exists():
        raise DataError(f"{source}: not found")
    rows = source_rows(source, Path(images) if images else None, access)  # a path that is no source is named before anything is written
    staging = out.with_name(out.name + ".incoming")
    fingerprint = _fingerprint(source)
    state = {"source": str(source), "fingerprint": fingerprint, "shards": [], "uids": []}
    if (staging / PROGRESS).exists():
        previous = json.loads((staging / PROGRESS).read_text())
        if previous.get("fingerprint") == fingerprint:
            state = previous  # resume: keep the finished shards
        else:
            shutil.rmtree(staging)
    staging.mkdir(parents=True, exist_ok=True)
    done_rows = sum(s["rows"] for s in state["shards"])
    seen, problems, batch, new_shards = set(state["uids"]), [], [], 0

    def flush() -> None:
        nonlocal batch, new_shards
        name = f"shard-{len(state['shards']):05d}.parquet"
        schema = pa.schema([*((k, pa.string()) for k in TEXT_COLUMNS), ("images", pa.list_(pa.binary())), ("sha256", pa.list_(pa.string())),
                            ("video", pa.binary()), ("video_frames", pa.list_(pa.binary())), ("fps", pa.float64()),
                            ("video_sha256", pa.list_(pa.string()))])
        table = pa.table({name: [r[name] for r in batch] for name in schema.names}, schema=schema)
        pq.write_table(table, staging / (name + ".tmp"), row_group_size=ROW_GROUP)
        os.replace(staging / (name + ".tmp"), staging / name)
        state["shards"].append({"file": name, "rows": len(batch), "sha256": hashlib.sha256((staging / name).read_bytes()).hexdigest()})
        state["uids"] += [r["sample_uid"] for r in batch]
        write_text_nofollow(staging / PROGRESS, json.dumps(state))
        batch, new_shards = [], new_shards + 1

    for index, row in enumerate(rows):
        if index < done_rows:
            continue  # in a finished shard of an earlier run
        data, video, row_problems = _check(row, seen)
        seen.add(row.uid)
        if row_problems:
            problems += [f"{row.uid}: {p}" for p in row_problems]
            continue
        batch.append({"sample_uid": row.uid, "question": str(row.question), "answer": None if row.answer is None else str(row.answer),
                      "response": row.response, "images": data, "sha256": [hashlib.sha256(image).hexdigest() for image in data],
                      "video": video[0] if video and row.fps is None else None, "video_frames": video if row.fps is not None else None,
                      "fps": row.fps, "video_sha256": None if video is None else [hashlib.sha256(part).hexdigest() for part in video]})
        if progress:
            progress(index + 1)
        if len(batch) == shard_rows and not problems:
            flush()
            if max_shards is not None and new_shards >= max_shards:
                return None
    if problems:
        shutil.rmtree(staging, ignore_errors=True)
        shown = "\n  ".join(problems[:50])
        more = f"\n  ... and {len(problems) - 50} more" if len(problems) > 50 else ""
        raise DataError(f"{source}: {len(problems)} problem(s), nothing written\n  {shown}{more}")
    if batch:
        flush()
    manifest = {"format": FORMAT, "source": str(source), "rows": len(state["uids"]), "shards": state["shards"]}
    (staging / PROGRESS).unlink()
    (staging / MANIFEST).write_text(json.dumps(manifest, indent=2))
    os.replace(staging, out)
    return manifest


# ------------------------------------------------------------------------------- loading
@dataclass(frozen=True)
class ShardImage:
    """One image inside a prepared shard, read on use (its row group only): image `position` of the row's `images`
    (or frame `position` of its `video_frames`), or a format-1 shard's one `image`, or a row's `video` file (bytes)."""

    shard: str
    row: int
    position: int = 0
    column: str = "images"

    def read(self) -> bytes:
        import pyarrow.parquet as pq

        group, offset = divmod(self.row, ROW_GROUP)
        cell = pq.ParquetFile(self.shard).read_row_group(group, columns=[self.column]).column(self.column)[offset].as_py()
        return cell[self.position] if isinstance(cell, list) else cell


def _shard_video(shard: str, row: int, digests: list | None, fps: float | None):
    """A row's video as a Sample holds it (`digests`: one per frame, or one for the file): its frames read on use at
    their times i / fps, or its file's bytes read on use (models/processor.py `read_clip` decodes them), or None."""
    from lt_opd_ray.core.samples import Clip

    if digests is None:
        return None
    if fps is None:
        return ShardImage(shard, row, column="video")
    frames = tuple(ShardImage(shard, row, position, "video_frames") for position in range(len(digests)))
    return Clip.at_rate(frames, fps)


def read_prepared(folder: str | Path):
    """The samples of a prepared folder (images read lazily), in manifest order; shards are checked against it, and a
    manifest or shard that does not read is an InputError naming it."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from lt_opd_ray.core.samples import Sample

    folder = Path(folder)
    try:
        manifest = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
        shards = [(str(shard["file"]), int(shard["rows"])) for shard in manifest["shards"]]
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as exc:
        raise InputError(f"{folder / MANIFEST}: not a manifest `lt-opd data` wrote ({type(exc).__name__}: {str(exc)[:120]});"
                         " prepare the folder again") from None
    samples = []
    for file, rows in shards:
        path = folder / file
        if not path.is_file():
            raise InputError(f"{folder}: shard {file} named by the manifest is missing")
        try:
            present = set(pq.read_schema(path).names)  # a shard written before `response` existed has no such column
            column = "images" if "images" in present else "image"  # format 1: one image per row
            videos = [c for c in ("fps", "video_sha256") if c in present]  # the video's bytes are read on use only
            table = pq.read_table(path, columns=[c for c in TEXT_COLUMNS if c in present] + ["sha256"] + videos)
        except (pa.ArrowException, OSError) as exc:
            raise InputError(f"{path}: not a readable shard ({str(exc).splitlines()[0][:160]}); prepare the folder again") from None
        if table.num_rows != rows:
            raise InputError(f"{path}: {table.num_rows} rows, the manifest says {rows}")
        columns = [table.column(c).to_pylist() if c in table.column_names else [None] * rows for c in TEXT_COLUMNS]
        digests = table.column("sha256").to_pylist()  # one per image (format 1: one string)
        fps, video_digests = (table.column(c).to_pylist() if c in table.column_names else [None] * rows for c in ("fps", "video_sha256"))
        for row, (uid, question, answer, response) in enumerate(zip(*columns)):
            count = len(digests[row]) if column == "images" else 1
            images = tuple(ShardImage(str(path), row, position, column) for position in range(count))
            video = _shard_video(str(path), row, video_digests[row], fps[row])
            samples.append(Sample(uid=uid, images=images, question=question, answer=answer, response=response, video=video))
    return samples
