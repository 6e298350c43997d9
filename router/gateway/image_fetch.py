"""Images a chat names by URL, fetched by the gateway only from the hosts an operator lists
(`image_url_hosts`): fetching on a client's behalf reaches whatever the server can (its own
network, a cloud's metadata endpoint), so nothing is fetched by default. A fetch is bounded:
`max_image_bytes` (read no further), `image_fetch_timeout_s` (connect and each read), no
redirects (a listed host could send the fetch anywhere), and it runs in a prompt thread."""

from __future__ import annotations

from urllib.parse import urlsplit

import httpx

from baton_serve.replicas.engine.media_input import MediaBounds, MediaError


def fetch_image(url: str, bounds: MediaBounds, param: str) -> bytes:
    """The bytes at `url`, an http(s) URL on a listed host; `MediaError` naming `param`."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise MediaError("an image URL is a base64 data: URL or an http(s) URL", param)
    host = parts.hostname if parts.port is None else f"{parts.hostname}:{parts.port}"
    if parts.hostname not in bounds.url_hosts and host not in bounds.url_hosts:
        listed = ", ".join(bounds.url_hosts) or "none"
        raise MediaError(
            f"this server does not fetch images from {parts.hostname} (image_url_hosts: "
            f"{listed}); send the image as a base64 data: URL",
            param,
        )
    limit = bounds.max_image_bytes
    try:
        with httpx.Client(timeout=bounds.fetch_timeout_s, follow_redirects=False) as client:
            with client.stream("GET", url) as response:
                if response.status_code != 200:
                    raise MediaError(f"fetching the image got HTTP {response.status_code}", param)
                data = bytearray()
                for chunk in response.iter_bytes():
                    data += chunk
                    if len(data) > limit:
                        raise MediaError(
                            f"the image is over {limit} bytes (max_image_bytes)", param
                        )
                return bytes(data)
    except httpx.HTTPError as exc:
        raise MediaError(f"the image could not be fetched: {type(exc).__name__}", param) from None
