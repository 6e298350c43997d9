"""Images a request sends, read and bounded before anything expensive is done with them.

A `data:` URL's size is checked before its base64 is decoded, an image's pixel count from
its header before its pixels are, and only common raster formats are opened (Pillow's
other openers, some of which run external programs, never see a client's bytes). The
gateway reads each image once (for its token count and its identity) and the replica reads
it again from the same bytes, checking that it finds the same image.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
from dataclasses import dataclass

from PIL import Image, UnidentifiedImageError

IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
DATA_URL_PREFIX = "data:"
DIGEST_BYTES = 32


class MediaError(ValueError):
    """An image that cannot be read, or that is over a bound; `param` names the part."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class MediaBounds:
    """The most images one request carries, the most bytes and pixels of each, and the
    hosts whose image URLs the gateway fetches (none by default), within a timeout."""

    max_images: int = 16
    max_image_bytes: int = 10 << 20
    max_image_pixels: int = 7680 * 4320
    url_hosts: tuple[str, ...] = ()
    fetch_timeout_s: float = 10.0


@dataclass(frozen=True)
class DecodedImage:
    """An image's RGB pixels (row-major, 3 bytes a pixel) and its identity: the digest of
    its size and pixels, so two files of one picture are one image and no two pictures are."""

    width: int
    height: int
    rgb: bytes
    source: bytes  # the file as sent, what travels to the replica
    digest: bytes


def data_url_bytes(url: str, max_bytes: int, param: str) -> bytes:
    """The bytes a base64 `data:` URL holds, refused over `max_bytes` before decoding."""
    header, comma, payload = url.partition(",")
    if not comma or not header.endswith(";base64"):
        raise MediaError("a data: URL must be base64 (data:<type>;base64,<data>)", param)
    if len(payload) * 3 // 4 > max_bytes + 2:
        raise MediaError(f"the image is over {max_bytes} bytes (max_image_bytes)", param)
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise MediaError("the data: URL's base64 does not decode", param) from None
    if len(data) > max_bytes:
        raise MediaError(
            f"the image is {len(data)} bytes, over {max_bytes} (max_image_bytes)", param
        )
    return data


def decode_image(data: bytes, max_pixels: int, param: str | None = None) -> DecodedImage:
    """`data` read as an image (its first frame), refused over `max_pixels` before its
    pixels are decoded."""
    try:
        with Image.open(io.BytesIO(data), formats=IMAGE_FORMATS) as image:
            width, height = image.size
            if width * height > max_pixels:
                raise MediaError(
                    f"the image is {width}x{height}, over {max_pixels} pixels (max_image_pixels)",
                    param,
                )
            rgb = image.convert("RGB").tobytes()
    except MediaError:
        raise
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as exc:
        kinds = ", ".join(IMAGE_FORMATS)
        raise MediaError(f"the image cannot be read ({kinds} are): {exc}", param) from None
    if not width or not height:
        raise MediaError("the image has no pixels", param)
    return DecodedImage(width, height, rgb, data, image_digest(width, height, rgb))


def image_digest(width: int, height: int, rgb: bytes) -> bytes:
    h = hashlib.blake2b(f"{width}x{height}:".encode(), digest_size=DIGEST_BYTES)
    h.update(rgb)
    return h.digest()
