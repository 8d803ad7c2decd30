"""The chat app's one door to the engine: a dedicated engine thread and a queue of jobs.

Numba's workqueue threading layer must not be entered from two Python threads at once, so
one thread owns the Engine for its whole life: it loads the model, compiles the kernels,
renders and tokenizes prompts, and runs the token loop (`localllm.generation.batcher`, the
same loop as the CLI's and the server's). The UI thread only puts jobs on a queue and reads
events from a per-job `Handle`; it never waits on a kernel. The app only sees `LoadStage`,
`Loaded`, `Progress`, `ContextFull`, `Failed`, `Trimmed` and
`localllm.generation.text_stream.Event` objects.

A load reports its stages as the engine and the kernel step go through them (`LoadStage`:
mapping the file, loading the weights (tensor by tensor: a large model's r16 repacking takes
seconds), allocating the KV cache, reading the tokenizer, then
loading or, on a machine's first run, compiling the kernels with a count), so the app shows
what the wait is for.

Turn 2 does not re-evaluate turn 1: every chat job renders the whole conversation with the
model's template and sends it to the same slot, and the KV cache keeps the longest common
prefix already in that slot. The final event's stats say how many prompt tokens were
evaluated and how many came from the cache.

Cancellation is checked between engine steps (a long prompt takes PREFILL_CHUNK rows a
step), so Esc stops both a long prefill (a pasted document) and a reply within one step.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from localllm.generation.repeat_guard import DEFAULT_MIN_TOKENS
from localllm.generation.sampling import SamplerConfig
from localllm.generation.speculative import SpecOptions
from localllm.generation.text_stream import Event
from localllm.store.local import name_of

SLOT = 0  # the chat uses one sequence slot: same slot every turn = prefix reuse
PREFILL_CHUNK = 256  # tokens per progress/cancel checkpoint while a long prompt is evaluated


@dataclass
class ModelInfo:
    path: Path
    name: str
    n_ctx: int
    kv_bytes: int  # the whole KV cache as allocated
    k_type: str
    v_type: str
    template: str  # "gguf" (the file's own chat template) or a built-in one's name
    load_s: float
    thinking: bool = False  # the chat template can think (<think>, enable_thinking)
    # the sampling the file recommends (general.sampling.*), by setting name
    sampling: dict[str, Any] = field(default_factory=dict)
    base: bool = False  # a completion (base) model: no chat template, no chat-like name


@dataclass
class LoadStage:
    """What a load is doing now: `done` of `total` where it counts (kernels), else 0/0."""

    what: str
    done: int = 0
    total: int = 0


@dataclass
class Loaded:
    info: ModelInfo


@dataclass
class Progress:
    """Prompt processing: `done` of `total` prompt tokens evaluated (cached ones excluded)."""

    done: int
    total: int


@dataclass
class ContextFull:
    """The conversation does not fit: nothing was evaluated.

    drop_turns: the fewest oldest whole turns (a user message and its reply) whose removal
    makes it fit, the system prompt kept; None when even the last message alone is too long.
    """

    prompt_tokens: int
    n_ctx: int
    reserve: int
    drop_turns: int | None


@dataclass
class Failed:
    message: str


@dataclass
class Trimmed:
    """The conversation's slot now holds `kept` tokens (a trim job's one event)."""

    kept: int


BackendEvent = LoadStage | Loaded | Progress | ContextFull | Failed | Trimmed | Event


def is_final(ev: BackendEvent) -> bool:
    """The job's last event? (Progress.done is a count, not a flag: test the type.)"""
    if isinstance(ev, (Progress, LoadStage)):
        return False
    return not isinstance(ev, Event) or ev.done


def _split_event(split: Any, ev: Event) -> Event | None:
    """`ev` with its text split into reasoning and reply (None: nothing to show yet)."""
    from dataclasses import replace

    thinking, text = split.push(ev.text)
    if ev.done:
        t, c = split.finish()
        thinking, text = thinking + t, text + c
    elif not thinking and not text:
        return None
    return replace(ev, text=text, thinking=thinking)


class Handle:
    """One job's stream of events (iterate on any thread but the engine's) and its cancel
    switch. The last event is a Loaded, ContextFull, Failed or an Event with done=True
    (done_reason "cancelled" after cancel())."""

    def __init__(self) -> None:
        self._q: queue.SimpleQueue[BackendEvent] = queue.SimpleQueue()
        self._cancel = threading.Event()

    def cancel(self) -> None:
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def put(self, ev: BackendEvent) -> None:
        self._q.put(ev)

    def get(self, timeout: float | None = None) -> BackendEvent:
        """The next event; queue.Empty after `timeout` seconds."""
        return self._q.get(timeout=timeout)

    def get_nowait(self) -> BackendEvent | None:
        try:
            return self._q.get_nowait()
        except queue.Empty:
            return None

    def __iter__(self) -> Iterator[BackendEvent]:
        while True:
            ev = self._q.get()
            yield ev
            if is_final(ev):
                return


