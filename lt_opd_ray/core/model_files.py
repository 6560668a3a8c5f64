"""A student folder checked before anything loads it: a run's `final/` and every `lt-opd export` output list their
files and sizes in `lt_opd_files.json`; `lt-opd export`, `eval` and `serve` check a folder against its list and read
every safetensors file's header, so a file cut short or overwritten is named by path, not met as a crash inside a
loader. A folder without a list (a model from elsewhere) gets the header check alone. Sizes and headers, not
hashes: a check that costs nothing at an 8 GB student's every start.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

FILE_LIST = "lt_opd_files.json"
UNLISTED = (FILE_LIST, ".lt-opd-output.json")  # the list itself, and the marker of the command that wrote the folder


class ModelFolderError(ValueError):
    """A model folder that cannot be trusted to load, naming the file."""


def write_file_list(folder: Path) -> None:
    """`lt_opd_files.json`: every file of `folder` (but the list and the output marker) with its size."""
    files = {p.relative_to(folder).as_posix(): p.stat().st_size for p in sorted(folder.rglob("*")) if p.is_file() and p.name not in UNLISTED}
    (folder / FILE_LIST).write_text(json.dumps({"format": 1, "files": files}, indent=1) + "\n")


def check_model_folder(folder: Path) -> None:
    """Raises ModelFolderError naming the first listed file that is missing or not at its size, or the first
    safetensors file whose header does not parse or whose tensors run past its end."""
    folder = Path(folder)
    listed = folder / FILE_LIST
    if listed.exists():
        try:
            files = dict(json.loads(listed.read_text())["files"])
        except (ValueError, KeyError, TypeError) as exc:
            raise ModelFolderError(f"{listed}: unreadable ({exc!r})") from None
        for name, size in files.items():
            path = folder / name
            if not path.is_file():
                raise ModelFolderError(f"{path}: missing (listed in {FILE_LIST})")
            if path.stat().st_size != size:
                raise ModelFolderError(f"{path}: {path.stat().st_size} bytes, {FILE_LIST} says {size} (cut short or overwritten)")
    for path in sorted(folder.glob("*.safetensors")):
        if problem := _safetensors_problem(path):
            raise ModelFolderError(f"{path}: {problem}")


def _safetensors_problem(path: Path) -> str | None:
    """What is wrong with a safetensors file's layout: an 8-byte little-endian header length, a JSON header, and
    every tensor's data inside the file."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return f"{size} bytes: not a safetensors file (no header length)"
        (length,) = struct.unpack("<Q", head)
        if length > size - 8:
            return f"header of {length} bytes in a file of {size}: cut short"
        try:
            header = json.loads(f.read(length))
        except ValueError as exc:
            return f"header does not parse ({exc})"
    end = max((entry["data_offsets"][1] for key, entry in header.items() if key != "__metadata__"), default=0)
    if 8 + length + end > size:
        return f"its tensors end at byte {8 + length + end}, the file has {size}: cut short"
    return None
