"""Packed string arrays: a GGUF vocabulary without a Python object per token.

A 262,144-entry vocabulary as a list of `str` costs ~20 MB of objects (a `str` header is 49+
bytes, most tokens are 2-8 characters), and a text -> id dict over it another ~20 MB. Here the
strings stay one UTF-8 buffer plus offsets (~4 MB for Gemma's vocabulary), decoded one at a
time when asked for, and `StringIndex` finds a string's id with a hash table of plain integer
arrays.

`StringArray` is an immutable `Sequence[str]`: indexing, slicing, iteration, `len` and `==`
against lists behave as for the list it replaces.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Iterator, Sequence
from typing import overload

import numpy as np

# A polynomial hash that Python computes for one string in C (`int.from_bytes(b, "little")
# % _P`) and NumPy computes for the whole vocabulary at once (sum of byte * 256**j mod _P).
_P = (1 << 31) - 1


class StringArray(Sequence[str]):
    """`n` UTF-8 strings packed in `data`: string i is data[starts[i] : starts[i] + lens[i]]."""

    __slots__ = ("_data", "_lens", "_starts")

    def __init__(self, data: bytes, starts: np.ndarray, lens: np.ndarray) -> None:
        self._data = data
        # array(): indexing returns a Python int as fast as a list does, in 4 bytes a number
        code, dt = ("i", np.int32) if len(data) < 1 << 31 else ("q", np.int64)
        self._starts = array(code, np.asarray(starts, dtype=dt).tobytes())  # [n]
        self._lens = array(code, np.asarray(lens, dtype=dt).tobytes())  # [n]

    @classmethod
    def from_strings(cls, strings: Iterable[str]) -> StringArray:
        encoded = [s.encode("utf-8", "surrogatepass") for s in strings]
        lens = np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded))
        starts = np.zeros(len(encoded), dtype=np.int64)
        if len(encoded) > 1:
            np.cumsum(lens[:-1], out=starts[1:])
        return cls(b"".join(encoded), starts, lens)

    @property
    def data(self) -> bytes:
        return self._data

    def starts(self) -> np.ndarray:  # [n] int64
        return np.frombuffer(self._starts, dtype=self._starts.typecode).astype(np.int64)

    def lens(self) -> np.ndarray:  # [n] int64
        return np.frombuffer(self._lens, dtype=self._lens.typecode).astype(np.int64)

    def nbytes(self) -> int:
        return len(self._data) + self._starts.itemsize * (len(self._starts) + len(self._lens))

    def __len__(self) -> int:
        return len(self._starts)

    def raw(self, i: int) -> bytes:
        s = self._starts[i]
        return self._data[s : s + self._lens[i]]

    @overload
    def __getitem__(self, i: int) -> str: ...
    @overload
    def __getitem__(self, i: slice) -> list[str]: ...

    def __getitem__(self, i: int | slice) -> str | list[str]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        s = self._starts[i]
        return self._data[s : s + self._lens[i]].decode("utf-8", "surrogatepass")

    def __iter__(self) -> Iterator[str]:
        data = self._data
        for s, n in zip(self._starts, self._lens, strict=True):
            yield data[s : s + n].decode("utf-8", "surrogatepass")

    def tolist(self) -> list[str]:
        """Every string, decoded at once where the buffer is read_gguf's (each string after
        a NUL, formats/gguf.py _pack_strings): one decode and one split in C, 6x faster than
        a decode per string (15 against 85 ms for a 151k vocabulary). Any other buffer, or
        one with a NUL inside a string, is decoded a string at a time."""
        n = len(self)
        if n and len(self._data) == n + sum(self._lens) and self._data[:1] == b"\0":
            parts = self._data.decode("utf-8", "surrogatepass").split("\0")
            if len(parts) == n + 1:  # no string holds a NUL: the split is the strings
                starts, lens = self.starts(), self.lens()
                lead = np.cumsum(lens) - lens  # [n] text bytes before string i
                if np.array_equal(starts, lead + np.arange(1, n + 1)):
                    return parts[1:]
        return list(self)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, StringArray):
            return len(self) == len(other) and all(
                self.raw(i) == other.raw(i) for i in range(len(self)))
        if isinstance(other, (list, tuple)):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other,
                                                                             strict=True))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # mutable-free but compared like a list

    def __repr__(self) -> str:
        head = ", ".join(repr(self[i]) for i in range(min(3, len(self))))
        return f"StringArray([{head}{', ...' if len(self) > 3 else ''}], n={len(self)})"


_VECTOR_MAX_LEN = 64  # longer strings (rare) are hashed one at a time in Python


def _hashes(data: bytes, starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """[n] int64: int.from_bytes(string_i, "little") % _P for every string.

    Vectorized over strings, one byte position at a time: with the strings sorted by length
    (longest first) the ones still having a byte j are a prefix, so each step touches only
    those and the temporaries stay a few [n] arrays (a whole-buffer formulation needs ~40
    bytes per vocabulary byte, ~100 MB for Gemma's, only to be freed again)."""
    n = len(starts)
    out = np.zeros(n, dtype=np.int64)  # [n]
    if n == 0:
        return out
    short = np.flatnonzero(lens <= _VECTOR_MAX_LEN)  # [m]
    order = short[np.argsort(-lens[short], kind="stable")]  # [m] longest first
    s_sorted = starts[order]  # [m]
    l_sorted = lens[order]  # [m]
    u8 = np.frombuffer(data, dtype=np.uint8)
    h = np.zeros(len(order), dtype=np.int64)  # [m]
    # active[j]: how many sorted strings have more than j bytes
    active = np.searchsorted(-l_sorted, -np.arange(_VECTOR_MAX_LEN), side="left")
    for j in range(int(l_sorted[0]) if len(l_sorted) else 0):
        k = int(active[j])
        h[:k] += u8[s_sorted[:k] + j].astype(np.int64) * pow(256, j, _P) % _P
        h[:k] %= _P
    out[order] = h
    for i in np.flatnonzero(lens > _VECTOR_MAX_LEN).tolist():
        s = int(starts[i])
        out[i] = int.from_bytes(data[s : s + int(lens[i])], "little") % _P
    return out


class StringIndex:
    """string -> id over a StringArray, as `dict(zip(strings, range(n)))` would give (later
    duplicates win), in ~2.5 bytes per slot of int32 arrays instead of Python objects.

    Open hashing with the bucket lists laid out flat: bucket b's ids are
    ids[first[b] : first[b + 1]], in ascending order.
    """

    __slots__ = ("_data", "_first", "_ids", "_lens", "_mask", "_memo", "_starts", "_strings")

    MEMO_SIZE = 1 << 15  # recent lookups kept as a dict (~3 MB at most): text repeats its pieces

    def __init__(self, strings: StringArray) -> None:
        self._strings = strings
        self._data, self._starts, self._lens = strings.data, strings._starts, strings._lens
        n = len(strings)
        buckets = 1 << max(4, (2 * n - 1).bit_length())  # >= 2n: ~0.5 entries per bucket
        self._mask = buckets - 1
        slot = _hashes(strings.data, strings.starts(), strings.lens()) & self._mask  # [n]
        order = np.argsort(slot, kind="stable").astype(np.int32)  # ids grouped by bucket
        counts = np.bincount(slot, minlength=buckets)  # [buckets]
        first = np.zeros(buckets + 1, dtype=np.int32)
        np.cumsum(counts, out=first[1:])
        self._ids = array("i", order.tobytes())  # [n]
        self._first = array("i", first.tobytes())  # [buckets + 1]
        self._memo: dict[str, int | None] = {}

    def get(self, text: str) -> int | None:
        """The highest id whose string is exactly `text`, or None."""
        memo = self._memo
        try:
            return memo[text]
        except KeyError:
            pass
        try:
            tid = self.get_bytes(text.encode("utf-8"))
        except UnicodeEncodeError:  # lone surrogates: no vocabulary string has them
            tid = None
        if len(memo) >= self.MEMO_SIZE:
            memo.clear()
        memo[text] = tid
        return tid

    def get_bytes(self, b: bytes) -> int | None:
        slot = (int.from_bytes(b, "little") % _P) & self._mask
        lo = self._first[slot]
        i = self._first[slot + 1]
        data, starts, lens, ids = self._data, self._starts, self._lens, self._ids
        nb = len(b)
        while i > lo:  # from the back: the highest id first, as a dict's later duplicate wins
            i -= 1
            tid = ids[i]
            if lens[tid] == nb:
                s = starts[tid]
                if data[s : s + nb] == b:
                    return tid
        return None

    def __contains__(self, text: str) -> bool:
        return self.get(text) is not None

    def nbytes(self) -> int:
        return 4 * (len(self._ids) + len(self._first))


def pack(strings: Sequence[str]) -> StringArray:
    """A StringArray of `strings` (itself when it already is one)."""
    return strings if isinstance(strings, StringArray) else StringArray.from_strings(strings)