@dataclass
class _Job:
    kind: str  # "load" | "chat" | "trim"
    handle: Handle
    args: dict[str, Any]


def reply_reserve(n_ctx: int, max_tokens: int) -> int:
    """Tokens kept free for the reply when deciding whether a conversation fits."""
    want = max_tokens if max_tokens > 0 else 256
    return max(1, min(want, n_ctx // 4))


def split_turns(messages: Sequence[dict]) -> tuple[list[dict], list[list[dict]]]:
    """(leading system messages, turns): a turn starts at a user message and holds what
    follows it up to the next user message (its reply)."""
    head: list[dict] = []
    turns: list[list[dict]] = []
    for m in messages:
        if m.get("role") == "system" and not turns:
            head.append(m)
        elif m.get("role") == "user" or not turns:
            turns.append([m])
        else:
            turns[-1].append(m)
    return head, turns


def drop_oldest_turns(messages: Sequence[dict], n: int) -> list[dict]:
    """The conversation without its n oldest whole turns; system messages at the top stay."""
    head, turns = split_turns(messages)
    return head + [m for t in turns[n:] for m in t]


class ChatBackend:
    """Owns the engine thread. start() loads the model; submit() streams one reply.

    Engine options (n_ctx, n_threads, kv_type, v_type, n_batch) are Engine's. spec: the
    speculative decoding options (default: n-gram drafting, lossless); one drafter and one
    set of step timings serve every reply of a model.
    """

    def __init__(self, model_path: str | Path, spec: SpecOptions | None = None,
                 think: bool | str | None = None, repeat_guard: int = DEFAULT_MIN_TOKENS,
                 **engine_opts: Any) -> None:
        # think: the template's enable_thinking (None: its default), or a level (gpt-oss's
        # reasoning effort); a thinking model's reasoning always comes apart from the
        # reply, in Event.thinking
        self.think = think
        self.repeat_guard = repeat_guard  # Request.repeat_guard of every reply; 0 = off
        self._engine_opts = engine_opts
        self._spec = spec or SpecOptions()
        self._loop: Any = None  # the token loop (a Batcher): engine thread only
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._first_path = Path(model_path)
        self.engine: Any = None  # read-only from other threads (sizes, counters)
        self.info: ModelInfo | None = None

    # --- UI side -------------------------------------------------------------------------

    def start(self, stages: bool = False) -> Handle:
        """Start the engine thread and load the model. The handle yields Loaded or Failed
        (after LoadStage events with `stages`)."""
        if self._thread is not None:
            raise RuntimeError("backend already started")
        self._thread = threading.Thread(target=self._run, name="localllm-engine", daemon=True)
        self._thread.start()
        return self.load(self._first_path, stages)

    def load(self, model_path: str | Path, stages: bool = False) -> Handle:
        """Replace the model (the conversation's KV cache goes with it). stages: LoadStage
        events before the final Loaded or Failed (a reader of the first event only, the
        line chat, leaves them off)."""
        return self._submit("load", path=Path(model_path), stages=stages)

    def submit(self, messages: Sequence[dict], config: SamplerConfig, max_tokens: int = -1,
             stop: Sequence[str] = ()) -> Handle:
        """Stream the assistant's reply to `messages` (the whole conversation so far, ending
        with the user's message): Progress while a long prompt is evaluated, then text
        Events and a final Event; or ContextFull / Failed."""
        msgs = [{"role": m["role"], "content": m["content"]} for m in messages]
        return self._submit("chat", messages=msgs, config=config, max_tokens=max_tokens,
                            stop=list(stop))

    def trim(self, messages: Sequence[dict]) -> Handle:
        """Keep in the slot only what `messages` (the conversation now: shorter after a new
        chat, an edit, a regenerate) still share with it; yields Trimmed. The next reply
        would re-use no more than that anyway: this makes the context figure true at once."""
        msgs = [{"role": m["role"], "content": m["content"]} for m in messages]
        return self._submit("trim", messages=msgs)

    def context_used(self) -> int:
        """Tokens the conversation's slot holds now."""
        eng = self.engine
        return eng.kv.n_past(SLOT) if eng is not None else 0

    def close(self, timeout: float = 5.0) -> None:
        """Stop the engine thread after its current job (cancel that job first)."""
        if self._thread is None:
            return
        self._jobs.put(None)
        self._thread.join(timeout)
        self._thread = None

    def _submit(self, kind: str, **args: Any) -> Handle:
        if self._thread is None:
            raise RuntimeError("backend not started")
        h = Handle()
        self._jobs.put(_Job(kind, h, args))
        return h

    # --- engine thread -------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                if job.kind == "load":
                    self._load(job)
                elif job.kind == "trim":
                    self._trim(job)
                else:
                    self._chat(job)
            except Exception as e:  # noqa: BLE001 - any failure ends the job, not the thread
                job.handle.put(Failed(str(e) or type(e).__name__))

    def _load(self, job: _Job) -> None:
        from localllm.engine import Engine
        from localllm.generation.batcher import Batcher
        from localllm.generation.sampler_settings import recommended
        from localllm.generation.speculative import StepCosts, make_drafter
        from localllm.kernels.build.warmup import ensure_kernels_compiled
        from localllm.tui.model_choice import is_base_model

        def stage(what: str, done: int = 0, total: int = 0) -> None:
            if job.args["stages"]:
                job.handle.put(LoadStage(what, done, total))

        t0 = time.perf_counter()
        self.engine = self._loop = None  # drop the old model (and its cache) first
        eng = Engine(job.args["path"], stage=stage, **self._engine_opts)
        ensure_kernels_compiled(eng, progress=False, report=stage)
        if self._spec.draft_model:
            stage("loading the draft model")
        drafter = make_drafter(self._spec, eng)  # None when speculation is off
        # the token loop, run on this thread; a long prompt is evaluated PREFILL_CHUNK rows
        # a step, so progress shows and Esc cancels between chunks
        self._loop = Batcher(eng, prefill_chunk=PREFILL_CHUNK, spec=self._spec, costs=StepCosts(),
                             drafter=drafter)
        template = eng.template.name
        # the name `localllm list` shows (a store blob's file name is sha256-...), else the
        # file's: general.name is often a training-run label ("Smollm2 135M 8k Lc100K Mix1
        # Ep2") that says less than the file the user picked
        name = name_of(job.args["path"]) or Path(job.args["path"]).name.removesuffix(".gguf")
        self.engine = eng
        self.info = ModelInfo(
            path=Path(job.args["path"]), name=name, n_ctx=eng.n_ctx, kv_bytes=eng.kv.nbytes(),
            k_type=eng.kv.k_type, v_type=eng.kv.v_type, template=template,
            load_s=time.perf_counter() - t0, thinking=eng.template.caps.thinking,
            sampling=recommended(eng.metadata), base=is_base_model(eng.metadata, name),
        )
        job.handle.put(Loaded(self.info))

    def _trim(self, job: _Job) -> None:
        eng = self.engine
        if eng is None:
            job.handle.put(Trimmed(0))
            return
        msgs = job.args["messages"]
        keep = eng.kv.common_prefix(SLOT, self._encode(msgs)) if msgs else 0
        eng.kv.truncate(SLOT, keep)
        job.handle.put(Trimmed(eng.kv.n_past(SLOT)))

    def _encode(self, messages: Sequence[dict]) -> list[int]:
        return self._render(messages)[0]

    def _render(self, messages: Sequence[dict]) -> tuple[list[int], str]:
        from localllm.generation.reasoning import think_kwargs
        from localllm.text.chat_template import encode_chat

        eng = self.engine
        kwargs = think_kwargs(self.think, eng.template.caps.thinking)
        text = eng.template.render(messages, add_generation_prompt=True, **kwargs)
        return encode_chat(eng.tokenizer, text), text

    def _fit(self, messages: Sequence[dict], limit: int) -> int | None:
        """Fewest oldest turns to drop so the prompt is at most `limit` tokens (None: never)."""
        _, turns = split_turns(messages)
        for n in range(1, len(turns)):
            if len(self._encode(drop_oldest_turns(messages, n))) <= limit:
                return n
        return None

    def _chat(self, job: _Job) -> None:
        """A thin adapter: one Request through the token loop, run on this thread; its
        events become the app's (prefill progress included), Esc cancels between steps."""
        from localllm.generation.reasoning import reply_splitter
        from localllm.generation.request import Request
        from localllm.generation.sampling import Sampler
        from localllm.text.harmony import preserved_ids

        h, a, eng = job.handle, job.args, self.engine
        if eng is None:
            h.put(Failed("no model loaded"))
            return
        ids, text = self._render(a["messages"])
        n = len(ids)
        reserve = reply_reserve(eng.n_ctx, a["max_tokens"])
        if n + reserve > eng.n_ctx:
            h.put(ContextFull(n, eng.n_ctx, reserve, self._fit(a["messages"], eng.n_ctx - reserve)))
            return
        sampler = Sampler(a["config"], eng.tokenizer)  # validates the settings
        caps = eng.template.caps
        # gpt-oss: its channels' structure tokens in the text, for the splitter
        req = Request(ids, a["config"], max_tokens=a["max_tokens"], stop=a["stop"], slot=SLOT,
                      progress=True, show_tokens=preserved_ids(eng.tokenizer) if caps.harmony
                      else frozenset(), repeat_guard=self.repeat_guard)
        handle = self._loop.submit(req, sampler=sampler)
        split = reply_splitter(caps.harmony, text) if caps.thinking else None
        while True:
            for ev in handle.pending():
                if ev.progress is None:
                    if split is not None:
                        ev = _split_event(split, ev)
                    if ev is not None:
                        h.put(ev)
                elif ev.progress[1] > PREFILL_CHUNK:  # a prompt long enough to show
                    h.put(Progress(*ev.progress))
            if handle.finished.is_set():
                return
            if h.cancelled:
                handle.cancel()  # retired at the next step, with its stats so far
            self._loop.step()
