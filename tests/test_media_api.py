"""Images and audio clips through the OpenAI API: the OpenAI SDK sends image_url and
input_audio parts to a real gateway over real HTTP (one replica of a generated qwen35 with
its generated projector, which reads both), streamed and not; a follow-up turn comes back
cached; each part Baton cannot take gets a 400 naming it."""

from __future__ import annotations

import base64
import io
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import openai
import pytest
from gateway_harness import serving
from media_inputs import audio_part, image_url, wav_clip
from PIL import Image

from baton_serve.replicas.engine.engine_config import EngineConfig
from baton_serve.replicas.engine.media_input import MediaBounds
from baton_serve.router.gateway.gateway import GatewaySettings

MODEL = "baton-vision"


class ImageHost(BaseHTTPRequestHandler):
    """A real HTTP server an operator lists in `image_url_hosts`: an image, one too large,
    a redirect (to an image), a missing path."""

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        body = {
            "/cat.png": base64.b64decode(image_url(5).partition(",")[2]),
            "/huge.png": b"\0" * (65 << 10),
        }.get(self.path)
        if self.path == "/moved":
            self.send_response(302)
            self.send_header("Location", "/cat.png")
            self.end_headers()
            return
        self.send_response(200 if body else 404)
        self.send_header("Content-Length", str(len(body or b"")))
        self.end_headers()
        self.wfile.write(body or b"")

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def image_host():
    server = ThreadingHTTPServer(("127.0.0.1", 0), ImageHost)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.fixture(scope="module")
def served(tiny_model, tiny_projector, image_host):
    bounds = MediaBounds(
        max_images=2,
        max_image_bytes=64 << 10,
        max_image_pixels=1 << 16,
        url_hosts=(image_host,),
        max_audio_clips=1,
        max_audio_bytes=128 << 10,
        max_audio_seconds=2.0,
    )
    settings = GatewaySettings(
        MODEL,
        str(tiny_model("qwen35")),
        n_ctx=1024,
        mmproj=str(tiny_projector("qwen35")),
        media_bounds=bounds,
    )
    with serving(settings, EngineConfig(n_ctx=1024, n_slots=2, n_threads=2)) as served:
        yield served


def _image_message(seed: int) -> dict:
    return {
        "role": "user",
        "content": [
            {"type": "text", "text": "What is in this picture?"},
            {"type": "image_url", "image_url": {"url": image_url(seed)}},
        ],
    }


def _streamed(client: openai.OpenAI, messages: list[dict]) -> list:
    """A streamed chat's chunks, the usage last."""
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
    )
    return list(stream)


def test_the_openai_sdk_sends_an_image_and_its_follow_up_is_cached(served) -> None:
    client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="none")
    assert client.models.list().data[0].model_extra["modalities"] == ["text", "image", "audio"]
    messages = [_image_message(7)]
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6)
    reply = first.choices[0].message.content
    encoded = served.engine.stats.images_encoded
    assert encoded == 1 and first.usage.prompt_tokens > 9  # the image's 9 tokens and text

    messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "More?"}]
    chunks = _streamed(client, messages)
    usage = chunks[-1].usage
    assert usage is not None and usage.prompt_tokens_details.cached_tokens > 9
    assert served.engine.stats.images_encoded == encoded  # not encoded again


def _png_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def _blank_png(side: int) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (side, side)).save(buffer, "PNG")  # compresses to almost nothing
    return buffer.getvalue()


BAD_PARTS = [
    pytest.param(_png_url(b"not a png at all"), "cannot be read", id="undecodable"),
    pytest.param("data:image/png;base64,@@@@", "does not decode", id="bad base64"),
    pytest.param("https://example.com/cat.png", "image_url_hosts", id="an unlisted host"),
    pytest.param("file:///etc/passwd", "data: URL or an http(s) URL", id="a file URL"),
    pytest.param(_png_url(b"\0" * (65 << 10)), "max_image_bytes", id="too many bytes"),
    pytest.param(_png_url(_blank_png(300)), "max_image_pixels", id="too many pixels"),
]


def _chat(served, url: str) -> httpx.Response:
    content = [{"type": "text", "text": "see"}, {"type": "image_url", "image_url": {"url": url}}]
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 2}
    return httpx.post(f"{served.url}/v1/chat/completions", json=body, timeout=30)


def test_an_image_url_on_a_listed_host_is_fetched(served, image_host) -> None:
    response = _chat(served, f"http://{image_host}/cat.png")
    assert response.status_code == 200, response.text
    for path, says in (("huge.png", "max_image_bytes"), ("moved", "HTTP 302"), ("x", "HTTP 404")):
        response = _chat(served, f"http://{image_host}/{path}")
        assert response.status_code == 400 and says in response.json()["error"]["message"]


@pytest.mark.parametrize(("url", "says"), BAD_PARTS)
def test_a_bad_image_gets_a_400_naming_its_part(served, url: str, says: str) -> None:
    content = [{"type": "text", "text": "see"}, {"type": "image_url", "image_url": {"url": url}}]
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}]}
    response = httpx.post(f"{served.url}/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "messages[0].content[1]" and says in error["message"]


def test_more_images_than_the_bound_get_a_400_before_any_is_read(served) -> None:
    parts = [{"type": "image_url", "image_url": {"url": "data:,"}}] * 3
    body = {"model": MODEL, "messages": [{"role": "user", "content": parts}]}
    response = httpx.post(f"{served.url}/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 400
    assert "max_images" in response.json()["error"]["message"]


def test_the_openai_sdk_sends_a_clip_and_its_follow_up_is_cached(served) -> None:
    client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="none")
    question = {"type": "text", "text": "What is said here?"}
    messages = [{"role": "user", "content": [question, audio_part(wav_clip(8))]}]
    chunks = _streamed(client, messages)
    reply = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    clip_tokens = chunks[-1].usage.prompt_tokens
    encoded = served.engine.stats.images_encoded

    messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "More?"}]
    follow_up = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6)
    assert follow_up.usage.prompt_tokens_details.cached_tokens >= clip_tokens - 8
    assert served.engine.stats.images_encoded == encoded  # not encoded again


BAD_CLIPS = [
    pytest.param(audio_part(b"not audio at all"), "cannot be read as wav", id="undecodable"),
    pytest.param(
        {"type": "input_audio", "input_audio": {"data": "@@@@", "format": "wav"}},
        "does not decode",
        id="bad base64",
    ),
    pytest.param(audio_part(wav_clip(9, seconds=3.0)), "max_audio_seconds", id="too long"),
    pytest.param(audio_part(wav_clip(9, seconds=5.0)), "max_audio_bytes", id="too many bytes"),
]


@pytest.mark.parametrize(("part", "says"), BAD_CLIPS)
def test_a_bad_clip_gets_a_400_naming_its_part(served, part: dict, says: str) -> None:
    content = [{"type": "text", "text": "hear"}, part]
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}]}
    response = httpx.post(f"{served.url}/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "messages[0].content[1]" and says in error["message"]


def test_a_clip_format_or_count_baton_cannot_take_gets_a_400(served) -> None:
    flac = {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "flac"}}
    two = [audio_part(wav_clip(10)), audio_part(wav_clip(11))]
    for content, says in (([flac], "'wav' or 'mp3'"), (two, "max_audio_clips")):
        body = {"model": MODEL, "messages": [{"role": "user", "content": content}]}
        response = httpx.post(f"{served.url}/v1/chat/completions", json=body, timeout=30)
        assert response.status_code == 400, response.text
        assert says in response.json()["error"]["message"]
