"""Locust workloads for Baton's OpenAI API: prefix-sharing chat, agent loops, and a control.

Mix user classes on the command line, e.g.

    locust -f loadtests/locustfile.py --host http://127.0.0.1:8000 --headless \\
        -u 6 -r 2 --run-time 2m --csv out/run --html out/report.html \\
        MultiTurnChatUser AgentLoopUser NoSharingUser

- `MultiTurnChatUser`: a system prompt shared by every user (`--system-tokens`), each user a
  session whose history grows turn by turn (`--chat-turns`, default 8), the previous assistant
  reply sent back.
- `AgentLoopUser`: a large fixed tool/instruction header, many short turns with no pause
  between them (the next request the instant the answer arrives, a tool result appended);
  now and then (seeded) the previous turn's reasoning is dropped from the history, which
  changes the prompt's tail — the case that breaks naive prefix caches. Each follow-up whose
  history was kept is checked: did it find at least 90% of the previous prompt cached
  ("kept", printed with the token usage)?
- `NoSharingUser`: independent prompts, nothing shared (the control).

Every request streams (`stream_options.include_usage`). Besides the request itself
("POST", name "chat <Class>", time = whole stream, length = completion tokens) each
successful request reports "TTFT" (time to the first content chunk) and "ITL" (the mean gap
between content chunks of that request) under the user class's name. `prompt_tokens` and
`cached_tokens` from the usage chunk are summed per user class, printed when locust quits and,
with `--csv PREFIX`, written to `PREFIX_tokens.csv`. A non-200 status, a malformed event, an
error event or a stream without `data: [DONE]` is a failure.

A local run with `--csv PREFIX` also writes every sample, timestamped, to `PREFIX_samples.csv`
(`baton bench soak` reads it for figures over time), and every answered request's prompt and
cached tokens, and whether it continues the previous one's history, to `PREFIX_turns.csv`
(`baton bench restart`): each to `….csv.part` as they come, renamed when locust quits.

Sizes are in words, a client-side stand-in for tokens (no tokenizer needed here).
"""

from __future__ import annotations

import itertools
import random
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from gevent.lock import Semaphore
from locust import HttpUser, between, constant, events, task

from baton_serve.loadtests import sse
from baton_serve.loadtests.locust_tokens import record_follow_up, record_turn, record_usage
from baton_serve.loadtests.sample_log import SampleLog
from baton_serve.loadtests.synthetic_text import filler_text

CHAT_PATH = "/v1/chat/completions"
MODELS_PATH = "/v1/models"


def _words(text: str) -> int:
    return len(text.split())


# ---- command line -----------------------------------------------------------------------------


@events.init_command_line_parser.add_listener
def _add_arguments(parser) -> None:
    group = parser.add_argument_group("Baton", "Baton workload options")
    group.add_argument("--api-key", default="", help="sent as `Authorization: Bearer KEY`")
    group.add_argument("--model", default="", help="model name (default: the first of /v1/models)")
    group.add_argument("--max-tokens", type=int, default=32, help="max_tokens of every request")
    group.add_argument(
        "--system-tokens",
        type=int,
        default=2000,
        help="size of the shared system prompt / agent header, in words (≈ tokens)",
    )
    group.add_argument("--seed", type=int, default=0, help="seed of prompts and agent choices")
    group.add_argument(
        "--chat-turns", type=int, default=8, help="turns of a MultiTurnChatUser session"
    )


# ---- SSE parsing ------------------------------------------------------------------------------


@dataclass
class StreamResult:
    text: str = ""
    ttft_s: float | None = None
    gaps_s: list[float] = field(default_factory=list)
    usage: dict | None = None


def read_stream(lines: Iterable[bytes], start: float) -> StreamResult:
    """Consume a chat stream, timing content chunks from `start` (a `time.perf_counter()`
    value). Raises `StreamError` on anything malformed (`loadtests/sse.py`)."""
    result = StreamResult()
    parts: list[str] = []
    last: float | None = None
    for event in sse.events(lines):
        if event.get("usage"):
            result.usage = event["usage"]
        for choice in event.get("choices") or ():
            content = (choice.get("delta") or {}).get("content")
            if content:
                now = time.perf_counter()
                if last is None:
                    result.ttft_s = now - start
                else:
                    result.gaps_s.append(now - last)
                last = now
                parts.append(content)
    result.text = "".join(parts)
    return result


