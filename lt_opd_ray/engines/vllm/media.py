"""How `lt-opd serve` reads a request's images: inline only, unless the operator allows domains.

vLLM's default media connector fetches any http(s) URL a client sends; a local
student server should not make outbound requests on a client's behalf. This one
(selected by `VLLM_MEDIA_CONNECTOR=lt_opd_local`, which `lt-opd serve` sets) refuses
remote URLs unless the server was started with `--allowed-media-domains`, and turns
an image over PIL's decompression-bomb limit into a 400 naming it, not a 500.
"""

from __future__ import annotations

CONNECTOR_NAME = "lt_opd_local"


def register_media_connector() -> None:
    from PIL import Image
    from vllm.multimodal.media import MEDIA_CONNECTOR_REGISTRY, MediaConnector

    class LocalMediaConnector(MediaConnector):
        def _check(self, url: str) -> None:
            scheme = url.split(":", 1)[0].lower()
            if scheme in ("http", "https") and not self.allowed_media_domains:
                raise ValueError(
                    "remote image URLs are off on this server: send the image inline (a data: URL with base64),"
                    " or start the server with `-- --allowed-media-domains HOST` to fetch from HOST"
                )

        def load_from_url(self, url, media_io, *, fetch_timeout=None):
            self._check(url)
            try:
                return super().load_from_url(url, media_io, fetch_timeout=fetch_timeout)
            except Image.DecompressionBombError as exc:
                raise ValueError(f"image refused, too many pixels (a decompression bomb?): {exc}") from None

        async def load_from_url_async(self, url, media_io, *, fetch_timeout=None):
            self._check(url)
            try:
                return await super().load_from_url_async(url, media_io, fetch_timeout=fetch_timeout)
            except Image.DecompressionBombError as exc:
                raise ValueError(f"image refused, too many pixels (a decompression bomb?): {exc}") from None

    MEDIA_CONNECTOR_REGISTRY.register(CONNECTOR_NAME)(LocalMediaConnector)
