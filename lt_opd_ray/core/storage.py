"""Where a run's outputs live: a folder (on a cluster, a shared volume) or a URI that `pyarrow.fs` opens
(`s3://`, `gs://`, `hdfs://`, `abfs://`, `file://`).

A run always writes into a local folder first. For a plain path that folder *is* the
storage. For a URI it is a staging folder on each node (`checkpoint.staging_dir`, the
same path on every node), and each finished piece is uploaded and its local copy removed:

- a checkpoint: each node's files by one learner rank on that node (they hash what they
  upload), the driver's own files by the driver, then its manifest, then `latest`;
- the step log after every update, `final/` (with `config.json` last), tracking files at the end.

Object stores rename nothing atomically, so a checkpoint there is complete when its
manifest exists (it is uploaded last) and every file has the manifest's size; SHA-256
is checked after a download, by the node that downloaded.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import tempfile
from pathlib import Path

from lt_opd_ray.core.redact import redact
from lt_opd_ray.core.regular_files import irregular_entry, write_text_nofollow

URI = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*)://")
SCHEMES = ("file", "s3", "gs", "gcs", "hdfs", "viewfs", "abfs", "abfss", "mock")  # what pyarrow.fs.FileSystem.from_uri opens


RUN_RECORD = "run.json"  # which run a folder holds: its id, job, when it started, what it resumed


class StorageError(RuntimeError):
    pass


def is_uri(location: str) -> bool:
    return URI.match(location) is not None


def check_location(location: str) -> str:
    """A plain path, or a URI of a scheme pyarrow opens (the storage itself is reached at preflight)."""
    match = URI.match(location)
    if match and match.group(1).lower() not in SCHEMES:
        raise ValueError(f"{redact(location)!r}: unknown storage scheme {match.group(1)!r}; use a path or one of {', '.join(s + '://' for s in SCHEMES[:-1])}")
    return location


def default_staging(location: str) -> Path:
    """Per storage location, the same folder on every node: under this user's own folder of the temporary directory
    (`private_folder`: made 0700, refused when another user made it first or it is a link)."""
    root = private_folder(Path(tempfile.gettempdir()) / f"lt-opd-ray-{os.getuid()}")
    return root / "staging" / hashlib.sha256(location.encode()).hexdigest()[:16]


def private_folder(path: Path, create: bool = True) -> Path:
    """`path`, a folder only this user can write: made 0700 where missing (unless not `create`: then a missing one is
    left for the writes to make); refused (StorageError) when it is a link, not a folder, another user's, or writable
    by its group or others (in a shared /tmp, whoever makes the name first owns it: a folder someone else made could
    be read, or have links planted in it, before anything is uploaded)."""
    import stat

    if not create and not os.path.lexists(path):
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        path.mkdir(mode=0o700)
    except FileExistsError:
        pass
    info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        raise StorageError(f"{path}: {'a link' if stat.S_ISLNK(info.st_mode) else 'not a folder'}, where this user's private folder belongs;"
                           " remove it, or set checkpoint.staging_dir to a folder of your own")
    if info.st_uid != os.getuid() or info.st_mode & 0o022:
        why = f"owned by uid {info.st_uid}" if info.st_uid != os.getuid() else f"writable by others (mode {stat.S_IMODE(info.st_mode):o})"
        raise StorageError(f"{path}: {why}, not a private folder of uid {os.getuid()}; remove it, or set checkpoint.staging_dir to a"
                           " folder of your own")
    return path


class RunStorage:
    """A run's folder: `local` is where this process reads and writes; for a URI, `put` / `get` move pieces
    between it and the storage (for a plain path both are no-ops: the folder is the storage)."""

    def __init__(self, location: str, staging: str | Path | None = None):
        self.location = location
        if is_uri(location):
            import pyarrow.fs as pafs

            try:
                self.fs, self.base = pafs.FileSystem.from_uri(location)
            except Exception as exc:  # noqa: BLE001 - pyarrow raises ArrowInvalid, OSError, ... : all mean "cannot open"
                raise StorageError(redact(f"cannot open {location}: {str(exc).splitlines()[0]}")) from None
            self.base = self.base.rstrip("/")
            self.local = private_folder(Path(staging), create=False) if staging else default_staging(location)
        else:
            self.fs, self.base = None, None
            self.local = Path(location)
        self.local = self.local.resolve()

    @property
    def remote(self) -> bool:
        return self.fs is not None

    def describe(self, rel: str = "") -> str:
        """Where `rel` lives, for messages: the URI (its credentials hidden) or the local path."""
        if not self.remote:
            return str(self.local / rel) if rel else str(self.local)
        return redact(f"{self.location.rstrip('/')}/{rel}" if rel else self.location)

    def _path(self, rel: str) -> str:
        return f"{self.base}/{rel}" if rel else self.base

    # ------------------------------------------------------------------ listing and reading
    def check_reachable(self) -> None:
        """Raises StorageError unless the storage answers (preflight: before any actor starts)."""
        if self.remote:
            try:
                self.fs.get_file_info(self.base)
            except Exception as exc:  # noqa: BLE001
                raise StorageError(redact(f"{self.location}: not reachable ({str(exc).splitlines()[0][:200]})")) from None

    def names(self) -> list[str]:
        """The names at the top of the run's folder."""
        if not self.remote:
            return sorted(p.name for p in self.local.iterdir()) if self.local.is_dir() else []
        import pyarrow.fs as pafs

        infos = self.fs.get_file_info(pafs.FileSelector(self.base, allow_not_found=True))
        return sorted(info.base_name for info in infos)

    def is_dir(self, rel: str) -> bool:
        if not self.remote:
            return (self.local / rel).is_dir()
        import pyarrow.fs as pafs

        return self.fs.get_file_info(self._path(rel)).type == pafs.FileType.Directory

    def sizes(self, rel: str) -> dict[str, int] | None:
        """Every file under `rel` with its size in bytes (paths relative to `rel`), or None when `rel` is absent."""
        if not self.remote:
            folder = self.local / rel
            return {str(p.relative_to(folder)): p.stat().st_size for p in folder.rglob("*") if p.is_file()} if folder.is_dir() else None
        import pyarrow.fs as pafs

        root = self._path(rel)
        infos = self.fs.get_file_info(pafs.FileSelector(root, recursive=True, allow_not_found=True))
        if not infos and self.fs.get_file_info(root).type != pafs.FileType.Directory:
            return None
        return {info.path[len(root) + 1 :]: info.size for info in infos if info.type == pafs.FileType.File}

    def read_text(self, rel: str) -> str | None:
        if not self.remote:
            path = self.local / rel
            return path.read_text() if path.is_file() else None
        import pyarrow.fs as pafs

        if self.fs.get_file_info(self._path(rel)).type != pafs.FileType.File:
            return None
        with self.fs.open_input_stream(self._path(rel)) as f:
            return f.read().decode()

    # ------------------------------------------------------------------ writing
    def write_text(self, rel: str, text: str) -> None:
        """Replace `rel` whole (locally through a rename; an object store's PUT is atomic)."""
        path = self.local / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_nofollow(path, text)
        self.put(rel)

    def put(self, rel: str, last: tuple[str, ...] = (), to: str | None = None) -> None:
        """Upload the local file or folder `rel` to the storage's `to` (default `rel`), over what is there; a
        folder's files named in `last` are written after every other is complete."""
        if not self.remote:
            return
        import pyarrow.fs as pafs

        source, to = self.local / rel, to or rel
        if source.is_file():
            self.fs.create_dir(self._path(to).rsplit("/", 1)[0], recursive=True)
            pafs.copy_files(str(source), self._path(to), destination_filesystem=self.fs)
            return
        files = sorted((p for p in source.rglob("*") if p.is_file()), key=lambda p: (p.name in last, str(p)))
        for path in files:
            target = self._path(f"{to}/{path.relative_to(source)}")
            self.fs.create_dir(target.rsplit("/", 1)[0], recursive=True)
            pafs.copy_files(str(path), target, destination_filesystem=self.fs)

    def get(self, rel: str, into: Path | None = None) -> Path | None:
        """Download `rel` (file or folder) into `into` (default: the same place in the local folder); None when
        the storage has no `rel`."""
        target = into or self.local / rel
        if not self.remote:
            return target if target.exists() else None
        import pyarrow.fs as pafs

        kind = self.fs.get_file_info(self._path(rel)).type
        if kind == pafs.FileType.NotFound:
            return None
        if isinstance(self.fs, pafs.LocalFileSystem):  # pyarrow copies a link's target as a file: none is read through one
            source = Path(self._path(rel))
            irregular = irregular_entry(source) if kind == pafs.FileType.Directory else None
            if irregular or source.is_symlink() or (kind == pafs.FileType.File and not source.is_file()):
                raise StorageError(irregular or f"{source}: a link or not a regular file; a run's storage holds regular files only")
        if target.exists():
            shutil.rmtree(target) if target.is_dir() else target.unlink()
        (target if kind == pafs.FileType.Directory else target.parent).mkdir(parents=True, exist_ok=True)  # pyarrow makes subfolders only
        pafs.copy_files(self._path(rel), str(target), source_filesystem=self.fs, use_threads=True)
        return target

    def delete(self, rel: str) -> None:
        if self.remote:
            self.fs.delete_dir(self._path(rel))
        else:
            shutil.rmtree(self.local / rel, ignore_errors=True)

    def rename(self, rel: str, to: str) -> None:
        """Folder `rel` renamed `to` inside the run folder (object stores: copied, then removed)."""
        if not self.remote:
            os.replace(self.local / rel, self.local / to)
            return
        import pyarrow.fs as pafs

        pafs.copy_files(self._path(rel), self._path(to), source_filesystem=self.fs, destination_filesystem=self.fs, use_threads=True)
        self.fs.delete_dir(self._path(rel))

    def move_aside(self, suffix: str) -> str:
        """Move the whole run folder to a sibling named `<name><suffix>` (nothing deleted); returns where."""
        if not self.remote:
            aside = self.local.with_name(self.local.name + suffix)
            self.local.rename(aside)
            return str(aside)
        import pyarrow.fs as pafs

        aside = self.base + suffix
        pafs.copy_files(self.base, aside, source_filesystem=self.fs, destination_filesystem=self.fs, use_threads=True)
        self.fs.delete_dir(self.base)  # object stores cannot rename a folder: copied, then removed
        shutil.rmtree(self.local, ignore_errors=True)
        return redact(f"{self.location.rstrip('/')}{suffix}")
