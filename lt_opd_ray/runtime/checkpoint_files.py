"""What makes a checkpoint folder trustworthy: a manifest of its files (size, SHA-256) checked before anything
loads, and pickles that load weights-only.

A checkpoint written by this package holds `manifest.json`; at resume and export every
file is checked against it (random bytes over the weights, a truncated optimizer file
or a hand-edited driver_state.json are caught here, by name, not by NaNs two steps
later), and every `.pt` is opened with `torch.load(weights_only=True)`, which refuses
any pickle that would run code. Only the three non-tensor types DeepSpeed itself
pickles are allowed beside tensors and plain containers. A checkpoint folder holds regular files and folders only:
a link (dangling, or to anything), a FIFO, a socket or a device anywhere in it makes it untrusted, and nothing is
read through a link. `private_copy` copies the files the manifest names into a folder only this user can write,
hashing the bytes it copies: what a loader then reads is what was hashed.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import stat
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from lt_opd_ray.core.regular_files import irregular_entry, kind_of, write_text_nofollow

MANIFEST = "manifest.json"
HASH_THREADS = 8
DISK_FULL_MARGIN_BYTES = 64 << 20  # a failed write with less than this left is reported as a full disk


class CheckpointError(RuntimeError):
    pass


def deepspeed_pickled_types() -> list:
    """The classes DeepSpeed (ZeRO-2 and ZeRO-3) writes into its checkpoints besides tensors and containers."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, ZeroStageEnum, fragment_address]


def load_weights_only(path: Path, mmap: bool = False):
    """torch.load that runs no code from the file; names the file and the refused type otherwise."""
    import pickle

    import torch

    try:
        with torch.serialization.safe_globals(deepspeed_pickled_types()):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as exc:
        refused = next((line.strip() for line in str(exc).splitlines() if "GLOBAL" in line), str(exc).splitlines()[0])
        raise CheckpointError(f"{path}: refused, the file is not weights-only ({refused[:200]}); load it only if you trust its source") from None
    except (RuntimeError, EOFError, OSError) as exc:
        raise CheckpointError(f"{path}: unreadable ({str(exc).splitlines()[0][:200]})") from None


STEP_TAG = re.compile(r"step-([0-9]+)", re.ASCII)


def step_of(name: str) -> int | None:
    """N of a checkpoint name a run writes (`step-N`, ASCII digits), else None (`step-²`, `step-1/..`, anything else)."""
    match = STEP_TAG.fullmatch(name)
    return int(match.group(1)) if match else None


