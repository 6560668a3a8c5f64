"""Experiment tracking: every update's metrics (training, timing, pool busy fractions, evaluation) and the
resolved job, to TensorBoard, MLflow and/or Weights & Biases (`tracking.backends` in the job; each library is an optional extra: `pip install
lt-opd-ray[tracking]`).

One `Tracker` protocol, one small class per backend; the driver's process logs (`runtime/launch.py`), so
nothing here runs inside an actor.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path
from typing import Protocol


class Tracker(Protocol):
    def config(self, job: dict) -> None: ...

    def step(self, step: int, metrics: dict[str, float]) -> None: ...

    def close(self) -> None: ...


def step_metrics(log) -> dict[str, float]:
    """A StepLog as flat, finite scalars: `train/loss`, `time/rollout`, `eval/accuracy/cdpruner`, ..."""
    metrics = {f"train/{name}": float(getattr(log, name)) for name in (
        "loss", "divergence", "importance_weight", "top_k_overlap", "tokens", "grad_norm", "staleness", "sequences",
        "micro_batches", "payload_bytes_per_token", "sync_bytes")}
    metrics["train/budget_percent"] = log.budget_bps / 100
    metrics |= {f"time/{phase}": float(seconds) for phase, seconds in asdict(log.phases).items() if phase != "busy"}
    metrics |= {f"busy/{pool}": float(fraction) for pool, fraction in log.phases.busy.items()}
    metrics |= {f"eval/accuracy/{selector}": float(value) for selector, value in log.eval_accuracy.items()}
    metrics |= {f"eval/score/{name}": float(value) for name, value in log.eval_scores.items()}
    return {name: value for name, value in metrics.items() if math.isfinite(value)}


class TensorBoardTracker:
    def __init__(self, folder: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(folder))

    def config(self, job: dict) -> None:
        self.writer.add_text("job", "```\n" + json.dumps(job, indent=2) + "\n```")

    def step(self, step: int, metrics: dict[str, float]) -> None:
        for name, value in metrics.items():
            self.writer.add_scalar(name, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class MLflowTracker:
    def __init__(self, uri: str, experiment: str, run_name: str):
        import mlflow

        self.mlflow = mlflow
        mlflow.set_tracking_uri(uri)
        mlflow.set_experiment(experiment)
        self.run = mlflow.start_run(run_name=run_name)

    def config(self, job: dict) -> None:
        self.mlflow.log_dict(job, "job.json")
        flat = _flatten(job)
        self.mlflow.log_params({k: v for k, v in flat.items() if len(str(v)) <= 500})

    def step(self, step: int, metrics: dict[str, float]) -> None:
        self.mlflow.log_metrics({name.replace("[", "_").replace("]", ""): value for name, value in metrics.items()}, step=step)

    def close(self) -> None:
        self.mlflow.end_run()


class WandbTracker:
    def __init__(self, folder: Path, project: str, mode: str, run_name: str):
        import wandb

        self.wandb = wandb
        folder.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=project, name=run_name, mode=mode, dir=str(folder))

    def config(self, job: dict) -> None:
        self.run.config.update(job)

    def step(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step, commit=True)

    def close(self) -> None:
        self.run.finish()


class Trackers:
    """Every backend the job names, called together (a missing library is refused before the run starts:
    runtime/driver.preflight)."""

    def __init__(self, job, storage):
        settings, self.backends = job.tracking, []
        self.storage = None if settings.dir else storage  # to a URI checkpoint.dir, the default folder is uploaded at close
        folder = Path(settings.dir) if settings.dir else storage.local / "tracking"
        for name in settings.backends:
            if name == "tensorboard":
                self.backends.append(TensorBoardTracker(folder / "tensorboard"))
            elif name == "mlflow":
                folder.mkdir(parents=True, exist_ok=True)
                self.backends.append(MLflowTracker(settings.mlflow_uri or f"sqlite:///{(folder / 'mlflow.db').resolve()}", settings.project, job.name))
            else:
                self.backends.append(WandbTracker(folder, settings.project, settings.wandb_mode, job.name))
        for backend in self.backends:
            backend.config(job.model_dump(mode="json"))

    def step(self, log) -> None:
        metrics = step_metrics(log)
        for backend in self.backends:
            backend.step(log.step + 1, metrics)

    def close(self) -> None:
        for backend in self.backends:
            backend.close()
        if self.backends and self.storage is not None:
            self.storage.put("tracking")


def _flatten(data: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in data.items():
        if isinstance(value, dict):
            out |= _flatten(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = value
    return out
