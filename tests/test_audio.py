"""Audio clips in the conversation (OpenAI `input_audio` parts), on real llama.cpp with a
generated qwen35 and its generated projector, whose audio encoder is Ultravox's (a Whisper
encoder, frames stacked, an MLP): a clip's follow-up turn is served from cache without the
encoder, bit-exact, and a different clip with the same text never is; WAV is read at any
rate and channel count, and MP3 (the clip llama.cpp's own tests use); a clip's length is
refused before its samples are decoded."""

from __future__ import annotations

import base64
import io
import tarfile
import wave

import numpy as np
import pytest
from test_images import GREEDY, chat_prompt

from baton_serve.cache_store.media_tokens import media_spans
from baton_serve.deploy import llama_build
from baton_serve.replicas.engine.media_input import MediaBounds, MediaError, decode_audio
from baton_serve.replicas.models.tiny_projector import AUDIO_TOKENS


def wav_clip(seed: int, seconds: float = 1.0, rate: int = 16000, channels: int = 1) -> bytes:
    """A WAV file of 16-bit noise."""
    rng = np.random.default_rng(seed)
    samples = (rng.standard_normal(int(seconds * rate) * channels) * 3000).astype("<i2")
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as file:
        file.setnchannels(channels)
        file.setsampwidth(2)
        file.setframerate(rate)
        file.writeframes(samples.tobytes())
    return buffer.getvalue()


def audio_part(data: bytes, audio_format: str = "wav") -> dict:
    return {
        "type": "input_audio",
        "input_audio": {"data": base64.b64encode(data).decode(), "format": audio_format},
    }


def hearing(data: bytes, audio_format: str = "wav") -> dict:
    question = {"type": "text", "text": "What is said here?"}
    return {"role": "user", "content": [question, audio_part(data, audio_format)]}


@pytest.fixture(scope="session")
def llama_cpp_mp3(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """The MP3 llama.cpp's own mtmd tests use (17.4 s of speech, 44.1 kHz), from the pinned
    llama-cpp-python sdist."""
    scratch = tmp_path_factory.mktemp("sdist")
    with tarfile.open(llama_build.download_sdist(scratch)) as archive:
        (member,) = [m for m in archive.getmembers() if m.name.endswith("tools/mtmd/test-2.mp3")]
        file = archive.extractfile(member)
        assert file is not None
        return file.read()


@pytest.mark.parametrize("builder", ["qwen35"], indirect=True)
def test_a_follow_up_after_a_clip_is_served_from_cache_without_the_encoder(
    builder, tiny_model, tiny_projector, make_engine
) -> None:
    model, mmproj = tiny_model("qwen35"), tiny_projector("qwen35")
    engine = make_engine(model, mmproj, n_ctx=1024, prefill_chunk=64, block_tokens=16)
    scratch = make_engine(model, mmproj, n_ctx=1024, prefix_cache=False)
    messages = [{"role": "system", "content": "You listen."}, hearing(wav_clip(1))]
    first = chat_prompt(builder, messages)
    (span,) = media_spans(first.tokens)
    reply = engine.generate(first, GREEDY)
    assert engine.stats.images_encoded == 1

    # the reply replayed (a turn sent during the replay may read the item again: an estimate)
    assert engine.wait_idle(30)
    messages += [{"role": "assistant", "content": reply.text}, {"role": "user", "content": "More?"}]
    second = chat_prompt(builder, messages)
    resumed = engine.generate(second, GREEDY, return_logits=True)
    fresh = scratch.generate(second, GREEDY, return_logits=True)
    assert engine.stats.images_encoded == 1 and engine.stats.images_read == 1
    assert resumed.usage.cached_tokens > span[1]
    assert resumed.tokens == fresh.tokens
    assert float(np.abs(resumed.logits - fresh.logits).max()) == 0.0

    other = chat_prompt(builder, [messages[0], hearing(wav_clip(2))])
    assert other.tokens[: span[0]] == first.tokens[: span[0]] and other.tokens != first.tokens
    assert engine.generate(other, GREEDY).usage.cached_tokens <= span[0]
    assert engine.stats.images_encoded == 2


@pytest.mark.parametrize("builder", ["qwen35"], indirect=True)
def test_wav_at_any_rate_and_the_llama_cpp_mp3_are_read(builder, llama_cpp_mp3) -> None:
    """One second of sound, at 16 kHz mono or 44.1 kHz stereo, is one second of samples at
    the projector's rate; the MP3 is decoded to that rate too, and becomes one clip's span."""
    rate = builder.media_kinds.audio_rate
    assert rate == 16000
    mono = decode_audio(wav_clip(3), "wav", sample_rate=rate, max_seconds=30)
    stereo = decode_audio(
        wav_clip(3, rate=44100, channels=2), "wav", sample_rate=rate, max_seconds=30
    )
    assert mono.n_samples == stereo.n_samples == rate
    speech = decode_audio(llama_cpp_mp3, "mp3", sample_rate=rate, max_seconds=30)
    assert abs(speech.n_samples / rate - 17.44) < 0.05
    prompt = chat_prompt(builder, [hearing(llama_cpp_mp3, "mp3")])
    assert len(media_spans(prompt.tokens)) == 1 and prompt.media[0].audio_format == "mp3"


@pytest.mark.parametrize("builder", ["qwen35"], indirect=True)
def test_a_clip_longer_than_the_encoder_window_is_one_span_of_its_windows(
    builder, tiny_model, tiny_projector, make_engine
) -> None:
    """35 s is two of Whisper's 30 s windows: one span of both windows' tokens, encoded and
    fed in order."""
    engine = make_engine(tiny_model("qwen35"), tiny_projector("qwen35"))
    long = chat_prompt(
        builder, [hearing(wav_clip(5, seconds=35.0))], MediaBounds(max_audio_seconds=60)
    )
    ((start, end),) = media_spans(long.tokens)
    assert end - start == 2 * AUDIO_TOKENS
    assert len(engine.generate(long, GREEDY).tokens) == GREEDY.max_tokens
    assert engine.stats.images_encoded == 1


def test_a_clip_over_its_length_is_refused_before_it_is_decoded(monkeypatch) -> None:
    """The length comes from the file's header: decoding is never reached (a fake decoder
    that fails the test if called)."""
    import miniaudio

    def never(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("decoded a clip over its length")

    monkeypatch.setattr(miniaudio, "decode", never)
    with pytest.raises(MediaError, match="max_audio_seconds"):
        decode_audio(wav_clip(4, seconds=3.0), "wav", sample_rate=16000, max_seconds=2.5)
    with pytest.raises(MediaError, match="cannot be read as mp3"):
        decode_audio(wav_clip(4), "mp3", sample_rate=16000, max_seconds=30)