def open_regular(path: Path):
    """`path` opened for reading, refused unless it is a regular file reached without a link at its last component
    (O_NOFOLLOW: a link swapped in after a check is not followed) and without blocking on a FIFO (O_NONBLOCK)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise CheckpointError(f"{path}: a link; a checkpoint folder holds regular files only, and none is read through a link") from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise CheckpointError(f"{path}: not a regular file ({kind_of(os.lstat(path).st_mode)}); a checkpoint folder holds regular files only")
    return os.fdopen(fd, "rb")


@contextmanager
def weights_only_loads():
    """Every torch.load in the block weights-only, whatever its caller passes (torch's TORCH_FORCE_WEIGHTS_ONLY_LOAD),
    DeepSpeed's own pickled types allowed: for a reader of ours that unpickles with weights_only=False (DeepSpeed's
    zero_to_fp32)."""
    import torch

    before = os.environ.get("TORCH_FORCE_WEIGHTS_ONLY_LOAD")
    os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = "1"
    try:
        with torch.serialization.safe_globals(deepspeed_pickled_types()):
            yield
    finally:
        if before is None:
            del os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"]
        else:
            os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = before


def sha256(path: Path) -> str:
    with open_regular(path) as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def private_copy(folder: Path, names: dict[str, list], into: Path) -> None:
    """Copy the files `names` lists (relative path -> [bytes, sha256]) from `folder` into `into`, a new folder only
    this user can enter (0700), hashing the bytes as they are copied: a file that differs from its digest, or is
    swapped for a link or a FIFO during the copy, is refused and `into` removed. Loaders then read the copy."""
    into.mkdir(mode=0o700, parents=False)
    try:
        for name, (size, digest) in names.items():
            target = into / name
            target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            hasher = hashlib.sha256()
            with open_regular(folder / name) as source, open(os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600), "wb") as out:
                while block := source.read(1 << 24):
                    hasher.update(block)
                    out.write(block)
            if hasher.hexdigest() != digest or target.stat().st_size != size:
                raise CheckpointError(f"{folder / name}: SHA-256 differs from the manifest (the file was changed after it was written)")
    except BaseException:
        shutil.rmtree(into, ignore_errors=True)
        raise


def file_digests(folder: Path) -> dict[str, list]:
    """Every file under `folder` but a manifest: path relative to `folder` -> [bytes, sha256]."""
    paths = sorted(p for p in folder.rglob("*") if p.is_file() and not p.is_symlink() and p.name != MANIFEST)
    with ThreadPoolExecutor(HASH_THREADS) as pool:  # hashlib releases the GIL: files hash in parallel
        digests = list(pool.map(sha256, paths))
    return {str(p.relative_to(folder)): [p.stat().st_size, d] for p, d in zip(paths, digests)}


@dataclass(frozen=True)
class Manifest:
    run_id: str  # the run (a fresh start and every resume of it) that wrote this checkpoint
    step: int
    written_at: float
    files: dict[str, list]  # path relative to the checkpoint -> [bytes, sha256]

    @classmethod
    def of(cls, folder: Path, run_id: str, step: int) -> Manifest:
        return cls(run_id, step, time.time(), file_digests(folder))

    def text(self) -> str:
        return json.dumps(asdict(self), indent=1)

    def write(self, folder: Path) -> None:
        write_text_nofollow(folder / MANIFEST, self.text())

    @classmethod
    def read(cls, folder: Path) -> Manifest:
        path = folder / MANIFEST
        if not os.path.lexists(path):
            return cls.parse(None, str(path))
        with open_regular(path) as f:
            return cls.parse(f.read().decode("utf-8", errors="replace"), str(path))

    @classmethod
    def parse(cls, text: str | None, where: str) -> Manifest:
        """The manifest in `text` (None: there is none at `where`)."""
        if text is None:
            raise CheckpointError(f"{where}: missing (an unfinished checkpoint, or one written before manifests)")
        try:
            data = json.loads(text)
            manifest = cls(str(data["run_id"]), int(data["step"]), float(data["written_at"]), dict(data["files"]))
        except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"{where}: unreadable ({exc!r})") from None
        for name in manifest.files:  # a name a run writes: a relative path below the checkpoint, in plain parts
            parts = name.split("/")
            if not name or name.startswith("/") or any(part in ("", ".", "..") or "\\" in part or "\0" in part for part in parts):
                raise CheckpointError(f"{where}: names {name[:200]!r}, not a path inside the checkpoint folder")
        return manifest


def remote_damage(storage, tag: str) -> str | None:
    """What can be told about checkpoint `tag` in remote storage without downloading it: a manifest (written last,
    so an interrupted upload has none) and every file at the manifest's size. SHA-256 and the weights-only check
    follow the download (`damage`)."""
    try:
        manifest = Manifest.parse(storage.read_text(f"{tag}/{MANIFEST}"), storage.describe(f"{tag}/{MANIFEST}"))
    except CheckpointError as exc:
        return str(exc)
    sizes = storage.sizes(tag) or {}
    for name, (size, _) in manifest.files.items():
        where = storage.describe(f"{tag}/{name}")
        if name not in sizes:
            return f"{where}: missing"
        if sizes[name] != size:
            return f"{where}: {sizes[name]} bytes, the manifest says {size} (truncated or overwritten)"
    return None


def damage(folder: Path, only: set[str] | None = None) -> str | None:
    """Why the checkpoint in `folder` cannot be trusted (the first file that differs from its manifest, or a
    pickle that is not weights-only), or None when it is intact. `only`: check just these of its files."""
    if only is None and (irregular := irregular_entry(folder)):
        return irregular
    try:
        manifest = Manifest.read(folder)
    except CheckpointError as exc:
        return str(exc)
    if only is not None:
        manifest = Manifest(manifest.run_id, manifest.step, manifest.written_at, {n: v for n, v in manifest.files.items() if n in only})
    else:  # DeepSpeed's loaders open every *_states.pt in the folder: a file the run did not write is never trusted
        unnamed = sorted(rel for p in folder.rglob("*") if p.is_file() and (rel := p.relative_to(folder).as_posix()) != MANIFEST
                         and rel not in manifest.files)
        if unnamed:
            return (f"{folder / unnamed[0]}: not named by the checkpoint's manifest ({len(unnamed)} such file(s)); a checkpoint"
                    " folder holds only the files its run wrote")
    for name, (size, _) in manifest.files.items():
        path = folder / name
        if not os.path.lexists(path):
            return f"{path}: missing"
        mode = os.lstat(path).st_mode
        if not stat.S_ISREG(mode):
            return f"{path}: {kind_of(mode)}; a checkpoint folder holds regular files only"
        if path.stat().st_size != size:
            return f"{path}: {path.stat().st_size} bytes, the manifest says {size} (truncated or overwritten)"
    names = list(manifest.files)
    try:
        with ThreadPoolExecutor(HASH_THREADS) as pool:
            digests = list(pool.map(lambda name: sha256(folder / name), names))
    except CheckpointError as exc:  # swapped for a link or a FIFO since the look above
        return str(exc)
    for name, digest in zip(names, digests):
        if digest != manifest.files[name][1]:
            return f"{folder / name}: SHA-256 differs from the manifest (the file was changed after it was written)"
    for name in names:
        if name.endswith(".pt"):
            try:
                load_weights_only(folder / name, mmap=True)
            except CheckpointError as exc:
                return str(exc)
    return None


def write_failure(path: Path, exc: BaseException) -> str:
    """One line for a checkpoint write that failed: a full disk said as such (torch reports it as
    `unexpected pos N vs M`), anything else with its first line."""
    free = shutil.disk_usage(path if path.exists() else path.parent).free
    chain, error = [], exc
    while error is not None:
        chain.append(error)
        error = error.__cause__ or error.__context__
    if free < DISK_FULL_MARGIN_BYTES or any(getattr(e, "errno", None) == errno.ENOSPC for e in chain):
        return f"the disk holding {path} is full ({free / 2**20:.1f} MiB free)"
    return str(exc).strip().splitlines()[-1][:300] if str(exc).strip() else repr(exc)


def weights_only_checkpoint_engine(engine) -> None:
    """Make a DeepSpeed engine load its checkpoints weights-only (it saves as before)."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    class WeightsOnlyCheckpointEngine(TorchCheckpointEngine):
        def load(self, path: str, map_location=None):
            return load_weights_only(Path(path))

    if type(engine.checkpoint_engine) is not TorchCheckpointEngine:
        raise CheckpointError(f"expected DeepSpeed's torch checkpoint engine, found {type(engine.checkpoint_engine).__name__}")
    engine.checkpoint_engine = WeightsOnlyCheckpointEngine(engine._config)
