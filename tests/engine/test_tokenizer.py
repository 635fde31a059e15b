"""Byte-level fallback tokenizer and tokenizer.json loading."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import models, pre_tokenizers, trainers

from looptrace.engine.model_config import PRESETS
from looptrace.engine.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer

TEXTS = ["hello world", "", "naïve café — 日本語 🙂\n\ttabs", "<|bos|> is just text"]


@pytest.mark.parametrize("text", TEXTS)
def test_byte_round_trip(text):
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert tok.decode(ids) == text
    with_bos = tok.encode(text, add_special_tokens=True)
    assert with_bos[0] == tok.bos_token_id == 256
    assert tok.decode(with_bos) == text
    assert tok.decode(with_bos, skip_special_tokens=False) == "<|bos|>" + text


def test_byte_ids_fit_tiny_presets():
    tok = ByteTokenizer()
    assert tok.vocab_size == 259
    assert {tok.bos_token_id, tok.eos_token_id, tok.pad_token_id} == {256, 257, 258}
    for name in ("ouro-tiny", "huginn-tiny", "olmo-retrofit-tiny"):
        assert tok.vocab_size <= PRESETS[name].vocab_size


def test_byte_decode_of_bad_input():
    tok = ByteTokenizer()
    assert tok.decode([0xE6, 0x97]) == "\ufffd"  # truncated multi-byte character
    assert tok.decode([104, 105, 400, 257, 33]) == "hi\ufffd!"  # a tiny model's spare id; EOS skipped


def test_load_tokenizer_falls_back_to_bytes(tmp_path):
    assert isinstance(load_tokenizer(None), ByteTokenizer)
    assert isinstance(load_tokenizer(tmp_path), ByteTokenizer)
    with pytest.raises(FileNotFoundError):
        load_tokenizer(tmp_path / "missing")


def test_tokenizer_json_is_picked_up(tmp_path):
    raw = RawTokenizer(models.WordLevel(unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(special_tokens=["[UNK]", "<s>", "</s>"])
    raw.train_from_iterator(["the cat sat", "the dog ran", "a cat ran"], trainer)
    raw.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": {"content": "</s>", "special": True}})
    )

    tok = load_tokenizer(tmp_path)
    assert isinstance(tok, HFTokenizer) and isinstance(tok, Tokenizer)
    ids = tok.encode("the cat ran")
    assert ids == [raw.token_to_id(w) for w in ("the", "cat", "ran")]
    assert tok.decode(ids) == "the cat ran"
    assert tok.vocab_size == raw.get_vocab_size()
    assert (tok.bos_token_id, tok.eos_token_id) == (raw.token_to_id("<s>"), raw.token_to_id("</s>"))
    assert tok.encode("the zebra") == [raw.token_to_id("the"), raw.token_to_id("[UNK]")]


def test_bad_tokenizer_json(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(ValueError, match="not a readable tokenizer.json"):
        load_tokenizer(tmp_path)


def test_shipped_tiny_tokenizers_put_bos_first_only_with_special_tokens():
    # Before: a completion prompt through `looptrace serve` reached the trained tiny models without the
    # BOS they were trained with (their tokenizer.json added none), and they answered nonsense.
    from looptrace.assets import shipped_weights
    from looptrace.engine.tokenizer import load_tokenizer

    for model in ("ouro-tiny", "huginn-tiny"):
        tok = load_tokenizer(shipped_weights(model))
        plain = tok.encode("20+87=")
        assert tok.encode("20+87=", add_special_tokens=True) == [tok.bos_token_id, *plain]
        assert tok.bos_token_id not in plain and tok.decode([tok.bos_token_id, *plain]) == "20+87="
