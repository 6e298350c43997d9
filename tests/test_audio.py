"""Audio clips in the conversation (OpenAI `input_audio` parts), on real llama.cpp with a
generated qwen35 and its generated projector, whose audio encoder is Ultravox's (a Whisper
encoder, frames stacked, an MLP): WAV is read at any rate and channel count, and MP3 (the
clip llama.cpp's own tests use); a clip longer than the encoder's window is one span; a
clip's length is refused before its samples are decoded. What clips share with images (a
follow-up from cache without the encoder, another clip never matching) is in
`test_images.py`."""

from __future__ import annotations

import tarfile

import pytest
from media_inputs import chat_prompt, hearing, wav_clip
from test_images import GREEDY

from baton_serve.cache_store.media_tokens import media_spans
from baton_serve.deploy import llama_build
from baton_serve.replicas.engine.media_input import MediaBounds, MediaError, decode_audio
from baton_serve.replicas.models.tiny_projector import AUDIO_TOKENS


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
