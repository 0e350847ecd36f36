"""Tokenizers: the offline Mistral v1 SentencePiece model, or any Hugging Face tokenizer.

Both expose one interface (`Tokenizer`): `encode` treats its text literally (a document that contains the
string "</s>" never produces the EOS id), `decode` renders BOS/EOS ids as their token strings, so the
token stream `doc_1 EOS doc_2 EOS` decodes to `doc_1 + "</s>" + doc_2 + "</s>"`.

`save_pretrained(path)` writes a directory that `transformers.AutoTokenizer.from_pretrained(path)` loads
offline and that produces exactly the same ids as `encode` (used by the Hugging Face export for lm-eval).
Pass the shards' `add_bos` to it: without BOS in training the export declares no `bos_token`, so lm-eval
conditions a document's first token on EOS (its fallback prefix), exactly as in the packed training stream.
"""
from __future__ import annotations

import hashlib
import json
import os
from abc import ABC, abstractmethod
from collections.abc import Sequence
from functools import cached_property
from pathlib import Path

DEFAULT_TOKENIZER = "mistral-v1"
_SPM_WS = "\u2581"  # SentencePiece's whitespace symbol
_PROBE_TEXT = "  Indented\tcode:\n        return x  # über 中文 🤖 </s> <s>\n\n\n   end "


def mistral_v1_model_path() -> Path:
    """Path of `tokenizer.model.v1` (SentencePiece BPE, vocab 32000) shipped inside `mistral_common`."""
    try:
        import mistral_common
    except ImportError as e:  # pragma: no cover - dependency of the project
        raise ImportError("the offline tokenizer needs mistral-common: pip install mistral-common==1.13.1") from e
    path = Path(mistral_common.__file__).parent / "data" / "tokenizer.model.v1"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the installed mistral-common; "
                                "reinstall mistral-common==1.13.1")
    return path


