"""The synthetic task: fixed-width multi-digit addition, answer most-significant digit first.

    prompt  "<bos>0473+0918="      answer "01391" then <eos>

Writing the sum most-significant digit first makes every answer digit depend on the whole carry chain of
the digits to its right, which is where extra loops help. Token ids are the UTF-8 byte values of the
characters and BOS/EOS/PAD are 256/257/258, i.e. exactly the engine's `ByteTokenizer`; the shipped
`tokenizer.json` reproduces the same ids, so either tokenizer feeds the trained model correctly.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

BOS, EOS, PAD, UNK = 256, 257, 258, 259
SPECIAL_NAMES = {BOS: "<|bos|>", EOS: "<|eos|>", PAD: "<|pad|>", UNK: "<|unk|>"}
EVAL_SEED = 20_240_917  # the built-in evaluation set (disjoint from every training batch)


@dataclass(frozen=True)
class AdditionTask:
    digits: int = 4

    @property
    def prompt_len(self) -> int:
        """Token count of a prompt, BOS included."""
        return 1 + 2 * self.digits + 2

    @property
    def answer_len(self) -> int:
        """Answer digits (EOS not counted)."""
        return self.digits + 1

    def text(self, a: int, b: int) -> tuple[str, str]:
        d = self.digits
        return f"{a:0{d}d}+{b:0{d}d}=", f"{a + b:0{d + 1}d}"

    def encode_prompt(self, prompt: str) -> list[int]:
        return [BOS, *prompt.encode("ascii")]

    def encode_answer(self, answer: str) -> list[int]:
        return [*answer.encode("ascii"), EOS]

    def sample_pairs(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return rng.integers(0, 10**self.digits, size=(n, 2))

    def batch(self, rng: np.random.Generator, n: int, exclude: set[tuple[int, int]]) -> np.ndarray:
        """[n, prompt_len + answer_len + 1] token ids (prompt, answer, EOS); eval pairs never appear."""
        rows = []
        while len(rows) < n:
            for a, b in self.sample_pairs(rng, n - len(rows)):
                if (int(a), int(b)) in exclude:
                    continue
                p, ans = self.text(int(a), int(b))
                rows.append(self.encode_prompt(p) + self.encode_answer(ans))
        return np.asarray(rows, dtype=np.int64)

    def eval_items(self, n: int, seed: int = EVAL_SEED) -> list[dict[str, str]]:
        rng = np.random.default_rng(seed)
        seen: set[tuple[int, int]] = set()
        out = []
        while len(out) < n:
            a, b = (int(x) for x in self.sample_pairs(rng, 1)[0])
            if (a, b) in seen:
                continue
            seen.add((a, b))
            p, ans = self.text(a, b)
            out.append({"prompt": p, "answer": ans})
        return out


def eval_pairs(items: list[dict[str, str]]) -> set[tuple[int, int]]:
    out = set()
    for it in items:
        a, b = it["prompt"].rstrip("=").split("+")
        out.add((int(a), int(b)))
    return out


def write_jsonl(items: list[dict], path: Path) -> None:
    path.write_text("".join(json.dumps(it) + "\n" for it in items), encoding="utf-8")


def iter_jsonl(path: Path) -> Iterator[tuple[int, dict]]:
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if line.strip():
            yield lineno, json.loads(line)


def add_bos(tok) -> None:
    """The models are trained on BOS-first prompts: encoding with special tokens (as vLLM and `looptrace
    serve` do for a completion prompt) puts BOS first."""
    # deferred: the tokenizers library, only when a tokenizer is built
    from tokenizers import processors

    bos = SPECIAL_NAMES[BOS]
    tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, BOS)])


def write_tokenizer(directory: Path) -> None:
    """tokenizer.json (+ tokenizer_config.json): one token per character, id = its byte value."""
    # deferred: the tokenizers library, only when a tokenizer is built
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {chr(i): i for i in range(32, 127)}
    vocab.update({name: i for i, name in SPECIAL_NAMES.items()})
    tok = Tokenizer(models.WordLevel(vocab, unk_token=SPECIAL_NAMES[UNK]))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(list(SPECIAL_NAMES.values()))
    add_bos(tok)
    tok.save(str(directory / "tokenizer.json"))
    config = {
        "bos_token": SPECIAL_NAMES[BOS],
        "eos_token": SPECIAL_NAMES[EOS],
        "pad_token": SPECIAL_NAMES[PAD],
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
