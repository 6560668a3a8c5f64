"""Atomic, verified checkpoints: learner engine state (weights, optimizer, scheduler) + driver state (step, data
cursor) + the rollouts in flight.

A checkpoint is written into `<dir>/.incoming/step-K`, completed with its
driver_state.json and a manifest of every file's size and SHA-256, then renamed to
`<dir>/step-K`; only then does the `latest` file (replaced atomically) point at it.
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
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml

from ..config import JobConfig
from ..wire import Rollout, RolloutGroup, Span
from .checkpoint_files import CheckpointError, Manifest, damage, load_weights_only, write_failure
from .waits import RoleDiedError

IN_FLIGHT = "in_flight.pt"
DRIVER_STATE = "driver_state.json"


@dataclass
class Restored:
    tag: str
    state: dict  # step, cursor
    in_flight: list[RolloutGroup]
    passed_over: list[str] = field(default_factory=list)  # newer checkpoints found damaged, each with why


class CheckpointStore:
    def __init__(self, job: JobConfig):
        self.job = job
        self.root = Path(job.checkpoint.dir).resolve()
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / "job.yaml").write_text(yaml.safe_dump(job.model_dump(mode="json"), sort_keys=False))
        self.run_id = uuid.uuid4().hex[:12]  # a resume continues the run it restores (restore sets it)

    # ------------------------------------------------------------------ writing
    def save(self, learners, driver_state: dict, in_flight: list[RolloutGroup] = ()) -> Path:
        tag = f"step-{driver_state['step']}"
        staged = self.root / ".incoming" / tag
        shutil.rmtree(staged, ignore_errors=True)
        staged.parent.mkdir(exist_ok=True)
        try:
            learners.wait([actor.save.remote(str(staged.parent), tag) for actor in learners.actors], f"writing checkpoint {tag}")
            if in_flight:
                torch.save([to_plain(group) for group in in_flight], staged / IN_FLIGHT)
            (staged / DRIVER_STATE).write_text(json.dumps(driver_state))
            Manifest.of(staged, self.run_id, driver_state["step"]).write(staged)
        except Exception as exc:
            reason = write_failure(staged, exc)
            shutil.rmtree(staged, ignore_errors=True)  # give the space back; the previous checkpoint stays `latest`
            if isinstance(exc, RoleDiedError):
                raise  # a rank died while writing: the run stops as for any learner death
            raise CheckpointError(f"writing checkpoint {tag} to {staged} failed: {reason}; `latest` still names {self._pointer() or 'nothing'}") from exc
        final = self.root / tag
        shutil.rmtree(final, ignore_errors=True)
        os.replace(staged, final)
        pointer = self.root / "latest.tmp"
        pointer.write_text(tag)
        os.replace(pointer, self.root / "latest")
        self._prune(newest=tag)
        return final

    def _prune(self, newest: str) -> None:
        """This run's checkpoints beyond the newest `keep`; never `newest`, never another run's."""
        own = []
        for folder in self._step_folders():
            try:
                if Manifest.read(folder).run_id == self.run_id:
                    own.append(folder)
            except CheckpointError:
                continue  # not ours to judge: an unfinished or foreign folder stays
        for old in own[: -self.job.checkpoint.keep]:
            if old.name != newest:
                shutil.rmtree(old, ignore_errors=True)

    # ------------------------------------------------------------------ reading
    def _step_folders(self) -> list[Path]:
        return sorted((p for p in self.root.glob("step-*") if p.is_dir() and p.name[5:].isdigit()), key=lambda p: int(p.name[5:]))

    def _pointer(self) -> str | None:
        pointer = self.root / "latest"
        return pointer.read_text().strip() if pointer.exists() else None

    def latest(self) -> str | None:
        """The tag `latest` names (this process wrote it or it is complete), or None."""
        tag = self._pointer()
        return tag if tag and (self.root / tag / DRIVER_STATE).exists() else None

    def choose(self) -> tuple[str | None, list[str]]:
        """(the checkpoint to resume: the one `latest` names when intact, else the newest intact one; the ones
        passed over, each with why). Raises CheckpointError, naming each candidate's damage, when none is intact."""
        pointer = self._pointer()
        candidates = [self.root / pointer] if pointer else []
        candidates += sorted((p for p in self._step_folders() if p.name != pointer), key=self._written_at, reverse=True)
        passed_over = []
        for folder in candidates:
            why = damage(folder) if folder.is_dir() else f"{folder}: missing (named by {self.root / 'latest'})"
            if why is None:
                return folder.name, passed_over
            passed_over.append(f"{folder.name}: {why}")
        if passed_over:
            raise CheckpointError(f"no intact checkpoint in {self.root} to resume from:\n  " + "\n  ".join(passed_over))
        return None, []

    @staticmethod
    def _written_at(folder: Path) -> float:
        try:
            return Manifest.read(folder).written_at
        except CheckpointError:
            return folder.stat().st_mtime  # no manifest to ask: when the folder was last changed

    def restore(self, learners, tag: str, passed_over: list[str]) -> Restored:
        """Checkpoint `tag` (from `choose`) loaded into the learners, with its driver state and in-flight rollouts."""
        folder = self.root / tag
        self.run_id = Manifest.read(folder).run_id
        state = json.loads((folder / DRIVER_STATE).read_text())
        kept = load_weights_only(folder / IN_FLIGHT) if (folder / IN_FLIGHT).exists() else []
        learners.wait([actor.load.remote(str(self.root), tag) for actor in learners.actors], f"loading checkpoint {tag}")
        return Restored(tag, state, [from_plain(group) for group in kept], passed_over)


def to_plain(group: RolloutGroup) -> dict:
    """A rollout group as tensors and plain values, so it loads weights-only (the tensors shared, not copied:
    at the main job's shapes the in-flight update is ~260 MB)."""
    return {**vars(group), "rollouts": [dict(vars(r)) for r in group.rollouts], "span": dict(vars(group.span))}


def from_plain(data: dict) -> RolloutGroup:
    return RolloutGroup(**{**data, "rollouts": [Rollout(**r) for r in data["rollouts"]], "span": Span(**data["span"])})
