"""Experiment tracking: each backend records every update's metrics and the resolved job, read back from its own
files (TensorBoard event files, an MLflow file store, a W&B offline run)."""

from __future__ import annotations

import json

from conftest import job_for

from lt_opd_ray.core.storage import RunStorage
from lt_opd_ray.core.wire import PhaseTimes
from lt_opd_ray.runtime.step_log import StepLog
from lt_opd_ray.runtime.tracking import Trackers, step_metrics


def logs():
    return [StepLog(step=s, budget_bps=2500 - 500 * s, loss=0.5 / (s + 1), divergence=0.4 / (s + 1), importance_weight=1.0,
                    top_k_overlap=0.9, tokens=100 + s, phases=PhaseTimes(rollout=1.0, teacher=0.5, learner=2.0, step=3.5, busy={"learner": 0.6}),
                    eval_accuracy={"cdpruner": 0.25 * s} if s == 2 else {}) for s in range(3)]


def test_every_backend_records_each_update_and_the_job(tmp_path):
    job = job_for("tiny:qwen3_5", tmp_path / "run", extra="tracking: {backends: [tensorboard, mlflow, wandb], project: tests}\n")
    trackers = Trackers(job, RunStorage(str(tmp_path / "run")))
    for log in logs():
        trackers.step(log)
    wandb_run = trackers.backends[2].run  # the offline run as W&B holds it (its run file is a binary log only W&B's core reads)
    assert round(wandb_run.summary["train/loss"], 6) == round(0.5 / 3, 6) and wandb_run.summary["eval/accuracy/cdpruner"] == 0.5
    assert wandb_run.config["sampling"]["n"] == job.sampling.n and wandb_run.name == job.name
    assert wandb_run.summary["eval/table"]["_type"] == "table-file" and wandb_run.summary["eval/table"]["nrows"] == 1
    trackers.close()
    folder = tmp_path / "run" / "tracking"
    expected_loss = [0.5, 0.25, 0.5 / 3]

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder / "tensorboard"))
    events.Reload()
    assert [round(e.value, 6) for e in events.Scalars("train/loss")] == [round(v, 6) for v in expected_loss]
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2, 3]
    assert [e.value for e in events.Scalars("eval/accuracy/cdpruner")] == [0.5] and "job" in str(events.Tags())
    assert [image.step for image in events.Images("eval/curves")] == [3]  # the evaluation curves, drawn at close
    from tensorboard.backend.event_processing.plugin_event_accumulator import EventAccumulator as PluginEvents

    texts = PluginEvents(str(folder / "tensorboard"))
    texts.Reload()
    (table,) = [event for event in texts.Tensors("eval/table/text_summary")]
    assert table.step == 3 and "| 3 | 15.0 | accuracy/cdpruner | 0.5 |" in table.tensor_proto.string_val[0].decode()

    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{(folder / 'mlflow.db').resolve()}")
    (run,) = client.search_runs([client.get_experiment_by_name("tests").experiment_id])
    history = client.get_metric_history(run.info.run_id, "train/loss")
    assert [round(m.value, 6) for m in sorted(history, key=lambda m: m.step)] == [round(v, 6) for v in expected_loss]
    assert run.data.params["pools.learner.ranks"] == "2" and run.info.run_name == job.name
    assert run.info.artifact_uri.startswith((folder / "mlflow-artifacts").as_uri())  # beside the store, not in the working directory
    stored = folder / "mlflow-artifacts" / run.info.run_id / "artifacts"
    assert {str(p.relative_to(stored)) for p in stored.rglob("*.*")} == {"job.json", "eval/table/update-00003.json", "eval/eval_curves.png"}
    logged = json.loads((stored / "eval" / "table" / "update-00003.json").read_text())
    assert logged["columns"] == ["update", "budget_percent", "metric", "value"] and logged["data"] == [[3, 15.0, "accuracy/cdpruner", 0.5]]

    (offline,) = (folder / "wandb").glob("offline-run-*/run-*.wandb")
    assert offline.stat().st_size > 0  # `wandb sync` uploads it later


def test_step_metrics_are_flat_finite_scalars():
    metrics = step_metrics(logs()[2])
    assert metrics["train/budget_percent"] == 15.0 and metrics["time/learner"] == 2.0 and metrics["busy/learner"] == 0.6
    assert metrics["eval/accuracy/cdpruner"] == 0.5 and all(isinstance(v, float) for v in metrics.values())


def test_with_a_uri_checkpoint_dir_the_tracking_files_are_uploaded_at_close(tmp_path):
    uri = f"file://{tmp_path}/bucket/run"
    job = job_for("tiny:qwen3_5", uri, extra="tracking: {backends: [tensorboard]}\n")
    trackers = Trackers(job, RunStorage(uri, tmp_path / "stage"))
    for log in logs():
        trackers.step(log)
    assert not (tmp_path / "bucket" / "run" / "tracking").exists()
    trackers.close()
    uploaded = tmp_path / "bucket" / "run" / "tracking"
    assert len(list((uploaded / "tensorboard").glob("events.out.tfevents.*"))) == 1 and (uploaded / "eval_curves.png").stat().st_size > 0
