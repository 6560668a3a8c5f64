"""What several `lt-opd` commands share: the `--set` option's help, loading a job or reporting its problems, and the
ranges of the numbers their options take."""

from __future__ import annotations

import argparse
import sys

SET_HELP = "override a field of the job, e.g. --set optimizer.lr.language_model=2e-6 (repeatable; checked by the schema)"


def load_job_or_report(path: str, overrides: list[str] = ()):
    """The validated job (`--set` overrides applied), or None after printing every problem of the YAML."""
    from lt_opd_ray.config.loading import JobConfigError, load_job
    from lt_opd_ray.core.redact import redact

    try:
        return load_job(path, overrides)
    except JobConfigError as exc:
        print(redact(str(exc)), file=sys.stderr)  # a refused value may be a URI with credentials
        return None


def whole_number(low: int, high: int | None = None, meaning: str = ""):
    """An argparse type: an integer from `low` to `high`; anything else is refused by argparse (exit 2, the option,
    the value and the range named, no traceback). `meaning` says what the number counts."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < low or (high is not None and value > high):
            allowed = f"from {low} to {high}" if high is not None else f"{low} or more"
            raise argparse.ArgumentTypeError(f"{value} is out of range: {allowed}" + (f" ({meaning})" if meaning else ""))
        return value

    return parse


BUDGET_BPS = whole_number(1, 10_000, "basis points of each image's visual tokens; 10000 keeps every token")
