"""A row's image fetched from the web while a data set is prepared: only from hosts the user names (the rule
`lt-opd serve` applies), never following a redirect (an allowed host cannot send the request on to another), within
a timeout and a size. Anything else is a ValueError naming the URL, reported with the row."""

from __future__ import annotations

import urllib.error
import urllib.request
from urllib.parse import urlsplit

MAX_MEDIA_BYTES = 64 * 2**20
TIMEOUT_S = 30.0


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, req, fp, code, msg, headers, newurl):
        raise ValueError(f"{req.full_url} redirects ({code}) to {newurl}: redirects are not followed")


def fetch(url: str, allowed_domains: tuple[str, ...]) -> bytes:
    parts = urlsplit(url)
    if not parts.scheme.lower().startswith("http") or parts.scheme.lower() not in ("http", "https"):
        raise ValueError(f"{url}: only http(s) URLs are fetched")
    if parts.hostname not in allowed_domains:
        raise ValueError(f"{url} is on {parts.hostname}, and remote images are fetched only from hosts named with "
                         "--allowed-media-domains (or put the file under the data folder)")
    opener = urllib.request.build_opener(_NoRedirect)
    try:
        with opener.open(url, timeout=TIMEOUT_S) as response:
            data = response.read(MAX_MEDIA_BYTES + 1)
    except (urllib.error.URLError, OSError) as exc:
        raise ValueError(f"{url}: {getattr(exc, 'reason', exc)}") from None
    if len(data) > MAX_MEDIA_BYTES:
        raise ValueError(f"{url}: more than {MAX_MEDIA_BYTES // 2**20} MiB")
    return data
