"""How a reply's figures read in the chat: the line under a reply (the app) or after it (the
line chat with /set verbose), the speeds in the app's status bar, and the record kept with
a reply in a saved conversation.

The numbers and their rules (what counts as cached, when a rate means something) are
`localllm.generation.sequence.GenerationStats`'s, the same that `localllm run --verbose`
prints; this module only words them, so the app and the line chat say the same thing.
"""

from __future__ import annotations

from typing import Any


def format_reply_stats(stats: Any, reason: str | None, show_rates: bool = True) -> str:
    """'42 tokens, 70.1 tok/s · prompt 25 evaluated + 312 cached, 310 tok/s · drafted 20,
    accepted 12'. A reply stopped while its prompt was read says how much of it was read:
    'prompt 128 of 838 evaluated + 12 cached' (the other 710 were never read, nor cached).
    A rate is left out where the stats have none (too few tokens to time)."""
    if stats is None:
        return ""
    tg = stats.eval_tps if show_rates else None
    parts = [f"{stats.eval_tokens} tokens" + (f", {tg:.1f} tok/s" if tg is not None else "")]
    evaluated = f"{stats.prompt_eval_tokens}"
    if stats.prompt_unread:
        evaluated += f" of {stats.prompt_eval_tokens + stats.prompt_unread}"
    pp = stats.prompt_tps if show_rates else None
    parts.append(f"prompt {evaluated} evaluated + {stats.prompt_cached} cached"
                 + (f", {pp:.0f} tok/s" if pp is not None else ""))
    if stats.draft_tokens:
        parts.append(f"drafted {stats.draft_tokens}, accepted {stats.draft_accepted}")
    if reason == "cancelled":
        parts.append("stopped")
    elif reason == "length":
        parts.append("cut at the length limit")
    elif reason == "repeat":  # the loop guard (generation/repeat_guard.py)
        parts.append("cut: it was repeating itself")
    return " · ".join(parts)


def status_speeds(stats: Any) -> str | None:
    """The last reply's speeds for the status bar: 'pp 310 tg 70.1 tok/s' (either may be
    missing: a prompt all cached but a token, a reply of one token); None when it has
    neither."""
    if stats is None:
        return None
    pp, tg = stats.prompt_tps, stats.eval_tps
    parts = ([f"pp {pp:.0f}"] if pp is not None else []) + \
        ([f"tg {tg:.1f}"] if tg is not None else [])
    return " ".join(parts) + " tok/s" if parts else None


def stats_record(stats: Any, reason: str | None) -> dict:
    """The stats kept with a reply in a saved conversation (a rate is null when there is
    none to give)."""
    if stats is None:
        return {"done_reason": reason}

    def rounded(x: float | None) -> float | None:
        return None if x is None else round(x, 2)

    return {
        "done_reason": reason,
        "tokens": stats.eval_tokens,
        "tokens_per_s": rounded(stats.eval_tps),
        "prompt_tokens": stats.prompt_tokens,
        "prompt_evaluated": stats.prompt_eval_tokens,
        "prompt_cached": stats.prompt_cached,
        "prompt_tokens_per_s": rounded(stats.prompt_tps),
        "drafted": stats.draft_tokens,
        "accepted": stats.draft_accepted,
    }
