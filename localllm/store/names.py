"""Model names: parsing and validating what a user types, before it touches a filesystem.

Names look like Ollama's: `smollm2`, `smollm2:135m-q4_1`, `library/smollm2:latest`,
`user/model:tag`, plus llama.cpp-style Hugging Face references `hf.co/OWNER/REPO[:QUANT]` and
`hf.co/OWNER/REPO/FILE.gguf`. Every component is checked against one strict pattern, so a
name can never carry `..`, an absolute path, a backslash or a NUL into a path we build from it
(the store, Ollama's manifests, the HF cache all turn names into paths).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from localllm.errors import LocalLLMError

# One path component of a name: starts alphanumeric, then letters, digits, `.`, `_`, `-`.
# `..` cannot match (it starts with a dot); nor can an empty string, `/` or `\`.
_PART = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
HF_HOSTS = ("hf.co", "huggingface.co")
DEFAULT_NAMESPACE = "library"


class BadModelName(LocalLLMError, ValueError):
    pass


@dataclass(frozen=True)
class ModelName:
    """A parsed name. `parts` is the path of the model (`("library", "smollm2")`,
    `("hf.co", "owner", "repo")`); `tag` is None when the user gave none."""

    parts: tuple[str, ...]
    tag: str | None
    hf_file: str | None = None  # hf.co/OWNER/REPO/FILE.gguf: the exact file

    @property
    def is_hf(self) -> bool:
        return self.parts[0] == "hf.co"

    @property
    def repo_id(self) -> str:
        """OWNER/REPO of an hf.co name."""
        return "/".join(self.parts[1:3])

    @property
    def model(self) -> str:
        """The name as shown (Ollama drops the `library/` namespace)."""
        if self.parts[0] == DEFAULT_NAMESPACE and len(self.parts) == 2:
            return self.parts[1]
        return "/".join(self.parts)

    def with_tag(self, tag: str) -> ModelName:
        return ModelName(self.parts, check_part(tag, "tag"), self.hf_file)

    def __str__(self) -> str:
        base = self.model + (f"/{self.hf_file}" if self.hf_file else "")
        return base + (f":{self.tag}" if self.tag else "")


def check_part(s: str, what: str = "name") -> str:
    if not _PART.fullmatch(s) or ".." in s:
        raise BadModelName(
            f"invalid model {what} {s!r}: use letters, digits, '.', '_' and '-' "
            "(starting with a letter or digit)"
        )
    return s


def parse_name(text: str) -> ModelName:
    """`text` -> ModelName, or BadModelName with a one-line reason."""
    if not text or len(text) > 512 or text != text.strip():
        raise BadModelName(f"invalid model name {text!r}")
    base, tag = text, None
    if ":" in text:
        base, tag = text.rsplit(":", 1)
        check_part(tag, "tag")
    raw = base.split("/")
    if raw[0].lower() in HF_HOSTS:
        if len(raw) not in (3, 4):
            raise BadModelName(
                f"invalid model name {text!r}: expected hf.co/OWNER/REPO[:QUANT] or "
                "hf.co/OWNER/REPO/FILE.gguf"
            )
        owner, repo = check_part(raw[1]), check_part(raw[2])
        hf_file = None
        if len(raw) == 4:
            hf_file = check_part(raw[3], "file name")
            if not hf_file.lower().endswith(".gguf"):
                raise BadModelName(f"invalid model name {text!r}: the file must be a .gguf")
            if tag:
                raise BadModelName(f"invalid model name {text!r}: a file and a :QUANT tag")
        return ModelName(("hf.co", owner, repo), tag, hf_file)
    if len(raw) == 1:
        raw = [DEFAULT_NAMESPACE, *raw]
    if len(raw) != 2:
        raise BadModelName(
            f"invalid model name {text!r}: expected NAME[:TAG] or NAMESPACE/NAME[:TAG]"
        )
    return ModelName(tuple(check_part(p).lower() for p in raw), tag)


def looks_like_name(text: str) -> bool:
    try:
        parse_name(text)
    except BadModelName:
        return False
    return True
