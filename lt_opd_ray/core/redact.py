"""Credentials never leave the process: every URI a run writes or prints has its secrets replaced by `***`.

A URI may carry them as userinfo (`s3://KEY:SECRET@bucket/runs`, `https://user:password@mlflow:5000`, `https://token@host`)
or as the query parameters pyarrow's S3 URIs and similar stores accept (`access_key`, `secret_key`, `session_token`,
...). The process keeps the URI as given (the storage and the tracker open it); what is written (the run's job.yaml,
its error.log, the trackers' config) and printed (start-up lines, errors) goes through `redact`.
"""

from __future__ import annotations

import re

# scheme://, then the authority's userinfo up to the first "@"; a span holding "/" but no ":" is a path with an "@" in it
_USERINFO = re.compile(r"\b([a-zA-Z][a-zA-Z0-9+.-]*://)([^@\s'\"<>]*)@")
_SECRET_QUERY = re.compile(r"([?&;](?:access_key|secret_key|session_token|secret|password|passwd|token|sig|signature|"
                           r"x-amz-credential|x-amz-signature|x-amz-security-token)=)[^&;#\s'\"<>]+", re.IGNORECASE)
HIDDEN = "***"


def redact(text: str) -> str:
    """`text` with every URI's userinfo and secret query values replaced by `***`; anything else unchanged."""

    def userinfo(match: re.Match) -> str:
        scheme, span = match.groups()
        if "/" in span and ":" not in span:
            return match.group(0)  # s3://bucket/runs/model@v2: a path, not credentials
        return f"{scheme}{HIDDEN}@"

    return _SECRET_QUERY.sub(lambda m: m.group(1) + HIDDEN, _USERINFO.sub(userinfo, text))


def redact_values(value):
    """A JSON-like value (a job's `model_dump`) with `redact` applied to every string in it."""
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, dict):
        return {key: redact_values(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [redact_values(item) for item in value]
    return value