class Tokenizer(ABC):
    """Common interface: `encode(text) -> ids`, `decode(ids) -> text`, special ids, HF export."""

    name: str
    vocab_size: int
    eos_id: int
    bos_id: int | None

    @abstractmethod
    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text, without BOS/EOS; special-token strings inside a text are plain text."""

    @abstractmethod
    def _decode_plain(self, ids: Sequence[int]) -> str:
        """Text of ids that contain no BOS/EOS id."""

    @abstractmethod
    def save_pretrained(self, path: str | os.PathLike, add_bos: bool = False,
                        model_max_length: int | None = None) -> Path:
        """Write a directory for `AutoTokenizer.from_pretrained`; `add_bos` makes `tok(text)` prepend BOS.

        `model_max_length` is recorded for tools that read it (lm-eval); None keeps Hugging Face's "unset".
        """

    @property
    @abstractmethod
    def fingerprint(self) -> str:
        """SHA-256 that identifies the vocabulary (stored in `meta.json`, checked by the loader)."""

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` (no BOS/EOS added)."""
        return self.encode_batch([text])[0]

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`; BOS/EOS ids appear as their token strings (e.g. "</s>")."""
        specials = {self.eos_id: self.token_str(self.eos_id)}
        if self.bos_id is not None:
            specials[self.bos_id] = self.token_str(self.bos_id)
        out: list[str] = []
        seg: list[int] = []
        for i in (int(x) for x in ids):
            if i in specials:
                out.append(self._decode_plain(seg))
                out.append(specials[i])
                seg = []
            else:
                seg.append(i)
        out.append(self._decode_plain(seg))
        return "".join(out)

    @abstractmethod
    def token_str(self, token_id: int) -> str:
        """The string of one token (e.g. "</s>" for EOS)."""

    def describe(self) -> dict:
        """JSON-able identity stored in `meta.json`."""
        return {"name": self.name, "vocab_size": self.vocab_size, "eos_id": self.eos_id, "bos_id": self.bos_id,
                "fingerprint": self.fingerprint}

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, vocab_size={self.vocab_size})"


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece model file; `mistral-v1` is mistral_common's `tokenizer.model.v1`."""

    def __init__(self, model_path: str | os.PathLike, name: str | None = None) -> None:
        import sentencepiece as spm

        self.model_path = Path(model_path)
        if not self.model_path.is_file():
            raise FileNotFoundError(f"SentencePiece model {self.model_path} does not exist")
        self._sp = spm.SentencePieceProcessor(model_file=str(self.model_path))
        self.name = name or str(self.model_path)
        self.vocab_size = int(self._sp.vocab_size())
        self.eos_id = int(self._sp.eos_id())
        bos = int(self._sp.bos_id())
        self.bos_id = bos if bos >= 0 else None
        if self.eos_id < 0:
            raise ValueError(f"SentencePiece model {self.model_path} has no EOS piece; documents are separated by EOS")

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return self._sp.encode(list(texts), num_threads=1)

    def _decode_plain(self, ids: Sequence[int]) -> str:
        return self._sp.decode(list(ids)) if ids else ""

    def token_str(self, token_id: int) -> str:
        return self._sp.id_to_piece(int(token_id))

    @cached_property
    def fingerprint(self) -> str:
        return hashlib.sha256(self.model_path.read_bytes()).hexdigest()

    def __getstate__(self) -> dict:
        return {"model_path": str(self.model_path), "name": self.name}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["model_path"], state["name"])

    def save_pretrained(self, path: str | os.PathLike, add_bos: bool = False,
                        model_max_length: int | None = None) -> Path:
        """Export as a `tokenizers` BPE (tokenizer.json) whose ids equal SentencePiece's.

        SentencePiece merges the highest-scoring adjacent pair first, ties leftmost. The `tokenizers` BPE
        ranks merges instead, so merges are ranked by score; the only ties in a SentencePiece BPE model are
        the whitespace-run pieces (all scored -1e9), which SentencePiece grows from the left: ranking
        `(run_a, run_b)` merges by "reaches the longest piece, then extends a run by one, longest first"
        reproduces that. Text normalisation is SentencePiece's: prepend "▁", map " " to "▁", no splitting.
        """
        from sentencepiece import sentencepiece_model_pb2
        from tokenizers import AddedToken, decoders, normalizers, processors
        from tokenizers import Tokenizer as HFBackend
        from tokenizers.models import BPE
        from transformers import PreTrainedTokenizerFast

        proto = sentencepiece_model_pb2.ModelProto()
        proto.ParseFromString(self.model_path.read_bytes())
        if proto.trainer_spec.model_type != sentencepiece_model_pb2.TrainerSpec.BPE:
            raise ValueError(f"{self.model_path}: only SentencePiece BPE models can be exported (got a unigram model)")
        if proto.normalizer_spec.name not in ("identity", ""):
            raise ValueError(f"{self.model_path}: normaliser {proto.normalizer_spec.name!r} has no exact HF export")
        vocab = {p.piece: i for i, p in enumerate(proto.pieces)}
        ws_max = max((len(p.piece) for p in proto.pieces if set(p.piece) == {_SPM_WS}), default=1)
        ranked: list[tuple] = []
        for p in proto.pieces:
            if p.type != sentencepiece_model_pb2.ModelProto.SentencePiece.NORMAL:
                continue
            s = p.piece
            for k in range(1, len(s)):
                left, right = s[:k], s[k:]
                if left not in vocab or right not in vocab:
                    continue
                if set(s) == {_SPM_WS}:  # equal-score whitespace runs: emulate leftmost-first growth
                    tie = (0 if len(s) == ws_max else (1 if len(right) == 1 else 2), -len(left))
                else:
                    tie = (0, 0)
                ranked.append((-p.score, tie, vocab[left], vocab[right], left, right))
        ranked.sort()
        merges = [(left, right) for *_, left, right in ranked]
        unk = proto.trainer_spec.unk_piece or "<unk>"
        backend = HFBackend(BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True,
                                byte_fallback=proto.trainer_spec.byte_fallback))
        norm = [normalizers.Replace(" ", _SPM_WS)]
        if proto.normalizer_spec.add_dummy_prefix:
            norm.insert(0, normalizers.Prepend(_SPM_WS))
        backend.normalizer = normalizers.Sequence(norm)
        dec = [decoders.Replace(_SPM_WS, " "), decoders.ByteFallback(), decoders.Fuse()]
        if proto.normalizer_spec.add_dummy_prefix:
            dec.append(decoders.Strip(" ", 1, 0))
        backend.decoder = decoders.Sequence(dec)
        specials = [p.piece for p in proto.pieces if p.type in (2, 3)]  # UNKNOWN, CONTROL
        backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
        bos = self.token_str(self.bos_id) if add_bos and self.bos_id is not None else None
        if add_bos:
            if bos is None:
                raise ValueError(f"{self.name} has no BOS token; save_pretrained(add_bos=True) is impossible")
            backend.post_processor = processors.TemplateProcessing(
                single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, self.bos_id)])
        extra = {} if model_max_length is None else {"model_max_length": model_max_length}
        hf = PreTrainedTokenizerFast(
            tokenizer_object=backend, bos_token=bos, eos_token=self.token_str(self.eos_id), unk_token=unk,
            split_special_tokens=True, clean_up_tokenization_spaces=False, **extra)
        probes = [" " * k + tail for k in range(1, 41) for tail in ("x", "\n")] + [_PROBE_TEXT]
        if self.encode_batch(probes) != hf(probes, add_special_tokens=False)["input_ids"]:
            raise ValueError(f"{self.model_path}: the exported tokenizer does not reproduce SentencePiece's ids; "
                             "this model's whitespace pieces break the tie-ranking rule, export is unsupported")
        out = Path(path)
        out.mkdir(parents=True, exist_ok=True)
        hf.save_pretrained(str(out))
        return out


class HFTokenizer(Tokenizer):
    """Any Hugging Face tokenizer by hub name or local path (special-token strings in text stay text)."""

    def __init__(self, name_or_path: str) -> None:
        from transformers import AutoTokenizer

        self.name = name_or_path
        try:
            self._tok = AutoTokenizer.from_pretrained(name_or_path, split_special_tokens=True)
        except (OSError, ValueError) as e:
            raise ValueError(
                f"cannot load tokenizer {name_or_path!r}: {e}. Use 'mistral-v1' (offline default), a local "
                "directory with tokenizer files, or a hub name (needs network or a filled HF cache)") from e
        if self._tok.eos_token_id is None:
            raise ValueError(f"tokenizer {name_or_path!r} has no EOS token; documents are separated by EOS, "
                             "pick a tokenizer with an eos_token")
        self.vocab_size = len(self._tok)
        self.eos_id = int(self._tok.eos_token_id)
        self.bos_id = None if self._tok.bos_token_id is None else int(self._tok.bos_token_id)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return self._tok(list(texts), add_special_tokens=False)["input_ids"]

    def _decode_plain(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def token_str(self, token_id: int) -> str:
        return self._tok.convert_ids_to_tokens(int(token_id))

    @cached_property
    def fingerprint(self) -> str:
        vocab = sorted(self._tok.get_vocab().items(), key=lambda kv: kv[1])
        return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()

    def __getstate__(self) -> dict:
        return {"name": self.name}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["name"])

    def save_pretrained(self, path: str | os.PathLike, add_bos: bool = False,
                        model_max_length: int | None = None) -> Path:
        """Save the wrapped tokenizer (its own BOS convention; `add_bos` must match it)."""
        out = Path(path)
        out.mkdir(parents=True, exist_ok=True)
        probe = self._tok("a")["input_ids"]
        adds_bos = self.bos_id is not None and len(probe) > 0 and probe[0] == self.bos_id
        if adds_bos != add_bos:
            raise ValueError(f"tokenizer {self.name!r} {'adds' if adds_bos else 'does not add'} BOS by itself; "
                             f"save_pretrained(add_bos={add_bos}) would change that: prepare the data with "
                             f"add_bos={adds_bos} or use a tokenizer with the other convention")
        if model_max_length is not None:
            self._tok.model_max_length = model_max_length
        self._tok.save_pretrained(str(out))
        return out


def load_tokenizer(name_or_path: str = DEFAULT_TOKENIZER) -> Tokenizer:
    """`"mistral-v1"` (offline, vocab 32000), a `.model` SentencePiece file, or a Hugging Face name/path."""
    if name_or_path == DEFAULT_TOKENIZER:
        return SentencePieceTokenizer(mistral_v1_model_path(), name=DEFAULT_TOKENIZER)
    if name_or_path.endswith(".model") and Path(name_or_path).is_file():
        return SentencePieceTokenizer(name_or_path)
    looks_local = os.path.isabs(name_or_path) or name_or_path.startswith((".", "~"))
    if looks_local and not Path(name_or_path).expanduser().exists():
        raise ValueError(f"cannot load tokenizer {name_or_path!r}: no such file or directory. Use 'mistral-v1' "
                         "(offline default), an existing tokenizer directory, or a Hugging Face hub name")
    return HFTokenizer(str(Path(name_or_path).expanduser()) if looks_local else name_or_path)
