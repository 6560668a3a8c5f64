"""Experiment tracking: every update's metrics (training, timing, pool busy fractions, evaluation), each
evaluation as a table, the evaluation curves as a figure at the end, and the resolved job, to TensorBoard, MLflow and/or Weights & Biases (`tracking.backends` in the job; each library is an optional extra: `pip install
lt-opd-ray[tracking]`).

One `Tracker` protocol, one small class per backend; the driver's process logs (`runtime/launch.py`), so
nothing here runs inside an actor.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict
from pathlib import Path
from typing import Protocol

from lt_opd_ray.core.redact import redact_values


class Tracker(Protocol):
    def config(self, job: dict) -> None: ...

    def table(self, step: int, name: str, columns: list[str], rows: list[list]) -> None: ...

    def step(self, step: int, metrics: dict[str, float]) -> None: ...

    def figure(self, step: int, name: str, png: Path) -> None: ...

    def close(self) -> None: ...


EVAL_COLUMNS = ["update", "budget_percent", "metric", "value"]


def eval_rows(log) -> list[list]:
    """An evaluation's results as table rows (empty after an update without one)."""
    results = {f"accuracy/{selector}": value for selector, value in log.eval_accuracy.items()} | dict(log.eval_scores)
    return [[log.step + 1, log.budget_bps / 100, metric, float(value)] for metric, value in sorted(results.items())]


