"""Damaged shards are rebuilt by the next prepare, overwrite=true always rebuilds, and a tokenizer that is not the
shards' one is refused (data.shards.check_tokenizer, train.py)."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from test_data_fixtures import make_docs, prepared
from toy_run import TOY, run_train

from data import load_tokenizer, read_meta
from data.shards import check_tokenizer, sha256_file
from trainer.config import ConfigError


def _state(shard_dir: Path) -> dict[str, str]:
    return {f.name: sha256_file(f) for f in sorted(shard_dir.glob("*.bin"))}


def _word_tokenizer(path: Path, n_words: int) -> Path:
    """A word-level Hugging Face tokenizer directory with ``n_words`` fillers plus the fixture documents' words."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = sorted({w for d in make_docs(120) for w in d.split()})
    vocab = {"[UNK]": 0, "[EOS]": 1} | {f"filler{i}": i + 2 for i in range(n_words)}
    vocab |= {w: n_words + 2 + i for i, w in enumerate(words)}
    backend = Backend(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    if path.exists():
        shutil.rmtree(path)
    PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="[EOS]", unk_token="[UNK]").save_pretrained(path)
    return path


def test_a_truncated_or_corrupted_shard_is_rebuilt(tmp_path: Path, capfd: pytest.CaptureFixture) -> None:
    from data.loader import TokenLoader

    out, _ = prepared(tmp_path)
    good = _state(out)
    assert len(good) >= 8
    victim = out / "train-00002.bin"
    victim.write_bytes(victim.read_bytes()[:-6])  # torn: 3 tokens short
    assert prepared(tmp_path)[0] == out
    assert f"{victim} holds" in capfd.readouterr().err and _state(out) == good
    data = bytearray(victim.read_bytes())  # corrupted in place, same size
    data[10:14] = b"\xff\xff\xff\xff"
    victim.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"fails its SHA-256.*rerun python -m data.prepare .*verify=true"):
        TokenLoader(out, split="train", seq_len=32, batch_size=2)
    prepared(tmp_path, verify=True)  # what the message says: the shard is rebuilt, no loop
    assert _state(out) == good
    TokenLoader(out, split="train", seq_len=32, batch_size=2)
    (out / "val-00001.bin").unlink()  # a missing shard too
    prepared(tmp_path)
    assert _state(out) == good


def test_overwrite_rebuilds_with_the_same_settings(tmp_path: Path) -> None:
    out, _ = prepared(tmp_path)
    good = _state(out)
    (out / "meta.json").write_text('{"format": "kdn-token-shards", "ver')  # unreadable
    with pytest.raises(ValueError, match="meta.json is not valid JSON"):
        prepared(tmp_path)
    prepared(tmp_path, overwrite=True)
    assert read_meta(out)["complete"] and _state(out) == good


def test_a_tokenizer_mismatch_is_refused_naming_both(tmp_path: Path) -> None:
    tok_dir = _word_tokenizer(tmp_path / "tok", 5000)
    out, _ = prepared(tmp_path, tokenizer=str(tok_dir), val_fraction=0.3)
    made_with = load_tokenizer(str(tok_dir))
    assert check_tokenizer(out, made_with)["tokenizer"]["fingerprint"] == made_with.fingerprint
    _word_tokenizer(tok_dir, 70_000)  # another tokenizer at the same path
    other = load_tokenizer(str(tok_dir))
    with pytest.raises(ValueError, match=rf"tokenizer .*vocab {other.vocab_size}, fingerprint "
                                         rf"{other.fingerprint[:16]}\) is not the one {out} was prepared with, .*"
                                         rf"vocab {made_with.vocab_size}, fingerprint {made_with.fingerprint[:16]}"):
        check_tokenizer(out, other)
    with pytest.raises(ValueError, match="is not the one"):
        check_tokenizer(out, load_tokenizer("mistral-v1"))
    # train.py reading the shards as they are (data.auto_prepare=false) refuses before building anything
    with pytest.raises(ConfigError, match=r"data.prepare.tokenizer: tokenizer .* is not the one"):
        run_train(TOY + [f"run_dir={tmp_path / 'run'}", "data.auto_prepare=false", f"data.prepare.out_dir={out}",
                         f"data.prepare.tokenizer={tok_dir}", "data.seq_len=16", "trainer.global_batch_tokens=32",
                         "trainer.max_steps=1"])
    assert not (tmp_path / "run" / "checkpoints").exists()
