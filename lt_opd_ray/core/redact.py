"""Credentials never leave the process: every URI a run writes, prints or sends has its secrets replaced by `***`.

A URI is parsed, not matched: from each `scheme://` to the next whitespace or the next `scheme://` (two URIs joined by
`,`, `;` or `|` are two), whatever characters the secret holds (quotes, `"`, `/`, `@`). Its userinfo (everything
before the authority's last `@`, or before the last `@` of the URI where a secret holds a raw `/`) is hidden, and so
is every value of its query and fragment (`?pwd=`, `#access_token=`, a presigned URL's `X-Amz-Signature`,
`X-Amz-Credential` and `X-Amz-Security-Token`) but those of the few keys known to hold no secret (`SAFE_QUERY_KEYS`):
a key is not trusted to say whether its value is one. The process keeps the URI as given (the storage and the tracker
open it); what it writes (the run's job.yaml, its error.log, the trackers' config), prints (every line of the
command line's stdout and stderr, `redacted_process`) and hands to Ray and the trackers as its command line
(`sys.argv`) goes through `redact`; so does every Ray worker's output (`redact_worker_output`, the runtime env's
setup hook).
"""

from __future__ import annotations

import io
import re
import sys
from contextlib import contextmanager

HIDDEN = "***"
# a scheme (`s3`, `git+ssh`, `jdbc:mysql`) not inside a URI's userinfo (`s3://KEY:pa://ss@`: after a ":", "@" or "/")
_SCHEME = re.compile(r"(?<![a-zA-Z0-9+.\-:@/])[a-zA-Z][a-zA-Z0-9+.-]*(?::[a-zA-Z][a-zA-Z0-9+.-]*)*://")
_END = re.compile(r"\s")
SAFE_QUERY_KEYS = frozenset({"region", "endpoint_override", "scheme", "versionid", "format", "x-amz-expires", "x-amz-date", "x-amz-algorithm",
                             "x-amz-signedheaders"})


def redact(text: str) -> str:
    """`text` with every URI's userinfo and query and fragment values replaced by `***`; anything else unchanged."""
    starts = [m.start() for m in _SCHEME.finditer(text)]
    if not starts:
        return text
    out, done = [text[: starts[0]]], starts[0]
    for i, start in enumerate(starts):
        if start < done:
            continue
        limit = starts[i + 1] if i + 1 < len(starts) else len(text)
        space = _END.search(text, start, limit)
        end = space.start() if space else limit
        out.append(_redact_uri(text[start:end]))
        out.append(text[end:limit])
        done = limit
    return "".join(out)


def _redact_uri(uri: str) -> str:
    scheme, rest = uri.split("://", 1)
    authority_end = min((i for i in (rest.find(c) for c in "/?#") if i >= 0), default=len(rest))
    authority = rest[:authority_end]
    inner_scheme = rest[authority_end:].startswith("//") and authority.endswith(":")  # `p@ss://x@host`: a "://" in the secret
    if "@" in authority and not inner_scheme:  # userinfo ends at the authority's last "@", as urllib and requests split it
        rest = HIDDEN + rest[authority.rindex("@") :]
    elif ":" in authority and "@" in rest:  # a secret holding a raw "/": the "@" after it ends the userinfo
        rest = HIDDEN + rest[rest.rindex("@") :]
    cut = min((i for i in (rest.find(c) for c in "?#") if i >= 0), default=-1)
    if cut < 0:
        return f"{scheme}://{rest}"
    return f"{scheme}://{rest[:cut]}{_redact_parameters(rest[cut:])}"


def _redact_parameters(tail: str) -> str:
    """A URI's query and fragment (from its `?` or `#`) with each parameter's value hidden, the safe keys' kept."""
    parts = re.split(r"([?#&;])", tail)
    for i in range(2, len(parts), 2):
        key, eq, value = parts[i].partition("=")
        if not eq:
            parts[i] = HIDDEN if key else key  # a bare value (`#<token>`) is hidden whole
        elif value and key.lower() not in SAFE_QUERY_KEYS:
            parts[i] = f"{key}={HIDDEN}"
    return "".join(parts)


def redact_values(value):
    """A JSON-like value (a job's `model_dump`) with `redact` applied to every string in it."""
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, dict):
        return {key: redact_values(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [redact_values(item) for item in value]
    return value


class RedactedStream(io.TextIOBase):
    """A text stream that writes each whole line through `redact` (a URI is never split between two writes of it)."""

    def __init__(self, stream):
        self.stream, self.pending = stream, ""

    def write(self, text: str) -> int:
        self.pending += text
        if "\n" in self.pending:
            lines, self.pending = self.pending.rsplit("\n", 1)
            self.stream.write(redact(lines + "\n"))
        return len(text)

    def flush(self) -> None:
        if self.pending:
            self.stream.write(redact(self.pending))
            self.pending = ""
        self.stream.flush()

    def isatty(self) -> bool:
        return self.stream.isatty()

    def fileno(self) -> int:
        return self.stream.fileno()

    @property
    def encoding(self):
        return getattr(self.stream, "encoding", "utf-8")


@contextmanager
def redacted_process():
    """The command line's process while it runs: its stdout and stderr redacted line by line, and `sys.argv` (which
    W&B records and Ray keeps as the job's entrypoint, readable by every token holder) redacted; the parsed arguments
    keep the values. Restored on exit."""
    argv, out, err = sys.argv, sys.stdout, sys.stderr
    sys.argv = [redact(a) for a in argv]
    sys.stdout, sys.stderr = RedactedStream(out), RedactedStream(err)
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        sys.argv, sys.stdout, sys.stderr = argv, out, err


def redact_worker_output() -> None:
    """Ray's worker_process_setup_hook: a worker's stdout and stderr (its log files) redacted line by line."""
    if not isinstance(sys.stdout, RedactedStream):
        sys.stdout, sys.stderr = RedactedStream(sys.stdout), RedactedStream(sys.stderr)
