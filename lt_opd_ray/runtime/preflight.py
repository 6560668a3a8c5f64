"""Everything that stops a job from starting, found before any actor starts and reported at once: the cluster's
resources and memory, the run folder's storage, the model folder (names, token merge, learner and engine memory),
every data and benchmark file, the tracking backends."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import ray

from lt_opd_ray.config.schema import JobConfig
from lt_opd_ray.core.families import family_of_config
from lt_opd_ray.core.samples import Sample
from lt_opd_ray.core.storage import RunStorage, StorageError
from lt_opd_ray.models.loading import check_checkpoint_names
from lt_opd_ray.runtime.job_inputs import family_problems, read_job_inputs
from lt_opd_ray.runtime.resources import (
    InsufficientResourcesError,
    autoscaling_note,
    check_engine_memory,
    check_learner_memory,
    check_memory,
    check_resources,
)


class PreflightError(ValueError):
    """Everything that stops a job from starting, found before any actor starts."""


def preflight(job: JobConfig) -> tuple[list[Sample], dict, list[Sample] | None]:
    """(training samples, benchmark items, eval samples) once the cluster's resources, the model folder and every
    data and benchmark file have been checked; otherwise one PreflightError listing every problem."""
    problems: list[str] = []

    def attempt(check):
        try:
            return check()
        except (InsufficientResourcesError, FileNotFoundError, ValueError, StorageError) as exc:  # InputError, BenchmarkError, ...
            problems.append(str(exc))
            return None

    cluster = ray.cluster_resources()
    attempt(lambda: check_resources(job, cluster))
    attempt(lambda: check_memory(job, cluster))
    for note in (autoscaling_note(job, cluster), job.teacher_admission_note()):
        if note:
            print(note, flush=True)
    attempt(lambda: RunStorage(job.checkpoint.dir, job.checkpoint.staging_dir).check_reachable())
    inputs, input_problems = read_job_inputs(job)  # the data, benchmark and model files, as `validate` reads them
    problems += input_problems
    model_dir = inputs.model_dir
    if model_dir is not None:
        attempt(lambda: check_checkpoint_names(model_dir))
        attempt(lambda: check_token_merge(job, model_dir))
        model_config = json.loads((Path(model_dir) / "config.json").read_text())
        attempt(lambda: check_learner_memory(job, model_config, ray.nodes()))
        attempt(lambda: check_engine_memory(job, model_config, ray.nodes()))
    if model_dir is not None:
        problems += family_problems(job, family_of_config(model_config), inputs)
    problems += [f"tracking.backends names {name!r} but {name} is not installed: pip install 'lt-opd-ray[tracking]'"
                 for name in job.tracking.backends if importlib.util.find_spec(name) is None]
    if problems:
        raise PreflightError(f"job {job.name!r} cannot start:\n  " + "\n  ".join(problems))
    return inputs.samples, inputs.benchmarks, inputs.eval_samples


def check_token_merge(job: JobConfig, model_dir) -> None:
    """A folder whose student merges tokens (ours or the release's) trains only with selector.merge learnable."""
    from lt_opd_ray.core.compression import CompressionConfig

    folder = CompressionConfig.read(model_dir)
    if folder is not None and folder.merge != "none" and job.selector.merge == "none":
        raise ValueError(f"model.path {job.model.path!r} holds a student with a learnable token merge: set selector.merge:"
                         " learnable to go on training it (or start from a folder without one)")
