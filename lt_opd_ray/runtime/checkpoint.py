"""Atomic checkpoints: learner engine state (weights, optimizer, scheduler) + driver state (step, data cursor).

A checkpoint is written into `<dir>/.incoming/step-K`, completed with its
driver_state.json, then renamed to `<dir>/step-K`; only then does the `latest`
file (replaced atomically) point at it. A crash at any moment leaves the previous
checkpoint as `latest`. Sampling and selection are seeded by (seed, step, uid),
so step and cursor are all the random state a resume needs.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import ray
import yaml

from ..config import JobConfig


class CheckpointStore:
    def __init__(self, job: JobConfig):
        self.job = job
        self.root = Path(job.checkpoint.dir).resolve()
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / "job.yaml").write_text(yaml.safe_dump(job.model_dump(mode="json"), sort_keys=False))

    def save(self, learners, driver_state: dict) -> Path:
        tag = f"step-{driver_state['step']}"
        incoming = self.root / ".incoming"
        shutil.rmtree(incoming / tag, ignore_errors=True)
        incoming.mkdir(exist_ok=True)
        ray.get([actor.save.remote(str(incoming), tag) for actor in learners.actors])
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

    def restore(self, learners) -> dict | None:
        tag = self.latest()
        if tag is None:
            return None
        ray.get([actor.load.remote(str(self.root), tag) for actor in learners.actors])
        return json.loads((self.root / tag / "driver_state.json").read_text())
