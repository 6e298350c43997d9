"""The replica engine: one llama.cpp context, several sequence slots, continuous batching.

One thread (the engine loop) owns the llama context. Requests join between steps. A step
carries every generating sequence's next token and pieces of prompts within
`step_tokens`, so a prompt never stops the running streams for more than one step
(`step_executor` computes it: in one llama_decode, or the decode rows first and each
piece in a call of its own where reuse is exact).

`step_plan.plan_step` decides each step over plain data (of several prompts, the one with
the least left goes first, aged); the loop executes it. Which cached state serves a prompt
is `prefix_cache`'s job. The loop keeps those states exact: prompts are computed in pieces
of two or more tokens, and after a reply is sent it is recomputed as a prefill (a *replay*)
instead of keeping the state built one token at a time, whose kernels round differently.
A resumed conversation thus gives the same logits as a cold one (`exact_reuse` off keeps
the decode's state instead, as llama-server does).

States stay where they are: a slot keeps its attention KV and, at its prompt's checkpoint
positions, partial states (anchors) to rewind to, so a resident prefix costs no copy of
attention KV. Full states are stored for what others share (a system prompt, a long
prefill's interval positions) and, for a finished conversation, only once nothing else
runs or when its slot is given away: never while other streams wait on the step.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Sequence

import numpy as np

from baton_serve.cache_store.wire.prompt_types import ChatMessage, Prompt
from baton_serve.cache_store.wire.protocol import (
    Completion,
    EngineClosed,
    EngineError,
    EngineStalled,
    GenerationRequest,
)
from baton_serve.cache_store.wire.sampling_params import SamplingParams
from baton_serve.replicas.engine import device_memory
from baton_serve.replicas.engine.checkpoint_policy import MIN_PIECE, prefill_pieces
from baton_serve.replicas.engine.emulated_compute import load_model, open_context
from baton_serve.replicas.engine.engine_checkpoints import EngineCheckpoints
from baton_serve.replicas.engine.engine_config import EngineConfig, for_device
from baton_serve.replicas.engine.liveness import IDLE_BEAT_S, Heartbeat, request_deadline_s
from baton_serve.replicas.engine.media_projector import MediaProjector
from baton_serve.replicas.engine.prefix_cache import InFlightShare, PrefixCache
from baton_serve.replicas.engine.prefix_states import CheckpointListener, PrefixStates
from baton_serve.replicas.engine.prompt import (
    PromptError,
    chat_prompt,
    model_chat_template,
    no_chat_template_message,
    text_prompt,
)
from baton_serve.replicas.engine.prompt_media import prepare_media
from baton_serve.replicas.engine.request_check import check_request
from baton_serve.replicas.engine.request_handle import RequestHandle
from baton_serve.replicas.engine.slots import Phase, Running, Slot, start_request
from baton_serve.replicas.engine.stats import EngineLoad, EngineStats
from baton_serve.replicas.engine.step_executor import StepExecutor
from baton_serve.replicas.engine.step_guard import StepGuard
from baton_serve.replicas.engine.step_plan import Queued, StepPlan, StepView, plan_step

logger = logging.getLogger("baton.engine")


class Engine(EngineCheckpoints):
    """Serves generation requests for one model from one llama.cpp context."""

    def __init__(
        self,
        model_path: str,
        config: EngineConfig | None = None,
        *,
        hmac_key: bytes,
        listener: CheckpointListener | None = None,
        mmproj: str | None = None,
    ) -> None:
        """`mmproj`: a projector's GGUF (llama.cpp's mtmd) for the model to read images or audio."""
        if not hmac_key:
            raise ValueError("an HMAC key is required to sign and check state blobs")
        config = config or EngineConfig()
        self.config = for_device(config, device_memory.offloads(config))
        device_memory.check_fits(model_path, self.config)  # before anything is on a device
        self.model = load_model(model_path, self.config)  # llama.cpp's, or emulated
        logger.info(
            "engine on %s: exact_reuse %s, flash attention %s",
            ", ".join(self.model.devices) or "the CPU",
            self.config.exact_reuse,
            {True: "on", False: "off", None: "llama.cpp's auto"}[self.config.flash_attn],
        )
        self.kind = self.model.kind
        self.fingerprint = self.model.fingerprint
        self.stats = EngineStats()
        params = device_memory.engine_context_params(self.config, self.model.n_ctx_train)
        self._context = open_context(self.model, params)
        self.n_ctx = self._context.n_ctx_per_seq
        self._projector = self._load_projector(mmproj)
        states = PrefixStates(self.model, self._context, self.config, self.stats, hmac_key=hmac_key)
        self._cache = PrefixCache(states, self.config, self.stats)  # `EngineCheckpoints` shows it
        if listener is not None:  # others may be added later, before requests arrive
            self.add_checkpoint_listener(listener)
        self._chat_template = model_chat_template(self.model, self.config.chat_template)
        self._slots = [Slot(seq_id=i) for i in range(self.config.n_slots)]
        self._waiting: list[RequestHandle] = []
        self._wakeup = threading.Condition()
        self._closed = False
        self._idle = threading.Event()
        self._peer_asks = deque()
        self._shares: dict[RequestHandle, InFlightShare] = {}  # the last plan's, to reserve
        self._guard = StepGuard(self._context, self.stats)
        self._executor = StepExecutor(
            self.config, self._guard, self._cache, self.stats, self._sampled
        )
        self._heartbeat = Heartbeat(self.config.stall_timeout_s)
        self._thread = threading.Thread(target=self._run, name="baton-engine", daemon=True)
        self._thread.start()

    def _load_projector(self, mmproj: str | None) -> MediaProjector | None:
        if mmproj is None:
            return None
        if self.config.emulated is not None:
            raise ValueError("an emulated engine reads no images: serve it without mmproj")
        return MediaProjector(
            mmproj, self.model, use_gpu=bool(self.model.devices), threads=self.config.n_threads
        )

    # ---- prompts -------------------------------------------------------------------------

    def text_prompt(self, text: str) -> Prompt:
        self._check_open()
        return text_prompt(self.model, text, add_bos=self.model.add_bos)

    def chat_prompt(self, messages: list[ChatMessage] | list[dict[str, str]]) -> Prompt:
        self._check_open()
        if self._chat_template is None:
            raise PromptError(no_chat_template_message(self.model.name))
        parsed = [m if isinstance(m, ChatMessage) else ChatMessage(**m) for m in messages]
        return chat_prompt(self.model, self._chat_template, parsed)

    # ---- requests ------------------------------------------------------------------------

    def check(self, request: GenerationRequest) -> None:
        """Raise `PromptError`, `PromptTooLong` or `InvalidGeneration` if it is unservable."""
        self._check_open()
        check_request(
            request, self.model, self.n_ctx, len(self._slots), self.config, self._projector
        )

    def submit(
        self, request: GenerationRequest, prefix_hashes: Sequence[bytes] = ()
    ) -> RequestHandle:
        """Queue a request; raises `PromptError`, `PromptTooLong` or `EngineClosed` at once.
        `prefix_hashes`: its prompt's block hash chain (the gateway's), kept if it fits."""
        self.check(request)
        chain = self.carried_chain(request.prompt.tokens, prefix_hashes)
        handle = RequestHandle(request, request_deadline_s(request, self.n_ctx, self.config), chain)
        if request.prompt.media:  # an item in the prefix the engine likely holds is not read
            likely, _ = self.local_reuse(request.prompt.tokens, chain)
            n_batch = self.config.n_batch
            handle.media = prepare_media(
                request.prompt, self._projector, n_batch, likely, self.stats
            )
        with self._wakeup:
            if self._closed:
                raise EngineClosed("the engine is shut down")
            self._waiting.append(handle)
            self._idle.clear()
            self._wakeup.notify()
        return handle

    def generate(
        self, prompt: Prompt, sampling: SamplingParams | None = None, *, return_logits: bool = False
    ) -> Completion:
        """Submit and wait for the completion."""
        sampling = sampling or SamplingParams()
        request = GenerationRequest(prompt=prompt, sampling=sampling, return_logits=return_logits)
        return self.submit(request).result()

    # ---- lifecycle -----------------------------------------------------------------------

    def load(self) -> EngineLoad:
        """What is queued and running, and about how many prompt tokens wait to be computed
        (read without stopping the engine loop; queued prompts count whole)."""
        with self._wakeup:
            queued = [len(h.request.prompt) for h in self._waiting]
        runs = [s.running for s in self._slots if s.running is not None]
        prefilling = (len(r.feed) - len(r.slot.tokens) for r in runs if r.phase is Phase.PREFILL)
        free = len(self._slots) - len(runs)
        return EngineLoad(len(queued), len(runs), free, sum(queued) + sum(prefilling))

    def _check_open(self) -> None:
        if self._closed:
            raise EngineClosed("the engine is shut down")

    def check_health(self) -> None:
        """Raise `EngineStalled` if the engine loop has died, or has work but has not
        completed a step for `stall_timeout_s` (a stuck llama.cpp call, say)."""
        if not self._closed and not self._thread.is_alive():
            raise EngineStalled("the engine loop thread has ended")
        load = self.load()
        self._heartbeat.check(load.queued + load.running)

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until nothing is queued or running (replays included); False on timeout."""
        return self._idle.wait(timeout)

    def stop(self) -> None:
        """End the engine loop (queued and running requests fail); store idle slots' states."""
        with self._wakeup:
            stopping, self._closed = not self._closed, True
            self._wakeup.notify()
        self._thread.join()
        if stopping:
            self._cache.keep_slots(self._slots)

    def close(self) -> None:
        """Stop, write what RAM holds to the disk tier (if any) and free llama.cpp's memory."""
        self.stop()
        self._cache.states.close()
        if self._projector is not None:
            self._projector.close()
        self._context.close()
        self.model.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- the engine loop (owns the llama context) ----------------------------------------

    def _run(self) -> None:
        while True:
            if self._unsaved() and not self._busy():  # the lock only when there is any
                self._cache.write_back(self._slots, self._busy)
                continue  # stored finished conversations while nothing else ran
            with self._wakeup:
                while not self._closed and not self._waiting and not self._running():
                    self._idle.set()
                    self._heartbeat.beat()
                    self._wakeup.wait(IDLE_BEAT_S)
                if self._closed:
                    break
            try:
                self._step()
            except Exception:  # not one request's work (that is guarded): the loop must go on
                logger.exception("engine step failed")
                error = EngineError("internal engine error; see the replica log")
                self._guard.fail_all(self._running(), error)
            self._heartbeat.beat()
        self._guard.fail_all(self._running(), EngineClosed("the engine is shut down"))
        with self._wakeup:
            waiting, self._waiting = self._waiting, []
        for handle in waiting:
            handle.finish(None, EngineClosed("the engine is shut down"))

    def _running(self) -> list[Running]:
        return [s.running for s in self._slots if s.running is not None]

    def _unsaved(self) -> bool:
        return any(slot.unsaved and slot.running is None for slot in self._slots)

    def _busy(self) -> bool:
        with self._wakeup:
            return self._closed or bool(self._waiting) or bool(self._running())

    def _step(self) -> None:
        """Execute `plan_step`'s plan: its admissions, then one step."""
        self._drop_cancelled()
        if self._peer_asks:  # rare: no work on the decode loop without one
            self._cache.checkpoint_for_peers(self._peer_asks, self._running())
        plan = self._plan()
        while (handle := plan.admit) is not None:
            free = [s for s in self._slots if s.running is None]
            with self._wakeup:
                self._waiting.remove(handle)  # only this thread removes from the queue
            self._cache.stop_waiting(handle)
            self._guard.start(handle, free, self._start, handle, free)
            plan = self._plan()
        self._hold_waits(plan.waiting)
        self._executor.run(plan)

    def _plan(self) -> StepPlan[RequestHandle, Running]:
        self._shares.clear()  # this plan's answers only
        with self._wakeup:
            queue = tuple(Queued(h, h.request.n) for h in self._waiting)
        view = StepView(
            queue=queue,
            free_slots=sum(s.running is None for s in self._slots),
            runs=tuple(r.view() for r in self._running()),
            step_tokens=self.config.step_budget,
            max_piece=self.config.prefill_chunk,
            one_call=self.config.one_call_steps,
            prefill_speed=self.stats.prefill_speed,
            now=time.perf_counter(),
        )
        return plan_step(view, self._must_wait)

    def _drop_cancelled(self) -> None:
        for run in self._running():
            if run.handle.cancelled and run.phase is not Phase.REPLAY:
                self._complete(run, "cancelled")
                if run.phase is Phase.DECODE:
                    self._guard.run("freeing its slot", run, self._cache.rewind_to_prompt, run)
                run.slot.release()
        with self._wakeup:
            cancelled = [h for h in self._waiting if h.cancelled]
            self._waiting = [h for h in self._waiting if not h.cancelled]
        for handle in cancelled:
            self._cache.stop_waiting(handle)
            handle.finish(handle.empty_completion("cancelled"))

    # ---- admission -----------------------------------------------------------------------

    def _must_wait(self, handle: RequestHandle) -> bool:
        """The plan's question (`PrefixCache.should_wait`); a share it answers with is kept
        for `_hold_waits`, which reserves it if this plan leaves the request waiting."""
        prompt = handle.request.prompt.tokens
        try:
            answer = self._cache.should_wait(handle, prompt, self._running(), self._slots)
        except Exception as exc:
            self._guard.refuse(handle, "being admitted", exc)  # leaves the queue next step
            return True
        if isinstance(answer, tuple):
            self._shares[handle] = answer
        return bool(answer)

    def _hold_waits(self, waiting: Sequence[RequestHandle]) -> None:
        """Reserve what the requests the plan left waiting wait for (`PrefixCache.hold_wait`)."""
        for handle in waiting:
            if (share := self._shares.get(handle)) is None:
                continue
            try:
                self._cache.hold_wait(handle, share)
            except Exception as exc:
                self._guard.refuse(handle, "being admitted", exc)  # leaves the queue next step

    def _start(self, handle: RequestHandle, free: list[Slot]) -> None:
        prompt, admitted_at = handle.request.prompt, time.perf_counter()
        stats = self.stats
        saved, restored, rewound = stats.saved_bytes, stats.restored_bytes, stats.rewound_bytes
        slot, cached = self._cache.place(prompt.tokens, free, handle.prefix_hashes)
        full, partial = self._cache.checkpoints_for(prompt, cached)
        spans = handle.media.spans if handle.media is not None else ()
        chunk = self.config.prefill_chunk
        pieces = prefill_pieces(cached, len(prompt), full + partial, chunk, spans)
        run = start_request(
            handle,
            self.model,
            slot,
            free,
            cached,
            pieces,
            set(full) & set(pieces),
            set(partial) & set(pieces),
            admitted_at,
            self.n_ctx,
            max_grammar_nesting=self.config.max_grammar_nesting,
            spans=spans,
        )
        # copied by `place`, before `run` was there to count them: an evicted KV, a restore
        run.saved_bytes = stats.saved_bytes - saved
        run.restored_bytes = stats.restored_bytes - restored
        run.rewound_bytes = stats.rewound_bytes - rewound

    # ---- a sampled token (the step executor's callback) -----------------------------------

    def _sampled(self, run: Running, logits: np.ndarray) -> None:
        """Take the next token from `logits` (streamed); finish when a stop rule fires."""
        ended = run.sampled(logits, self.model.is_end_of_generation, self.n_ctx)
        if ended is not None:
            reason, end_token = ended
            self._finish(run, reason, end_token=end_token)

    # ---- finishing -----------------------------------------------------------------------

    def _finish(self, run: Running, reason: str, *, end_token: int | None = None) -> None:
        """Answer the client now; then replay the reply so the cache holds exact states
        (with `exact_reuse` off, store the state the decode built instead)."""
        rest = run.text.flush()
        if rest:
            run.handle.emit(run.event(run.generated[-1], rest))
        self._complete(run, reason)
        if run.index:  # a later choice of an n > 1 request: only the first one is kept
            self._cache.rewind_to_prompt(run)
        if run.index or not self.config.prefix_cache:
            run.slot.release()
            return
        if not self.config.exact_reuse:  # the decode's state, stored where a replay's would be
            if len(run.slot.tokens) - len(run.prompt) >= MIN_PIECE:
                run.slot.finished()
            run.slot.release()  # it keeps the state, for the conversation's next turn
            return
        ending = (end_token,) if end_token is not None else ()
        history = (run.prompt + tuple(run.generated) + ending)[: self.n_ctx]
        self._cache.rewind_to_prompt(run)
        start = len(run.slot.tokens)
        if not start or len(history) - start < MIN_PIECE:
            run.slot.release()
            return
        run.phase = Phase.REPLAY
        run.feed = history
        run.pieces = prefill_pieces(start, len(history), [], self.config.prefill_chunk, run.spans)
        run.checkpoints, run.anchors = set(), set()

    def _complete(self, run: Running, reason: str) -> None:
        self.stats.requests += 1
        run.sampler.close()
        run.handle.finish_choice(run.completion(reason, time.perf_counter()))
