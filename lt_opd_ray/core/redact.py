"""Credentials never leave the process: every URI a run writes or prints has its secrets replaced by `***`.

A URI may carry them as userinfo (`s3://KEY:SECRET@bucket/runs`, `https://user:p@ss@mlflow:5000`, `https://token@host`;
a raw "/" or "@" in a secret included) or in its query (`?secret_key=...`, Azure's `client_secret`, a signed URL's
`sig` / `X-Amz-Signature`: any key naming a secret, token, key, password, credential or signature). The process keeps
the URI as given (the storage and the tracker open it); what is written (the run's job.yaml, its error.log, the
trackers' config) and printed (start-up lines, errors) goes through `redact`.
"""

from __future__ import annotations

import re

HIDDEN = "***"
_URI = re.compile(r"\b[a-zA-Z][a-zA-Z0-9+.-]*://[^\s'\"<>]*")
_SECRET_QUERY = re.compile(r"([?&;][^=&;#?]*(?:secret|token|key|password|passwd|credential|sig)[^=&;#?]*=)[^&;#]*", re.IGNORECASE)


def redact(text: str) -> str:
    """`text` with every URI's userinfo and secret query values replaced by `***`; anything else unchanged."""
    return _URI.sub(lambda match: _redact_uri(match.group(0)), text)


def _redact_uri(uri: str) -> str:
    scheme, rest = uri.split("://", 1)
    authority = re.split(r"[/?#]", rest, maxsplit=1)[0]
    if "@" in authority:  # userinfo ends at the authority's last "@", as urllib and requests split it
        rest = HIDDEN + rest[authority.rindex("@"):]
    elif ":" in authority and "@" in rest:  # a secret holding a raw "/": the "@" after it ends the userinfo
        rest = HIDDEN + rest[rest.rindex("@"):]
    return f"{scheme}://{_SECRET_QUERY.sub(lambda m: m.group(1) + HIDDEN, rest)}"


def redact_values(value):
    """A JSON-like value (a job's `model_dump`) with `redact` applied to every string in it."""
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, dict):
        return {key: redact_values(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [redact_values(item) for item in value]
    return value
