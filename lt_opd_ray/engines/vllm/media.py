"""How `lt-opd serve` reads a request's images and clips: inline only, unless the operator allows domains.

vLLM's default media connector fetches any http(s) URL a client sends; a local
student server should not make outbound requests on a client's behalf. This one
(selected by `VLLM_MEDIA_CONNECTOR=lt_opd_local`, which `lt-opd serve` sets) refuses
what vLLM would fetch (its own test for a web URL: a scheme starting with "http") unless
the server was started with `--allowed-media-domains`, refuses `file:` URLs unless it was
started with `--allowed-local-media-path`, caps one item's bytes at `LT_OPD_MAX_MEDIA_BYTES`
(a data: URL before it is decoded, a fetch as it downloads), and turns an image over
PIL's decompression-bomb limit into a 400 naming it, not a 500. Redirects are vLLM's
`VLLM_MEDIA_URL_ALLOW_REDIRECTS`, which `lt-opd serve` turns off.
"""

from __future__ import annotations

import os

CONNECTOR_NAME = "lt_opd_local"
MAX_MEDIA_ENV = "LT_OPD_MAX_MEDIA_BYTES"  # one image or clip's most bytes (`lt-opd serve --max-media-mb`)
MIB = 2**20


def register_media_connector() -> None:
    from PIL import Image
    from urllib3.util import parse_url
    from vllm.multimodal.media import MEDIA_CONNECTOR_REGISTRY, MediaConnector

    class LocalMediaConnector(MediaConnector):
        def _check(self, url: str, media_io) -> None:
            limit = int(os.environ.get(MAX_MEDIA_ENV, 0)) or None
            if url[:5].lower() == "data:":  # vLLM's own test, before it parses
                if limit is not None and len(url) > 4 * (limit + 2) // 3 + 256:  # base64: 4 characters per 3 bytes
                    raise ValueError(f"media refused: its data URL holds about {3 * len(url) // 4 / MIB:.1f} MiB, more than this server's "
                                     f"{limit / MIB:g} MiB (lt-opd serve --max-media-mb)")
                return
            scheme = parse_url(url).scheme or ""
            if scheme.startswith("http") and not self.allowed_media_domains:  # what vLLM would fetch
                raise ValueError(
                    "remote image URLs are off on this server: send the image inline (a data: URL with base64),"
                    " or start the server with `-- --allowed-media-domains HOST` to fetch from HOST"
                )
            if scheme == "file" and self.allowed_local_media_path is None:
                raise ValueError("file: URLs are off on this server: send the image inline (a data: URL with base64)")
            if limit is not None:  # a fetch stops at the limit
                most = media_io.get_max_bytes()
                media_io.get_max_bytes = lambda: limit if most is None else min(most, limit)

        def load_from_url(self, url, media_io, *, fetch_timeout=None):
            self._check(url, media_io)
            try:
                return super().load_from_url(url, media_io, fetch_timeout=fetch_timeout)
            except Image.DecompressionBombError as exc:
                raise ValueError(f"image refused, too many pixels (a decompression bomb?): {exc}") from None

        async def load_from_url_async(self, url, media_io, *, fetch_timeout=None):
            self._check(url, media_io)
            try:
                return await super().load_from_url_async(url, media_io, fetch_timeout=fetch_timeout)
            except Image.DecompressionBombError as exc:
                raise ValueError(f"image refused, too many pixels (a decompression bomb?): {exc}") from None

    MEDIA_CONNECTOR_REGISTRY.register(CONNECTOR_NAME)(LocalMediaConnector)
