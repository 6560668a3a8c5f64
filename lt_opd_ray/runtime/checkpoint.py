"""Atomic, verified checkpoints: learner engine state (weights, optimizer, scheduler) + driver state (step, data
cursor) + the rollouts in flight.

A checkpoint is written into `<dir>/.incoming/step-K`, completed with its
driver_state.json and a manifest of every file's size and SHA-256, then renamed to
`<dir>/step-K`; only then does the `latest` file (replaced atomically) point at it.
With `checkpoint.dir` a URI (storage.py) it is uploaded instead: the files, then the
manifest, then `latest`.
A crash at any moment leaves the previous checkpoint as `latest`. A resume checks
the checkpoint against its manifest first and falls back to the newest intact one,
saying which and why (checkpoint_files.py). Each run keeps its own newest
`checkpoint.keep` checkpoints: another run's in the same folder are never pruned,
and the newest is never pruned.

Sampling and selection are seeded by (seed, step, uid), so step and cursor are all
the random state a resume needs, but for one thing: with schedule.max_staleness 1 the
next update's rollouts were sampled by weights the checkpoint no longer holds, so
they are kept (`in_flight.pt`, tensors and plain values only) and trained on after
the resume: nothing lost, nothing trained twice.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml

from lt_opd_ray.config.schema import JobConfig
from lt_opd_ray.core.redact import redact_values
from lt_opd_ray.core.storage import RUN_RECORD, RunStorage
from lt_opd_ray.core.wire import Rollout, RolloutGroup, Span
from lt_opd_ray.runtime.checkpoint_files import (
    MANIFEST,
    CheckpointError,
    Manifest,
    damage,
    file_digests,
    load_weights_only,
    remote_damage,
    step_of,
    write_failure,
)
from lt_opd_ray.runtime.waits import RoleDiedError

IN_FLIGHT = "in_flight.pt"
DRIVER_STATE = "driver_state.json"


@dataclass(frozen=True)
class PassedOver:
    """A checkpoint a resume did not take, and why."""

    tag: str
    why: str

    def __str__(self) -> str:
        return f"{self.tag}: {self.why}"


@dataclass
class Restored:
    tag: str
    state: dict  # step, cursor
    in_flight: list[RolloutGroup]
    passed_over: list[PassedOver] = field(default_factory=list)  # newer checkpoints found damaged (set aside as <tag>.damaged)


class CheckpointStore:
    def __init__(self, job: JobConfig):
        self.job = job
        self.storage = RunStorage(job.checkpoint.dir, job.checkpoint.staging_dir)
        self.root = self.storage.local  # where this process writes (for a URI: the staging folder)
        self.root.mkdir(parents=True, exist_ok=True)
        self.storage.write_text("job.yaml", yaml.safe_dump(redact_values(job.model_dump(mode="json")), sort_keys=False))  # no credentials
        self.run_id = uuid.uuid4().hex[:12]  # a resume continues the run it restores (restore sets it)

    # ------------------------------------------------------------------ writing
    def record_run(self, resumed_from: str | None) -> None:
        """run.json: the run this folder now holds (a resume keeps the id of the run it continues)."""
        record = {"run_id": self.run_id, "job": self.job.name, "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "resumed_from": resumed_from}
        self.storage.write_text(RUN_RECORD, json.dumps(record, indent=1) + "\n")

    def save(self, learners, driver_state: dict, in_flight: list[RolloutGroup] = ()) -> str:
        """Checkpoint `step-K` of the learners, the driver state and the rollouts in flight; returns where it is."""
        tag = f"step-{driver_state['step']}"
        staged = self.root / ".incoming" / tag
        shutil.rmtree(staged, ignore_errors=True)
        staged.parent.mkdir(exist_ok=True)
        try:
            learners.save_state(str(staged.parent), tag)
            if self.storage.remote:
                self._upload(learners, tag, driver_state, in_flight)
            else:
                self._write_driver_files(staged, driver_state, in_flight)
                Manifest.of(staged, self.run_id, driver_state["step"]).write(staged)
        except Exception as exc:
            reason = write_failure(staged, exc)
            shutil.rmtree(staged, ignore_errors=True)  # give the space back; the previous checkpoint stays `latest`
            if self.storage.remote:
                self.storage.delete(tag)
            if isinstance(exc, RoleDiedError):
                raise  # a rank died while writing: the run stops as for any learner death
            raise CheckpointError(f"writing checkpoint {tag} to {self.storage.describe(tag)} failed: {reason}; `latest` still names {self._pointer() or 'nothing'}") from exc
        if not self.storage.remote:
            final = self.root / tag
            shutil.rmtree(final, ignore_errors=True)
            os.replace(staged, final)
        self.storage.write_text("latest", tag)
        self._prune(newest=tag)
        return self.storage.describe(tag)

    @staticmethod
    def _write_driver_files(folder: Path, driver_state: dict, in_flight: list[RolloutGroup]) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        if in_flight:
            torch.save([to_plain(group) for group in in_flight], folder / IN_FLIGHT)
        (folder / DRIVER_STATE).write_text(json.dumps(driver_state))

    def _upload(self, learners, tag: str, driver_state: dict, in_flight: list[RolloutGroup]) -> None:
        """To a URI: each node's learner files (one rank per node hashes and uploads them), the driver's files,
        then the manifest of them all, last: a checkpoint without one is unfinished."""
        where = self.storage.location, self.job.checkpoint.staging_dir
        files = learners.on_each_node("upload", *where, f".incoming/{tag}", tag, what=f"uploading checkpoint {tag}")
        own = f".driver/{tag}"
        self._write_driver_files(self.root / own, driver_state, in_flight)
        files = {name: entry for node_files in files for name, entry in node_files.items()} | upload(self.storage, own, tag)
        self.storage.write_text(f"{tag}/{MANIFEST}", Manifest(self.run_id, driver_state["step"], time.time(), files).text())
        shutil.rmtree(self.root / tag, ignore_errors=True)  # the manifest's local copy

    def _prune(self, newest: str) -> None:
        """This run's checkpoints beyond the `keep` written last; never `newest`, never another run's. Ordered by
        when each was written, not by step: after a resume from step-8, step-9 is newer than a step-12 of the
        branch the resume left (which it set aside as damaged anyway)."""
        own = []
        for tag in self._step_tags():
            try:
                manifest = self._manifest(tag)
            except CheckpointError:
                continue  # not ours to judge: an unfinished or foreign folder stays
            if manifest.run_id == self.run_id:
                own.append((manifest.written_at, tag))
        for _, old in sorted(own)[: -self.job.checkpoint.keep]:
            if old != newest:
                self.storage.delete(old)

    def _settle(self, chosen: str, passed_over: list[PassedOver]) -> None:
        """After a resume took `chosen`: each damaged checkpoint it passed over is renamed `<tag>.damaged` (kept for
        a post-mortem, never chosen, pruned or overwritten again) and `latest` names `chosen`."""
        for passed in passed_over:
            if self.storage.is_dir(passed.tag):
                aside, n = f"{passed.tag}.damaged", 1
                while self.storage.is_dir(aside):
                    aside, n = f"{passed.tag}.damaged-{n}", n + 1
                self.storage.rename(passed.tag, aside)
        if self._pointer() != chosen:
            self.storage.write_text("latest", chosen)

    # ------------------------------------------------------------------ reading
    def _step_tags(self) -> list[str]:
        tags = [name for name in self.storage.names() if step_of(name) is not None and self.storage.is_dir(name)]
        return sorted(tags, key=step_of)

    def _manifest(self, tag: str) -> Manifest:
        return Manifest.parse(self.storage.read_text(f"{tag}/{MANIFEST}"), self.storage.describe(f"{tag}/{MANIFEST}"))

    def _pointer(self) -> str | None:
        """The tag `latest` names. Only a name this store writes (`step-N`) is taken: a path, `..` or anything else
        would be renamed or downloaded over as if it were a checkpoint, so it is refused by name."""
        pointer = self.storage.read_text("latest")
        if pointer is None:
            return None
        tag = pointer.strip()
        if step_of(tag) is None:
            raise CheckpointError(f"{self.storage.describe('latest')} names {tag[:200]!r}, not a checkpoint name a run writes (step-N);"
                                  " fix or remove the file")
        return tag

    def latest(self) -> str | None:
        """The tag `latest` names (this process wrote it or it is complete), or None."""
        tag = self._pointer()
        return tag if tag and self.storage.read_text(f"{tag}/{MANIFEST}") is not None else None

    def choose(self) -> tuple[str | None, list[PassedOver]]:
        """(the checkpoint to resume: the one `latest` names when intact, else the newest intact one; the ones
        passed over, each with why). Raises CheckpointError, naming each candidate's damage, when none is intact."""
        pointer = self._pointer()
        candidates = [pointer] if pointer else []
        candidates += sorted((tag for tag in self._step_tags() if tag != pointer), key=self._written_at, reverse=True)
        passed_over = []
        for tag in candidates:
            if not self.storage.is_dir(tag):
                why = f"{self.storage.describe(tag)}: missing (named by {self.storage.describe('latest')})"
            else:
                why = remote_damage(self.storage, tag) if self.storage.remote else damage(self.root / tag)
            if why is None:
                return tag, passed_over
            passed_over.append(PassedOver(tag, why))
        if passed_over:
            raise CheckpointError(f"no intact checkpoint in {self.storage.describe()} to resume from:\n  " + "\n  ".join(map(str, passed_over)))
        return None, []

    def _written_at(self, tag: str) -> float:
        try:
            return self._manifest(tag).written_at
        except CheckpointError:  # no manifest to ask: when the folder was last changed (0 in remote storage)
            return 0.0 if self.storage.remote else (self.root / tag).stat().st_mtime

    def restore(self, learners, tag: str, passed_over: list[PassedOver]) -> Restored:
        """Checkpoint `tag` (from `choose`) loaded into the learners, with its driver state and in-flight rollouts."""
        folder = self.root / tag
        if self.storage.remote:  # each node downloads it (and checks every file's SHA-256); the driver its own files
            where = self.storage.location, self.job.checkpoint.staging_dir
            learners.on_each_node("download", *where, tag, what=f"downloading checkpoint {tag}")
            folder = self.root / ".driver" / tag
            for name in (MANIFEST, DRIVER_STATE, IN_FLIGHT):
                self.storage.get(f"{tag}/{name}", into=folder / name)
            if why := damage(folder, only={DRIVER_STATE, IN_FLIGHT}):
                raise CheckpointError(f"checkpoint {self.storage.describe(tag)} is damaged: {why}")
        self.run_id = Manifest.read(folder).run_id
        state = json.loads((folder / DRIVER_STATE).read_text())
        trained = state.get("steps_per_update", 1)  # checkpoints written before the setting took one step an update
        if trained != self.job.optimizer.steps_per_update:  # its scheduler counts optimizer steps: the warm-up would move
            raise CheckpointError(f"checkpoint {self.storage.describe(tag)} was trained at optimizer.steps_per_update {trained}, the job"
                                  f" asks {self.job.optimizer.steps_per_update}: its learning-rate schedule counts optimizer steps,"
                                  f" so resume with --set optimizer.steps_per_update={trained}")
        kept = load_weights_only(folder / IN_FLIGHT) if (folder / IN_FLIGHT).exists() else []
        learners.load_state(str(self.root), tag)
        if self.storage.remote:
            learners.on_each_node("discard", str(self.root / tag), what=f"removing the local copy of {tag}")
            shutil.rmtree(folder, ignore_errors=True)
        self._settle(tag, passed_over)
        return Restored(tag, state, [from_plain(group) for group in kept], passed_over)


