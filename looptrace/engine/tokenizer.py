"""Tokenizers: a checkpoint's `tokenizer.json` (Hugging Face `tokenizers`), else a byte-level fallback.

The byte tokenizer serves the tiny presets (random weights, no vocabulary of their own): ids 0..255 are
the UTF-8 bytes, then three specials. Its 259 ids fit the tiny presets' 512-row vocabulary; ids the model
may still emit above that (259..511) decode to U+FFFD, so nothing vanishes silently.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"


class TokenizerError(ValueError):
    """A checkpoint's tokenizer files cannot be read (one line naming the file)."""


@runtime_checkable
class Tokenizer(Protocol):
    bos_token_id: int | None
    eos_token_id: int | None

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255; specials BOS = 256, EOS = 257, PAD = 258 (vocab_size 259)."""

    BOS, EOS, PAD = 256, 257, 258
    SPECIALS = {BOS: "<|bos|>", EOS: "<|eos|>", PAD: "<|pad|>"}

    def __init__(self) -> None:
        self.bos_token_id: int | None = self.BOS
        self.eos_token_id: int | None = self.EOS
        self.pad_token_id: int | None = self.PAD

    @property
    def vocab_size(self) -> int:
        return 256 + len(self.SPECIALS)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Bytes of `text`; `add_special_tokens` prepends BOS (the raw prompt otherwise)."""
        ids = list(text.encode("utf-8"))
        return [self.BOS, *ids] if add_special_tokens else ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Runs of byte ids decode together (multi-byte characters), invalid UTF-8 as U+FFFD."""
        parts: list[str] = []
        run = bytearray()
        for i in ids:
            if 0 <= i < 256:
                run.append(i)
                continue
            parts.append(run.decode("utf-8", errors="replace"))
            run.clear()
            if i in self.SPECIALS:
                parts.append("" if skip_special_tokens else self.SPECIALS[i])
            else:
                parts.append("\ufffd")  # outside the byte vocabulary (a tiny model's spare rows)
        parts.append(run.decode("utf-8", errors="replace"))
        return "".join(parts)


class HFTokenizer:
    """A `tokenizer.json` via the `tokenizers` library (no transformers, no remote code)."""

    def __init__(self, path: str | os.PathLike, bos_token: str | None = None, eos_token: str | None = None):
        from tokenizers import Tokenizer as _Tokenizer  # deferred: the byte path needs no dependency

        self.path = Path(path)
        try:
            self._tok = _Tokenizer.from_file(str(self.path))
        except Exception as exc:  # tokenizers raises a bare Exception for a malformed file
            detail = " ".join(str(exc).split())  # tokenizers' messages span lines
            raise TokenizerError(f"{self.path}: not a readable tokenizer.json ({detail})") from None
        self.bos_token_id = self._tok.token_to_id(bos_token) if bos_token else None
        self.eos_token_id = self._tok.token_to_id(eos_token) if eos_token else None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Default False: prompts (e.g. chat-formatted) carry their own special tokens."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)


def _special_token(config: dict, key: str) -> str | None:
    """tokenizer_config.json writes a special token as a string or as {"content": ...}."""
    value = config.get(key)
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def load_tokenizer(directory: str | os.PathLike | None) -> Tokenizer:
    """`directory/tokenizer.json` when present (bos/eos names from tokenizer_config.json), else bytes."""
    if directory is None:
        return ByteTokenizer()
    root = Path(directory)
    if not root.is_dir():
        raise FileNotFoundError(f"tokenizer directory {root} not found")
    if not (root / TOKENIZER_FILE).is_file():
        return ByteTokenizer()
    config: dict = {}
    config_path = root / TOKENIZER_CONFIG_FILE
    if config_path.is_file():
        try:
            loaded = json.loads(config_path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise TokenizerError(f"{config_path}: unreadable JSON ({exc})") from None
        config = loaded if isinstance(loaded, dict) else {}
    bos, eos = _special_token(config, "bos_token"), _special_token(config, "eos_token")
    return HFTokenizer(root / TOKENIZER_FILE, bos, eos)
