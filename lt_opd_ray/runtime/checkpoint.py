"""Atomic checkpoints: learner engine state (weights, optimizer, scheduler) + driver state (step, data cursor)
+ the rollouts in flight.

A checkpoint is written into `<dir>/.incoming/step-K`, completed with its
driver_state.json, then renamed to `<dir>/step-K`; only then does the `latest`
file (replaced atomically) point at it. A crash at any moment leaves the previous
checkpoint as `latest`. Sampling and selection are seeded by (seed, step, uid),
so step and cursor are all the random state a resume needs, but for one thing:
with schedule.max_staleness 1 the next update's rollouts were sampled by weights
the checkpoint no longer holds, so they are kept (`in_flight.pt`) and trained on
after the resume: nothing lost, nothing trained twice.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
import yaml

from ..config import JobConfig
from ..wire import RolloutGroup

IN_FLIGHT = "in_flight.pt"


class CheckpointStore:
    def __init__(self, job: JobConfig):
        self.job = job
        self.root = Path(job.checkpoint.dir).resolve()
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / "job.yaml").write_text(yaml.safe_dump(job.model_dump(mode="json"), sort_keys=False))

    def save(self, learners, driver_state: dict, in_flight: list[RolloutGroup] = ()) -> Path:
        tag = f"step-{driver_state['step']}"
        incoming = self.root / ".incoming"
        shutil.rmtree(incoming / tag, ignore_errors=True)
        incoming.mkdir(exist_ok=True)
        learners.wait([actor.save.remote(str(incoming), tag) for actor in learners.actors], f"writing checkpoint {tag}")
        if in_flight:
            torch.save(list(in_flight), incoming / tag / IN_FLIGHT)
        (incoming / tag / "driver_state.json").write_text(json.dumps(driver_state))
        final = self.root / tag
        shutil.rmtree(final, ignore_errors=True)
        os.replace(incoming / tag, final)
        pointer = self.root / "latest.tmp"
        pointer.write_text(tag)
        os.replace(pointer, self.root / "latest")
        self._prune()
        return final

    def _prune(self) -> None:
        tags = sorted((p for p in self.root.glob("step-*") if p.is_dir()), key=lambda p: int(p.name.split("-")[1]))
        for old in tags[: -self.job.checkpoint.keep]:
            shutil.rmtree(old, ignore_errors=True)

    def latest(self) -> str | None:
        pointer = self.root / "latest"
        if not pointer.exists():
            return None
        tag = pointer.read_text().strip()
        if not (self.root / tag / "driver_state.json").exists():
            raise FileNotFoundError(f"{pointer} names {tag}, which is incomplete or missing")
        return tag

    def restore(self, learners) -> tuple[dict, list[RolloutGroup]] | None:
        """(driver state, the rollout groups that were in flight) of the latest checkpoint, loaded into the learners."""
        tag = self.latest()
        if tag is None:
            return None
        learners.wait([actor.load.remote(str(self.root), tag) for actor in learners.actors], f"loading checkpoint {tag}")
        in_flight = self.root / tag / IN_FLIGHT
        groups = torch.load(in_flight, weights_only=False) if in_flight.exists() else []
        return json.loads((self.root / tag / "driver_state.json").read_text()), groups
