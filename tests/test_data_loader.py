"""`TokenLoader`: packing, determinism, exact resume, rank/worker sharding, varlen and bad shards."""
from __future__ import annotations

import json
from itertools import islice

import numpy as np
import pytest
import torch
from test_data_fixtures import prepared, split_tokens

from data import TokenLoader, load_tokenizer, read_meta
from data.mixing import FeistelPermutation

T = 64


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    out, _ = prepared(tmp_path_factory.mktemp("loader"), n_docs=150)
    return out


def _windows(shards, split: str = "train") -> np.ndarray:
    tokens = split_tokens(shards, split)
    return tokens[: tokens.size // T * T].reshape(-1, T)


def _index_of(shards, split: str = "train") -> dict[bytes, int]:
    table = {row.tobytes(): i for i, row in enumerate(_windows(shards, split))}
    assert len(table) == len(_windows(shards, split))  # fixture windows are distinct
    return table


def _take(loader, n: int) -> list[dict[str, torch.Tensor]]:
    return list(islice(loader, n))


def _same(a: list[dict], b: list[dict]) -> bool:
    return len(a) == len(b) and all(x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
                                    for x, y in zip(a, b))


def test_feistel_is_a_keyed_permutation():
    for n in (1, 2, 3, 5, 17, 1000, 4097):
        p = FeistelPermutation(n, key=12345)(np.arange(n))
        assert np.array_equal(np.sort(p), np.arange(n))
    a, b = FeistelPermutation(1000, key=1)(np.arange(1000)), FeistelPermutation(1000, key=2)(np.arange(1000))
    assert not np.array_equal(a, b) and not np.array_equal(a, np.arange(1000))


def test_batches_are_packed_windows(shards):
    loader = TokenLoader(shards, seq_len=T, batch_size=4, seed=0)
    index = _index_of(shards)
    batch = next(iter(loader))
    assert set(batch) == {"input_ids", "labels"}
    assert batch["input_ids"].shape == (4, T) and batch["input_ids"].dtype == torch.long
    assert torch.equal(batch["input_ids"], batch["labels"])
    assert all(row.numpy().tobytes() in index for row in batch["input_ids"])
    assert loader.vocab_size == 32000 and loader.meta["tokenizer"]["name"] == "mistral-v1"
    assert loader.num_windows == len(index) and loader.tokens_per_step == 4 * T


def test_determinism_and_seed(shards):
    a = _take(TokenLoader(shards, seq_len=T, batch_size=3, seed=7), 10)
    b = _take(TokenLoader(shards, seq_len=T, batch_size=3, seed=7), 10)
    c = _take(TokenLoader(shards, seq_len=T, batch_size=3, seed=8), 10)
    assert _same(a, b) and not _same(a, c)
    index = _index_of(shards)
    order = [index[r.numpy().tobytes()] for x in a for r in x["input_ids"]]
    assert order != sorted(order)  # shuffled


def test_same_stream_for_varlen_and_workers(shards):
    plain = _take(TokenLoader(shards, seq_len=T, batch_size=3, seed=1), 6)
    varlen = _take(TokenLoader(shards, seq_len=T, batch_size=3, seed=1, varlen=True), 6)
    workers = _take(TokenLoader(shards, seq_len=T, batch_size=3, seed=1, num_workers=2), 6)
    assert _same(plain, workers)
    for p, v in zip(plain, varlen):
        assert torch.equal(p["input_ids"].reshape(1, -1), v["input_ids"])


def test_exact_resume(shards):
    ref = TokenLoader(shards, seq_len=T, batch_size=3, seed=4)
    expected = _take(ref, 25)
    first = TokenLoader(shards, seq_len=T, batch_size=3, seed=4)
    it = iter(first)
    head = [next(it) for _ in range(11)]
    state = json.loads(json.dumps(first.state_dict()))
    assert len(json.dumps(state)) < 1000 and state["cursor"] == 33
    resumed = TokenLoader(shards, seq_len=T, batch_size=3, seed=4, num_workers=2)  # worker count may change
    resumed.load_state_dict(state)
    assert _same(head + _take(resumed, 14), expected)
    assert _same(_take(first, 14), expected[11:])  # the original continues identically (no state mutation)


def test_epochs_wrap_without_skipping(shards):
    loader = TokenLoader(shards, seq_len=T, batch_size=5, seed=2)
    index = _index_of(shards)
    W = loader.num_windows
    steps = -(-2 * W // 5)
    seen = [index[r.numpy().tobytes()] for x in _take(loader, steps) for r in x["input_ids"]]
    assert sorted(seen[:W]) == list(range(W)) and sorted(seen[W:2 * W]) == list(range(W))
    assert seen[:W] != seen[W:2 * W]  # a new order each epoch
    assert loader.epoch >= 2


@pytest.mark.parametrize("world_size", [2, 3])
def test_ranks_cover_every_window_once(shards, world_size):
    index = _index_of(shards)
    B = 2
    loaders = [TokenLoader(shards, seq_len=T, batch_size=B, seed=3, rank=r, world_size=world_size)
               for r in range(world_size)]
    W = loaders[0].num_windows
    steps = -(-W // (B * world_size))
    per_rank = [[index[r.numpy().tobytes()] for x in _take(ld, steps) for r in x["input_ids"]] for ld in loaders]
    merged = [per_rank[r][s * B + j] for s in range(steps) for r in range(world_size) for j in range(B)]
    assert sorted(merged[:W]) == list(range(W))
    single = TokenLoader(shards, seq_len=T, batch_size=B * world_size, seed=3)
    flat = [index[r.numpy().tobytes()] for x in _take(single, steps) for r in x["input_ids"]]
    assert merged == flat  # the global stream does not depend on how it is split over ranks


def test_reshard_rule(shards):
    index = _index_of(shards)
    ref = TokenLoader(shards, seq_len=T, batch_size=4, seed=5)
    flat = [index[r.numpy().tobytes()] for x in _take(ref, 6) for r in x["input_ids"]]
    two = [TokenLoader(shards, seq_len=T, batch_size=2, seed=5, rank=r, world_size=2) for r in range(2)]
    for ld in two:
        _take(ld, 2)
    state = two[1].state_dict()  # any rank's state resumes all ranks
    strict = TokenLoader(shards, seq_len=T, batch_size=4, seed=5)
    with pytest.raises(ValueError, match=r"world_size=2.*this loader has world_size=1.*reshard=True"):
        strict.load_state_dict(state)
    strict = TokenLoader(shards, seq_len=T, batch_size=4, seed=5, reshard=True)
    strict.load_state_dict(state)
    after = [index[r.numpy().tobytes()] for x in _take(strict, 4) for r in x["input_ids"]]
    assert after == flat[8:24]  # continues at global window 8: nothing skipped, nothing repeated


def test_resume_rejects_changed_order(shards):
    state = TokenLoader(shards, seq_len=T, batch_size=2, seed=1).state_dict()
    for kwargs, message in (({"seed": 2}, "seed=1"), ({"seq_len": 32}, "seq_len=64")):
        loader = TokenLoader(shards, **{"seq_len": T, "batch_size": 2, "seed": 1, **kwargs})
        with pytest.raises(ValueError, match=message):
            loader.load_state_dict(state)
    val = TokenLoader(shards, split="val", seq_len=T, batch_size=1)
    with pytest.raises(ValueError, match="split"):
        val.load_state_dict(state)


def test_varlen_boundaries(shards):
    eos = load_tokenizer().eos_id
    loader = TokenLoader(shards, seq_len=T, batch_size=4, seed=0, varlen=True)
    saw_doc_boundary = False
    for batch in _take(loader, 20):
        ids, cu = batch["input_ids"][0], batch["cu_seqlens"]
        assert batch["input_ids"].shape == (1, 4 * T) and cu.dtype == torch.long
        assert cu[0] == 0 and cu[-1] == 4 * T and bool((cu[1:] > cu[:-1]).all())
        assert set(range(0, 4 * T + 1, T)) <= set(cu.tolist())  # windows are separate sequences
        for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
            inner = ids[a:b - 1]
            assert not bool((inner == eos).any())  # no document boundary inside a segment
            assert ids[b - 1] == eos or b % T == 0  # segments end at EOS or at a window edge
            saw_doc_boundary |= b % T != 0
    assert saw_doc_boundary


def test_val_split_in_order_and_sharded(shards):
    windows = _windows(shards, "val")
    one = TokenLoader(shards, split="val", seq_len=T, batch_size=2)
    batches = list(one)
    assert len(batches) == len(one) == len(windows) // 2
    assert np.array_equal(torch.cat([b["input_ids"] for b in batches]).numpy(), windows[: len(one) * 2])
    assert _same(list(one), batches)  # every pass is the same
    ranks = [list(TokenLoader(shards, split="val", seq_len=T, batch_size=1, rank=r, world_size=2)) for r in (0, 1)]
    got = [ranks[r][s]["input_ids"] for s in range(len(ranks[0])) for r in (0, 1)]
    assert np.array_equal(torch.cat(got).numpy(), windows[: len(got)])


def test_bad_shards_are_named(tmp_path):
    out, _ = prepared(tmp_path, n_docs=40)
    meta = read_meta(out)
    shard = out / meta["chunks"][0]["train"]["file"]
    original = shard.read_bytes()
    shard.write_bytes(original + b"\x07")
    with pytest.raises(ValueError, match=rf"{shard.name} has \d+ bytes, not a multiple of uint16"):
        TokenLoader(out, seq_len=T, batch_size=1)
    shard.write_bytes(original[:-2])
    with pytest.raises(ValueError, match=rf"{shard.name} holds \d+ tokens but meta.json says"):
        TokenLoader(out, seq_len=T, batch_size=1)
    flipped = bytearray(original)
    flipped[10] ^= 0xFF
    shard.write_bytes(bytes(flipped))
    with pytest.raises(ValueError, match=rf"{shard.name} fails its SHA-256 checksum"):
        TokenLoader(out, seq_len=T, batch_size=1)
    TokenLoader(out, seq_len=T, batch_size=1, verify=False)  # sizes still fine: opt-out of checksums works
    shard.write_bytes(original)
    shard.unlink()
    with pytest.raises(ValueError, match=rf"{shard.name} listed in meta.json is missing"):
        TokenLoader(out, seq_len=T, batch_size=1)
    shard.write_bytes(original)


def test_bad_metadata_and_arguments(tmp_path):
    out, _ = prepared(tmp_path, n_docs=40)
    meta_path = out / "meta.json"
    good = json.loads(meta_path.read_text())
    with pytest.raises(ValueError, match="differs from the one"):
        TokenLoader(out, seq_len=T, batch_size=1, tokenizer="gpt2")
    TokenLoader(out, seq_len=T, batch_size=1, tokenizer=load_tokenizer())  # the right tokenizer passes
    bad = json.loads(json.dumps(good))
    bad["tokenizer"]["vocab_size"] = 70_000
    meta_path.write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="70000 ids does not fit uint16"):
        TokenLoader(out, seq_len=T, batch_size=1)
    bad = json.loads(json.dumps(good))
    bad["complete"] = False
    meta_path.write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="incomplete"):
        TokenLoader(out, seq_len=T, batch_size=1)
    meta_path.write_text(json.dumps(good))
    with pytest.raises(ValueError, match="fewer than seq_len"):
        TokenLoader(out, seq_len=10**7, batch_size=1)
    with pytest.raises(ValueError, match="fewer than world_size\\*batch_size"):
        TokenLoader(out, split="val", seq_len=T, batch_size=10**5)
    with pytest.raises(ValueError, match="rank=2"):
        TokenLoader(out, seq_len=T, batch_size=1, rank=2, world_size=2)
    with pytest.raises(ValueError, match="not a prepared shard directory"):
        TokenLoader(tmp_path / "nowhere", seq_len=T, batch_size=1)
    with pytest.raises(TypeError, match="endless"):
        len(TokenLoader(out, seq_len=T, batch_size=1))