def plot_eval_curves(history: list[list], path: Path) -> None:
    """Every evaluation metric against the update it followed, one line each."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for metric in sorted({row[2] for row in history}):
        points = [(row[0], row[3]) for row in history if row[2] == metric]
        ax.plot(*zip(*points), marker="o", label=metric)
    ax.set_xlabel("update")
    ax.set_ylabel("score")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=3, fontsize="small")
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)


def step_metrics(log) -> dict[str, float]:
    """A StepLog as flat, finite scalars: `train/loss`, `time/rollout`, `eval/accuracy/cdpruner`, ..."""
    metrics = {f"train/{name}": float(getattr(log, name)) for name in (
        "loss", "importance_weight", "tokens", "grad_norm", "staleness", "sequences",
        "micro_batches", "payload_bytes_per_token", "sync_bytes", "response_tokens_mean", "response_tokens_max", "truncated_share",
        "clipped_share", "logprob_gap", "padding_share")}
    metrics["train/budget_percent"] = log.budget_bps / 100
    metrics |= {f"train/{name}": float(getattr(log, name)) for name in ("divergence", "top_k_overlap", "reward_mean", "reward_std", "resampled_groups", "flat_groups")  # where the job has them
                if getattr(log, name) is not None}
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

    def table(self, step: int, name: str, columns: list[str], rows: list[list]) -> None:
        lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)] + ["| " + " | ".join(map(str, r)) + " |" for r in rows]
        self.writer.add_text(name, "\n".join(lines), step)

    def step(self, step: int, metrics: dict[str, float]) -> None:
        for name, value in metrics.items():
            self.writer.add_scalar(name, value, step)
        self.writer.flush()

    def figure(self, step: int, name: str, png: Path) -> None:
        import numpy as np
        from PIL import Image

        self.writer.add_image(name, np.asarray(Image.open(png).convert("RGB")), step, dataformats="HWC")

    def close(self) -> None:
        self.writer.close()


def _credentials_to_environment(uri: str) -> str:
    """An MLflow server URI's `user:password@` moved to MLflow's own variables (MLFLOW_TRACKING_USERNAME / _PASSWORD),
    so the URI MLflow keeps and prints ("View run at ...") carries none."""
    from urllib.parse import unquote, urlsplit, urlunsplit

    parts = urlsplit(uri)
    if parts.username is None:
        return uri
    os.environ["MLFLOW_TRACKING_USERNAME"] = unquote(parts.username)
    if parts.password is not None:
        os.environ["MLFLOW_TRACKING_PASSWORD"] = unquote(parts.password)
    return urlunsplit(parts._replace(netloc=parts.netloc.rsplit("@", 1)[1]))


class MLflowTracker:
    def __init__(self, uri: str, experiment: str, run_name: str, artifacts: Path | None):
        """`artifacts`: where a new experiment keeps its files (with the local sqlite store: beside it, not in the
        working directory, MLflow's default); None: the tracking server decides."""
        import mlflow

        self.mlflow = mlflow
        mlflow.set_tracking_uri(_credentials_to_environment(uri))
        if artifacts is not None and mlflow.get_experiment_by_name(experiment) is None:
            mlflow.create_experiment(experiment, artifact_location=artifacts.resolve().as_uri())
        mlflow.set_experiment(experiment)
        self.run = mlflow.start_run(run_name=run_name)

    def config(self, job: dict) -> None:
        self.mlflow.log_dict(job, "job.json")
        flat = _flatten(job)
        self.mlflow.log_params({k: v for k, v in flat.items() if len(str(v)) <= 500})

    def table(self, step: int, name: str, columns: list[str], rows: list[list]) -> None:
        self.mlflow.log_table({column: [row[i] for row in rows] for i, column in enumerate(columns)}, f"{name}/update-{step:05d}.json")

    def step(self, step: int, metrics: dict[str, float]) -> None:
        self.mlflow.log_metrics({name.replace("[", "_").replace("]", ""): value for name, value in metrics.items()}, step=step)

    def figure(self, step: int, name: str, png: Path) -> None:
        self.mlflow.log_artifact(str(png), name.rsplit("/", 1)[0] if "/" in name else None)

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

    def table(self, step: int, name: str, columns: list[str], rows: list[list]) -> None:
        self.run.log({name: self.wandb.Table(columns=columns, data=rows)}, step=step, commit=False)  # committed with the step's metrics

    def step(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step, commit=True)

    def figure(self, step: int, name: str, png: Path) -> None:
        self.run.log({name: self.wandb.Image(str(png))})  # at W&B's own next step: `step` is committed already

    def close(self) -> None:
        self.run.finish()


class Trackers:
    """Every backend the job names, called together (a missing library is refused before the run starts:
    runtime/driver.preflight)."""

    def __init__(self, job, storage):
        settings, self.backends = job.tracking, []
        self.storage = None if settings.dir else storage  # to a URI checkpoint.dir, the default folder is uploaded at close
        self.folder = folder = Path(settings.dir) if settings.dir else storage.local / "tracking"
        self.evals: list[list] = []  # every evaluation's rows, for the curves at close
        for name in settings.backends:
            if name == "tensorboard":
                self.backends.append(TensorBoardTracker(folder / "tensorboard"))
            elif name == "mlflow":
                folder.mkdir(parents=True, exist_ok=True)
                local = settings.mlflow_uri is None
                uri = settings.mlflow_uri or f"sqlite:///{(folder / 'mlflow.db').resolve()}"
                self.backends.append(MLflowTracker(uri, settings.project, job.name, folder / "mlflow-artifacts" if local else None))
            else:
                self.backends.append(WandbTracker(folder, settings.project, settings.wandb_mode, job.name))
        for backend in self.backends:
            backend.config(redact_values(job.model_dump(mode="json")))  # the trackers store it: no credentials

    def step(self, log) -> None:
        metrics, rows = step_metrics(log), eval_rows(log)
        self.evals += rows
        self.last_step = log.step + 1
        for backend in self.backends:
            if rows:
                backend.table(log.step + 1, "eval/table", EVAL_COLUMNS, rows)
            backend.step(log.step + 1, metrics)

    def close(self) -> None:
        if self.backends and self.evals:
            self.folder.mkdir(parents=True, exist_ok=True)
            plot_eval_curves(self.evals, self.folder / "eval_curves.png")
            for backend in self.backends:
                backend.figure(self.last_step, "eval/curves", self.folder / "eval_curves.png")
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