def upload(storage: RunStorage, local: str, to: str, last: tuple[str, ...] = ()) -> dict[str, list]:
    """Hash the local folder `local`, upload it to the storage's `to` (the files named in `last` last), remove it;
    its files' [bytes, sha256]."""
    folder = storage.local / local
    if not folder.is_dir():
        return {}
    files = file_digests(folder)
    storage.put(local, last, to=to)
    shutil.rmtree(folder, ignore_errors=True)
    return files


def download(storage: RunStorage, tag: str) -> None:
    """Checkpoint `tag` from the storage into the local folder, checked against its manifest (SHA-256, weights-only)."""
    folder = storage.get(tag)
    if folder is None:
        raise CheckpointError(f"{storage.describe(tag)}: missing")
    if why := damage(folder):
        shutil.rmtree(folder, ignore_errors=True)
        raise CheckpointError(f"checkpoint {storage.describe(tag)} is damaged: {why}")


def to_plain(group: RolloutGroup) -> dict:
    """A rollout group as tensors and plain values, so it loads weights-only (the tensors shared, not copied:
    at the main job's shapes the in-flight update is ~260 MB)."""
    return {**vars(group), "rollouts": [{k: _own_if_empty(v) for k, v in vars(r).items()} for r in group.rollouts],
            "span": dict(vars(group.span))}


def _own_if_empty(value):
    """A tensor with no elements, as one of its own: one Ray deserialised from a shared buffer points at its
    neighbour's bytes (an RL rollout's [T, 0] top-k ids at its float log-probs), and torch.save refuses two storages
    of different dtypes at one address. There is nothing in it to copy."""
    return torch.empty(value.shape, dtype=value.dtype) if isinstance(value, torch.Tensor) and value.numel() == 0 else value


def from_plain(data: dict) -> RolloutGroup:
    return RolloutGroup(**{**data, "rollouts": [Rollout(**r) for r in data["rollouts"]], "span": Span(**data["span"])})