# ---- per-request samples (local runs) ----------------------------------------------------------

SAMPLE_FIELDS = ("time_s", "type", "name", "response_time_ms", "ok")
_SAMPLES = SampleLog("samples", SAMPLE_FIELDS)


@events.request.add_listener
def _keep_sample(request_type, name, response_time, exception=None, **_kwargs) -> None:
    _SAMPLES.write((time.time(), request_type, name, response_time, exception is None))


# ---- the users --------------------------------------------------------------------------------

_MODEL: str | None = None
_MODEL_LOCK = Semaphore()
_USER_IDS = itertools.count()


class BatonUser(HttpUser):
    """Shared plumbing: options, the model name, one streamed chat request with its metrics."""

    abstract = True
    wait_time = between(0.05, 0.3)
    previous_prompt = 0  # prompt tokens of the request the next one continues (0: none)

    def on_start(self) -> None:
        options = self.environment.parsed_options
        self.max_tokens = getattr(options, "max_tokens", 32)
        self.system_words = getattr(options, "system_tokens", 2000)
        self.seed = getattr(options, "seed", 0)
        key = getattr(options, "api_key", "")
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.user_id = next(_USER_IDS)
        self.rng = random.Random(self.seed * 1_000_003 + self.user_id)
        self.model = getattr(options, "model", "") or self._discover_model()

    def _discover_model(self) -> str:
        global _MODEL
        with _MODEL_LOCK:
            if _MODEL is None:
                response = self.client.get(MODELS_PATH, headers=self.headers, name=MODELS_PATH)
                response.raise_for_status()
                _MODEL = response.json()["data"][0]["id"]
        return _MODEL

    def chat(self, messages: list[dict]) -> str | None:
        """One streamed chat completion; returns the reply text, or None on failure (its
        usage is then in `self.last_usage`)."""
        name = type(self).__name__
        body = {
            "model": self.model,
            "messages": messages,
            "max_tokens": self.max_tokens,
            "temperature": 0.7,
            "seed": self.rng.randrange(1 << 30),
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        start = time.perf_counter()
        with self.client.post(
            CHAT_PATH,
            json=body,
            headers=self.headers,
            name=f"chat {name}",
            stream=True,
            catch_response=True,
            timeout=300,
        ) as response:
            if response.status_code != 200:
                response.failure(f"HTTP {response.status_code}: {response.text[:200]}")
                return None
            try:
                result = read_stream(response.iter_lines(chunk_size=None), start)
            except Exception as exc:  # a StreamError, or the connection broke mid-stream
                response.failure(exc)
                return None
            usage = result.usage or {}
            response.request_meta["response_time"] = (time.perf_counter() - start) * 1000
            response.request_meta["response_length"] = int(usage.get("completion_tokens") or 0)
            if result.usage is None:
                response.failure("no usage chunk although include_usage was asked for")
                return None
            response.success()
        record_usage(name, result.usage)
        record_turn(name, self.previous_prompt, result.usage, result.ttft_s, time.time())
        self.last_usage = result.usage
        fire = self.environment.events.request.fire
        if result.ttft_s is not None:
            fire(
                request_type="TTFT",
                name=name,
                response_time=result.ttft_s * 1000,
                response_length=int(usage.get("prompt_tokens") or 0),
                exception=None,
                context={},
            )
        if result.gaps_s:
            itl_ms = 1000 * sum(result.gaps_s) / len(result.gaps_s)
            fire(
                request_type="ITL",
                name=name,
                response_time=itl_ms,
                response_length=len(result.gaps_s) + 1,
                exception=None,
                context={},
            )
        return result.text


class MultiTurnChatUser(BatonUser):
    """A shared system prompt; a session's history grows turn by turn."""

    def on_start(self) -> None:
        super().on_start()
        self.max_turns = getattr(self.environment.parsed_options, "chat_turns", 8)
        self.system = filler_text(
            self.system_words, _words, seed=self.seed, topic="You are Baton's assistant."
        )
        self._new_session()

    def _new_session(self) -> None:
        self.messages = [{"role": "system", "content": self.system}]
        self.turn = 0
        self.previous_prompt = 0

    @task
    def turn_of_chat(self) -> None:
        if self.turn >= self.max_turns:
            self._new_session()
        question = filler_text(
            self.rng.randint(10, 30),
            _words,
            seed=self.rng.randrange(1 << 30),
            topic=f"User {self.user_id}, turn {self.turn}:",
        )
        self.messages.append({"role": "user", "content": question})
        reply = self.chat(self.messages)
        if reply is None:
            self._new_session()  # don't build on a broken history
            return
        if self.previous_prompt:
            record_follow_up(type(self).__name__, self.previous_prompt, self.last_usage)
        self.previous_prompt = int(self.last_usage.get("prompt_tokens") or 0)
        self.messages.append({"role": "assistant", "content": reply or "(no reply)"})
        self.turn += 1


class AgentLoopUser(BatonUser):
    """A large fixed tool header; short observation/action turns with no pause between them;
    reasoning sometimes dropped."""

    wait_time = constant(0)  # an agent sends the next step the instant it has the answer
    max_turns = 12
    drop_reasoning_p = 0.3
    tools = ("search", "read_file", "run_tests", "edit_file", "list_dir", "http_get")

    def on_start(self) -> None:
        super().on_start()
        specs = "\n".join(
            f"- {tool}(args: object) -> string: "
            + filler_text(20, _words, seed=self.seed + i, topic=f"Tool {tool}.")
            for i, tool in enumerate(self.tools)
        )
        instructions = filler_text(
            max(self.system_words - _words(specs), 50),
            _words,
            seed=self.seed + 7,
            topic="You are an agent. Think, then call exactly one tool per turn.",
        )
        self.header = f"# Tools\n{specs}\n\n# Instructions\n{instructions}"
        self._new_session()

    def _new_session(self) -> None:
        self.messages = [
            {"role": "system", "content": self.header},
            {
                "role": "user",
                "content": f"Task {self.user_id}-{self.rng.randrange(1 << 20)}: fix the failing build.",
            },
        ]
        self.turn = 0
        self.previous_prompt = 0  # tokens of the last prompt whose history this one keeps

    @task
    def agent_step(self) -> None:
        if self.turn >= self.max_turns:
            self._new_session()
        reply = self.chat(self.messages)
        if reply is None:
            self._new_session()
            return
        if self.previous_prompt:
            record_follow_up(type(self).__name__, self.previous_prompt, self.last_usage)
        self.previous_prompt = int(self.last_usage.get("prompt_tokens") or 0)
        tool = self.rng.choice(self.tools)
        action = f'Action: {tool}({{"step": {self.turn}}})'
        if self.turn and self.rng.random() < self.drop_reasoning_p:
            # Strip the previous turn's reasoning, as many agent clients do: the prompt's tail
            # changes from that message on.
            previous = self.messages[-2]
            if previous["role"] == "assistant" and "\n" in previous["content"]:
                previous["content"] = previous["content"].split("\n", 1)[1]
                self.previous_prompt = 0  # the history changed: not a follow-up that keeps it
        self.messages.append(
            {"role": "assistant", "content": f"Thought: {reply.strip()}\n{action}"}
        )
        observation = filler_text(
            self.rng.randint(5, 15),
            _words,
            seed=self.rng.randrange(1 << 30),
            topic=f"Result of {tool}:",
        )
        self.messages.append({"role": "user", "content": observation})
        self.turn += 1


class NoSharingUser(BatonUser):
    """Independent prompts of about the same size: no prefix in common (the control)."""

    @task
    def one_off(self) -> None:
        nonce = self.rng.randrange(1 << 40)
        system = filler_text(self.system_words, _words, seed=nonce, topic=f"Request {nonce:x}.")
        question = filler_text(20, _words, seed=nonce + 1, topic=f"Question {nonce:x}:")
        self.chat([{"role": "system", "content": system}, {"role": "user", "content": question}])
