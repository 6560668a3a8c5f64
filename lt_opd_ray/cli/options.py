"""What several `lt-opd` commands share: the `--set` option's help and loading a job or reporting its problems."""

from __future__ import annotations

import sys

SET_HELP = "override a field of the job, e.g. --set optimizer.lr.language_model=2e-6 (repeatable; checked by the schema)"


def load_job_or_report(path: str, overrides: list[str] = ()):
    """The validated job (`--set` overrides applied), or None after printing every problem of the YAML."""
    from lt_opd_ray.config.loading import JobConfigError, load_job

    try:
        return load_job(path, overrides)
    except JobConfigError as exc:
        print(exc, file=sys.stderr)
        return None
