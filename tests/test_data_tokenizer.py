"""The offline Mistral v1 tokenizer, its exact Hugging Face export, and the HF tokenizer wrapper."""
from __future__ import annotations

import json

import pytest
from test_data_fixtures import make_docs

from data import load_tokenizer
from data.tokenizer import HFTokenizer, SentencePieceTokenizer

TRICKY = [
    "Hello world.\n\nNew paragraph  with  double spaces\tand a tab.",
    "  leading spaces",
    "\nnewline first",
    " x",
    "trailing space ",
    "def f(x):\n        return x  # indented code\n\n\n",
    "Accents: café, naïve, über; CJK 中文字符; emoji 🤖; math ∑ x² ≤ 3.",
    "literal specials stay text: <s> </s> <unk>",
    "numbers 1234567 3.14159 -42 1e9",
] + [" " * k + "y\n" + " " * k for k in range(1, 40, 3)]


@pytest.fixture(scope="module")
def tok() -> SentencePieceTokenizer:
    return load_tokenizer("mistral-v1")


@pytest.fixture(scope="module")
def exported(tok, tmp_path_factory):
    """The tokenizer saved with save_pretrained and reloaded with AutoTokenizer, fully offline."""
    import os

    from transformers import AutoTokenizer

    path = tok.save_pretrained(tmp_path_factory.mktemp("hf_tok"))
    old = os.environ.get("HF_HUB_OFFLINE")
    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        return path, AutoTokenizer.from_pretrained(path)
    finally:
        if old is None:
            del os.environ["HF_HUB_OFFLINE"]
        else:
            os.environ["HF_HUB_OFFLINE"] = old


def test_mistral_v1_identity(tok):
    assert isinstance(tok, SentencePieceTokenizer)
    assert (tok.name, tok.vocab_size, tok.bos_id, tok.eos_id) == ("mistral-v1", 32000, 1, 2)
    assert tok.token_str(tok.eos_id) == "</s>"
    assert len(tok.fingerprint) == 64
    assert tok.encode("In the beginning")[:2] != tok.encode("At the end")[:2]


def test_round_trip_and_literal_specials(tok):
    for text in TRICKY + make_docs(20, seed=3):
        ids = tok.encode(text)
        assert tok.eos_id not in ids and tok.bos_id not in ids
        assert tok.decode(ids) == text
    ids = tok.encode("a") + [tok.eos_id] + tok.encode("b c") + [tok.eos_id]
    assert tok.decode(ids) == "a</s>b c</s>"


def test_batch_matches_single(tok):
    docs = make_docs(8, seed=5)
    assert tok.encode_batch(docs) == [tok.encode(d) for d in docs]


def test_hf_export_loads_offline_with_identical_ids(tok, exported):
    path, hf = exported
    assert {p.name for p in path.iterdir()} >= {"tokenizer.json", "tokenizer_config.json"}
    assert (hf.eos_token_id, len(hf)) == (tok.eos_id, tok.vocab_size)
    assert hf.bos_token_id is None  # trained without BOS: lm-eval then uses EOS as the prefix token
    texts = TRICKY + make_docs(30, seed=7)
    ours = tok.encode_batch(texts)
    theirs = hf(texts, add_special_tokens=False)["input_ids"]
    assert ours == theirs
    assert hf(texts[0])["input_ids"] == ours[0]  # add_bos=False: no BOS, matching the training stream
    assert hf.model_max_length > 10**20  # left unset: lm-eval falls back to the model config
    for text, ids in zip(texts, ours):
        assert hf.decode(ids) == text


def test_hf_export_with_bos(tok, tmp_path):
    from transformers import AutoTokenizer

    path = tok.save_pretrained(tmp_path / "bos", add_bos=True, model_max_length=4096)
    hf = AutoTokenizer.from_pretrained(path)
    assert hf("Hello there")["input_ids"] == [tok.bos_id] + tok.encode("Hello there")
    assert hf.bos_token_id == tok.bos_id
    assert hf.model_max_length == 4096
    assert json.loads((path / "tokenizer_config.json").read_text())["eos_token"] == "</s>"


def test_hf_wrapper_on_exported_dir(tok, exported):
    path, _ = exported
    wrapped = load_tokenizer(str(path))
    assert isinstance(wrapped, HFTokenizer)
    assert (wrapped.vocab_size, wrapped.eos_id, wrapped.bos_id) == (32000, 2, None)
    texts = TRICKY + make_docs(5, seed=11)
    assert wrapped.encode_batch(texts) == tok.encode_batch(texts)
    ids = wrapped.encode("x y") + [wrapped.eos_id]
    assert wrapped.decode(ids) == "x y</s>"
    with pytest.raises(ValueError, match="does not add BOS"):
        wrapped.save_pretrained(path.parent / "again", add_bos=True)
    assert wrapped.decode([1, 2]) == "<s></s>"  # "<s>" is still a special token of the vocabulary


def test_unknown_tokenizer_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="cannot load tokenizer"):
        load_tokenizer(str(tmp_path / "no-such-tokenizer"))
