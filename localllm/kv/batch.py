"""The one batch abstraction: rows of (sequence slot, position, token) plus which rows need
logits. Prefill, decode, speculative verification and many users at once are the same call."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class Batch:
    tokens: np.ndarray  # [N] int64
    positions: np.ndarray  # [N] int64
    seq_ids: np.ndarray  # [N] int64 (KV cache slots)
    want_logits: np.ndarray  # [N] bool

    @classmethod
    def for_sequence(
        cls, tokens: list[int], start_pos: int, seq_id: int = 0, logits: str = "last"
    ) -> Batch:
        """Consecutive tokens of one sequence; logits for the last row ("last"), every row
        ("all") or none ("none")."""
        n = len(tokens)
        want = np.zeros(n, dtype=bool)
        if logits == "all":
            want[:] = True
        elif logits == "last" and n:
            want[-1] = True
        return cls(
            tokens=np.asarray(tokens, dtype=np.int64),
            positions=np.arange(start_pos, start_pos + n, dtype=np.int64),
            seq_ids=np.full(n, seq_id, dtype=np.int64),
            want_logits=want,
        )

    @classmethod
    def concat(cls, parts: list[Batch]) -> Batch:
        return cls(
            tokens=np.concatenate([p.tokens for p in parts]),
            positions=np.concatenate([p.positions for p in parts]),
            seq_ids=np.concatenate([p.seq_ids for p in parts]),
            want_logits=np.concatenate([p.want_logits for p in parts]),
        )

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    def segments(self) -> list[tuple[int, int, int]]:
        """(seq_id, start_row, end_row) runs. Rows of one sequence must be contiguous and
        in increasing position order: attention of a row sees the rows before it."""
        out: list[tuple[int, int, int]] = []
        n = len(self)
        start = 0
        seen: set[int] = set()
        for i in range(1, n + 1):
            if i == n or self.seq_ids[i] != self.seq_ids[start]:
                sid = int(self.seq_ids[start])
                if sid in seen:
                    raise ValueError(f"rows of sequence {sid} are not contiguous in the batch")
                seen.add(sid)
                pos = self.positions[start:i]
                if np.any(np.diff(pos) <= 0):
                    raise ValueError(f"positions of sequence {sid} are not increasing")
                out.append((sid, start, i))
                start = i
        return out
