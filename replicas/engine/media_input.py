"""Images and audio clips a request sends, read and bounded before anything expensive is
done with them.

A `data:` URL's size is checked before its base64 is decoded, an image's pixel count from
its header before its pixels are, and only common raster formats are opened (Pillow's
other openers, some of which run external programs, never see a client's bytes). A clip's
length is read from its header (WAV) or its frames (MP3, counted without decoding them)
before it is decoded, by miniaudio, the library llama.cpp's own audio helper uses. The
gateway reads each item once (for its token count and its identity) and the replica reads
it again from the same bytes, checking that it finds the same item.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
from dataclasses import dataclass

import miniaudio
from PIL import Image, UnidentifiedImageError

from baton_serve.cache_store.wire.prompt_types import AudioFormat

IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
# The longest clip any setting allows (`max_audio_seconds`), and a replica reads at most.
AUDIO_SECONDS_CEILING = 600.0
_AUDIO_INFO = {"wav": miniaudio.wav_get_info, "mp3": miniaudio.mp3_get_info}
DATA_URL_PREFIX = "data:"
DIGEST_BYTES = 32


class MediaError(ValueError):
    """An image or clip that cannot be read, or that is over a bound; `param` names the part."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class MediaBounds:
    """The most images one request carries, the most bytes and pixels of each, and the
    hosts whose image URLs the gateway fetches (none by default), within a timeout; the
    most audio clips, and the most bytes and seconds of each (Whisper-style encoders take
    30 s a clip)."""

    max_images: int = 16
    max_image_bytes: int = 10 << 20
    max_image_pixels: int = 7680 * 4320
    url_hosts: tuple[str, ...] = ()
    fetch_timeout_s: float = 10.0
    max_audio_clips: int = 4
    max_audio_bytes: int = 10 << 20
    max_audio_seconds: float = 30.0


@dataclass(frozen=True)
class DecodedImage:
    """An image's RGB pixels (row-major, 3 bytes a pixel) and its identity: the digest of
    its size and pixels, so two files of one picture are one image and no two pictures are."""

    width: int
    height: int
    rgb: bytes
    source: bytes  # the file as sent, what travels to the replica
    digest: bytes


@dataclass(frozen=True)
class DecodedAudio:
    """A clip's samples (mono float32, native byte order, at `sample_rate`) and its
    identity: the digest of its rate and samples, so two files of one sound are one clip."""

    samples: bytes
    sample_rate: int
    source: bytes  # the file as sent, what travels to the replica
    audio_format: AudioFormat
    digest: bytes

    @property
    def n_samples(self) -> int:
        return len(self.samples) // 4


DecodedMedia = DecodedImage | DecodedAudio


def data_url_bytes(url: str, max_bytes: int, param: str) -> bytes:
    """The bytes a base64 `data:` URL holds, refused over `max_bytes` before decoding."""
    header, comma, payload = url.partition(",")
    if not comma or not header.endswith(";base64"):
        raise MediaError("a data: URL must be base64 (data:<type>;base64,<data>)", param)
    return base64_bytes(payload, max_bytes, param, item="image", setting="max_image_bytes")


def base64_bytes(
    payload: str,
    max_bytes: int,
    param: str,
    *,
    item: str = "clip",
    setting: str = "max_audio_bytes",
) -> bytes:
    """The bytes `payload` (base64) holds, refused over `max_bytes` (the `setting`) before
    decoding."""
    if len(payload) * 3 // 4 > max_bytes + 2:
        raise MediaError(f"the {item} is over {max_bytes} bytes ({setting})", param)
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise MediaError(f"the {item}'s base64 does not decode", param) from None
    if len(data) > max_bytes:
        raise MediaError(f"the {item} is {len(data)} bytes, over {max_bytes} ({setting})", param)
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


def decode_audio(
    data: bytes,
    audio_format: AudioFormat,
    *,
    sample_rate: int,
    max_seconds: float,
    param: str | None = None,
) -> DecodedAudio:
    """`data` read as a `audio_format` clip, mixed to mono at `sample_rate`; refused over
    `max_seconds` before its samples are decoded."""
    try:
        info = _AUDIO_INFO[audio_format](data)
        if info.duration > max_seconds:
            raise MediaError(
                f"the clip is {info.duration:.1f} s long, over {max_seconds:g} s "
                "(max_audio_seconds)",
                param,
            )
        sound = miniaudio.decode(
            data,
            output_format=miniaudio.SampleFormat.FLOAT32,
            nchannels=1,
            sample_rate=sample_rate,
        )
    except miniaudio.DecodeError as exc:
        raise MediaError(f"the clip cannot be read as {audio_format}: {exc}", param) from None
    samples = sound.samples.tobytes()
    if not samples:
        raise MediaError("the clip has no samples", param)
    h = hashlib.blake2b(f"audio {sample_rate}:".encode(), digest_size=DIGEST_BYTES)
    h.update(samples)
    return DecodedAudio(samples, sample_rate, data, audio_format, h.digest())


def image_digest(width: int, height: int, rgb: bytes) -> bytes:
    h = hashlib.blake2b(f"{width}x{height}:".encode(), digest_size=DIGEST_BYTES)
    h.update(rgb)
    return h.digest()
