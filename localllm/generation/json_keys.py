"""No duplicate keys in generated JSON objects.

A grammar cannot remember which keys an object already has when its keys are free (`"json"`,
`additionalProperties`), so llguidance would allow `{"a": 1, "a": 2}`. `KeyTracker` follows
the generated text byte by byte (strings, escapes, nesting) and keeps, for each open object,
the keys written so far; `allows(piece)` says whether a token's text would close a key the
object already has. Objects with declared properties only are closed by the grammar
already; the check costs nothing there but a scan of the token's bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class _Frame:
    is_object: bool
    keys: frozenset[bytes] = frozenset()  # copied on write: a simulation shares them
    expect_key: bool = False  # in an object, the next string is a key


@dataclass
class KeyTracker:
    stack: list[_Frame] = field(default_factory=list)
    in_string: bool = False
    escape: bool = False
    key: bytearray | None = None  # the key being written (None: in a value string)

    def copy(self) -> KeyTracker:
        return KeyTracker([_Frame(f.is_object, f.keys, f.expect_key) for f in self.stack],
                          self.in_string, self.escape,
                          None if self.key is None else bytearray(self.key))

    def feed(self, piece: bytes) -> bool:
        """Advance over piece; False when it closes a key its object already has (the
        tracker is then unusable)."""
        for b in piece:
            if self.in_string:
                if self.escape:
                    self.escape = False
                elif b == 0x5C:  # backslash
                    self.escape = True
                elif b == 0x22:  # the closing quote
                    self.in_string = False
                    if self.key is not None:
                        top = self.stack[-1]
                        k = bytes(self.key)
                        if k in top.keys:
                            return False
                        top.keys = top.keys | {k}
                        self.key = None
                    continue
                if self.key is not None:
                    self.key.append(b)
                continue
            if b == 0x22:
                self.in_string = True
                top = self.stack[-1] if self.stack else None
                if top is not None and top.is_object and top.expect_key:
                    self.key, top.expect_key = bytearray(), False
            elif b == 0x7B:  # {
                self.stack.append(_Frame(True, frozenset(), True))
            elif b == 0x5B:  # [
                self.stack.append(_Frame(False))
            elif b in (0x7D, 0x5D):  # } ]
                if self.stack:
                    self.stack.pop()
            elif b == 0x2C and self.stack and self.stack[-1].is_object:  # ,
                self.stack[-1].expect_key = True
        return True

    def allows(self, piece: bytes) -> bool:
        """Whether piece may come next (does not advance)."""
        if b'"' not in piece:
            return True  # only a closing quote completes a key
        return self.copy().feed(piece)
