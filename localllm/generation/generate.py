"""`generate()`: one request through the token loop, inline, as text events.

The CLI, the chat and the benches call this; it builds a `Request` and runs the same
`Batcher` the server's engine thread runs (localllm/generation/batcher.py), on the calling
thread, for this one sequence. So sampling, constraints, speculation, stop strings, context
shift and stats are written once (localllm/generation/sequence.py) and a request gives the
same events, and with batch-invariant logits the same tokens, through every front door.

Boundaries: the engine returns logits, the sampler turns logits into a token, the
detokenizer turns tokens into text. mlx-lm and nano-vllm are layered the same way
(add a request, step the one loop, read its output).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from localllm.generation.batcher import Batcher
from localllm.generation.request import Request
from localllm.generation.sampling import Sampler
from localllm.generation.sequence import GenerationStats, TokenStep
from localllm.generation.speculative import Drafter, SpecOptions, StepCosts, make_drafter
from localllm.generation.text_stream import Event, held_back

if TYPE_CHECKING:
    from localllm.engine import Engine
    from localllm.generation.constraint import TokenConstraint

__all__ = ["Event", "GenerationStats", "TokenStep", "generate", "held_back"]

_held_back = held_back  # the name the tests use


def generate(
    engine: Engine,
    prompt_tokens: Sequence[int],
    sampler: Sampler,
    max_tokens: int = -1,
    stop: Sequence[str] = (),
    slot: int = 0,
    truncate: bool = False,
    ignore_eos: bool = False,
    context_shift: bool = False,
    repeat_guard: int = 0,
    n_keep: int = 0,
    spec: SpecOptions | None = None,
    drafter: Drafter | None = None,
    step_costs: StepCosts | None = None,
    constraint: TokenConstraint | None = None,
    progress: bool = False,
    show_tokens: frozenset[int] = frozenset(),
) -> Iterator[Event]:
    """Yield text events, then one final event with done=True, done_reason and stats.

    max_tokens < 0: until EOS or the context is full. A prompt longer than the context is
    PromptTooLongError unless truncate=True (then only its end is kept). When the context
    fills up: done_reason "length", or with context_shift=True keep BOS + the first n_keep
    tokens, drop the older half of the rest and go on (positions renumbered).
    sampler: its settings and random state carry on (a chat passes the same one each turn).
    spec: speculative decoding options (default: SpecOptions(), n-gram drafting with an
    adaptive length); or pass a ready `drafter` (e.g. a draft model kept across calls).
    step_costs: the engine's learned step timings, shared across calls.
    constraint: structured output (localllm.generation.constraint.make_constraint);
    generation ends with done_reason "stop" as soon as the value is complete.
    progress: events with `progress` = (evaluated, total) while the prompt is evaluated.
    show_tokens: control tokens rendered in the text (Request.show_tokens).
    repeat_guard: end with done_reason "repeat" once this many tokens repeat one span
    (generation/repeat_guard.py); 0 = off.
    Leaving the loop early cancels the request; the slot keeps what it cached.
    """
    spec = spec or SpecOptions()
    if drafter is None:
        drafter = make_drafter(spec, engine)
    loop = Batcher(engine, spec=spec, costs=step_costs, drafter=drafter)
    req = Request(list(prompt_tokens), sampler.config, max_tokens=max_tokens, stop=stop,
                  ignore_eos=ignore_eos, truncate=truncate, constraint=constraint,
                  context_shift=context_shift, n_keep=n_keep, slot=slot, progress=progress,
                  show_tokens=show_tokens, repeat_guard=repeat_guard)
    return loop.stream(req, sampler=sampler)
