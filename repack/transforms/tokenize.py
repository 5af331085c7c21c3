"""Tokenization: load a local HuggingFace tokenizer, identify it, find EOS/BOS, encode batches.

Only local files: ``--tokenizer`` is a ``tokenizer.json``, a folder holding one (a HuggingFace
model folder; its ``tokenizer_config.json``, when present, names the EOS/BOS tokens), or a model
folder of the local HuggingFace cache (``~/.cache/huggingface/hub/models--org--name``: the
snapshot ``refs/main`` names, else its only snapshot). Never a hub download.

Encoding: ``encode_batch_fast`` (no offsets) with the template's special tokens unless
``special_tokens=False``; then BOS is put in front when asked (unless the template already
did) and EOS appended (unless the document already ends with it). A batch the tokenizer
rejects is retried document by document so only the offending documents are quarantined.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from itertools import chain
from pathlib import Path
from typing import TYPE_CHECKING

from repack.errors import UsageError

if TYPE_CHECKING:
    import numpy as np

BPE_CACHE_WORDS = 10_000  # words a BPE model keeps merged (tokenizers' default, pinned): see ``_pin_word_cache``
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "<|eos|>", "[EOS]", "<|end|>")
BOS_CANDIDATES = ("<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>", "<|bos|>", "[BOS]")

_CACHE: dict[str, object] = {}
_SEEN: dict[tuple, str] = {}  # (path, size, mtime_ns, inode) -> sha256 of a tokenizer file loaded already


def resolve_tokenizer_path(path: str) -> Path:
    """The tokenizer.json that ``path`` names: a file, a folder holding tokenizer.json, or a
    HuggingFace cache model folder (models--org--name, with snapshots/<rev>/tokenizer.json)."""
    p = Path(path).expanduser()
    if p.is_dir() and (p / "snapshots").is_dir() and not (p / "tokenizer.json").exists():
        p = _cached_snapshot(p)
    if p.is_dir():
        p = p / "tokenizer.json"
    if not p.is_file():
        raise UsageError(f"--tokenizer {path!r}: no tokenizer.json there (a local HuggingFace tokenizer.json, "
                         "a model folder holding one, or a HuggingFace cache folder models--org--name is needed; "
                         "nothing is downloaded)")
    return p.absolute()


def _cached_snapshot(model: Path) -> Path:
    """The snapshot folder of a HuggingFace cache model folder: the one refs/main names, else the only one."""
    try:
        revision = (model / "refs" / "main").read_text().strip()
    except OSError:
        revision = ""
    if revision and (model / "snapshots" / revision).is_dir():
        return model / "snapshots" / revision
    snapshots = sorted(d for d in (model / "snapshots").iterdir() if (d / "tokenizer.json").is_file())
    if len(snapshots) == 1:
        return snapshots[0]
    if not snapshots:
        raise UsageError(f"--tokenizer {str(model)!r}: no snapshot in this HuggingFace cache folder holds a "
                         "tokenizer.json (nothing is downloaded)")
    raise UsageError(f"--tokenizer {str(model)!r}: {len(snapshots)} snapshots and no refs/main; name one: "
                     + ", ".join(str(d) for d in snapshots))


def load_tokenizer(path: str | os.PathLike, expected_sha256: str | None = None):
    """(Tokenizer, sha256 of its file); cached per process (a file whose path, size, mtime and inode
    were seen already is not read and hashed again: a worker runs many tasks); refuses a file whose
    sha256 changed."""
    from tokenizers import Tokenizer

    try:
        st = os.stat(path)
        seen = _SEEN.get((str(path), st.st_size, st.st_mtime_ns, st.st_ino))
        if seen is not None and (expected_sha256 is None or seen == expected_sha256):
            return _CACHE[seen], seen
        data = Path(path).read_bytes()
    except OSError as exc:
        raise UsageError(f"--tokenizer {str(path)!r}: cannot read it ({exc.strerror})") from None
    sha = hashlib.sha256(data).hexdigest()
    if expected_sha256 and sha != expected_sha256:
        raise UsageError(f"{path}: the tokenizer changed since the job was planned (sha256 {sha[:12]}...)")
    if sha not in _CACHE:
        try:
            _CACHE[sha] = Tokenizer.from_str(data.decode("utf-8"))
        except Exception as exc:  # noqa: BLE001 - tokenizers raises plain Exception
            raise UsageError(f"{path}: not a loadable tokenizer.json ({exc})") from None
        # a document is tokenized whole: a saved truncation (BERT's 512) would cut it, saved padding would add
        # pad ids that depend on the batch (transformers' fast tokenizers drop both on load too)
        _CACHE[sha].no_truncation()
        _CACHE[sha].no_padding()
        _pin_word_cache(_CACHE[sha])
        del data
        release_free_heap()
    _SEEN[(str(path), st.st_size, st.st_mtime_ns, st.st_ino)] = sha
    return _CACHE[sha], sha


def planned_tokenizer_bytes(path: str | os.PathLike, expected_sha256: str | None) -> bytes:
    """The tokenizer file's bytes, refused unless their sha256 is the planned one: the copy a dataset keeps beside
    its tokens is the tokenizer they were made with (a merge may run long after, on another node)."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise UsageError(f"--tokenizer {str(path)!r}: cannot read it ({exc.strerror})") from None
    sha = hashlib.sha256(data).hexdigest()
    if not isinstance(expected_sha256, str) or not expected_sha256:  # a plan names the digest it was made with:
        raise UsageError(f"{path}: the job's plan names no tokenizer sha256; nothing is copied into the dataset "
                         "unchecked: re-run the job")  # never a file copied on a damaged plan's word
    if sha != expected_sha256:
        raise UsageError(f"{path}: the tokenizer changed since the job was planned (sha256 {sha[:12]}..., planned "
                         f"{expected_sha256[:12]}...); put the planned tokenizer back at that path to finish the job")
    return data


def _pin_word_cache(tokenizer) -> None:
    """Set a BPE model's cache of merged words to BPE_CACHE_WORDS (the same ids; other models: nothing). Each
    forked worker fills its own copy, which stops growing when full: a word it does not hold is merged again
    on every occurrence. 3,000 words (stop 38, for ~0.9 MB per worker) left 5.6% of the scale bench's word
    occurrences uncached against 0.1% with 10,000, and cost ~5% more CPU (docs/benchmarks.md, stop 69)."""
    resize = getattr(getattr(tokenizer, "model", None), "_resize_cache", None)
    if callable(resize):
        try:
            resize(BPE_CACHE_WORDS)
        except Exception:  # noqa: BLE001 - a private method of tokenizers: its absence or change costs only memory
            pass


def release_free_heap() -> None:
    """Hand the C heap's free pages back to the OS (glibc ``malloc_trim``; elsewhere nothing). Parsing a
    tokenizer.json leaves its transient (GPT-2: ~34 MB, twice the loaded tokenizer) free but resident in
    the driver, and every forked worker would map it again."""
    try:
        import ctypes

        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _config_token(folder: Path, key: str) -> str | None:
    try:
        value = json.loads((folder / "tokenizer_config.json").read_text()).get(key)
    except (OSError, ValueError, AttributeError):
        return None
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def find_special(tokenizer, explicit: str | None, config_value: str | None, candidates: tuple[str, ...]
                 ) -> tuple[str, int] | None:
    """(token, id) of an explicit token, else the config's, else the first candidate among the
    tokenizer's special tokens, then its other added tokens; never a plain vocabulary entry (a
    word piece spelled like ``</s>`` is not an end-of-text marker): None if there is none."""
    if explicit is not None:
        tid = tokenizer.token_to_id(explicit)
        if tid is None:
            raise UsageError(f"token {explicit!r} is not in the tokenizer's vocabulary")
        return explicit, tid
    if config_value is not None and tokenizer.token_to_id(config_value) is not None:
        return config_value, tokenizer.token_to_id(config_value)
    added = list(tokenizer.get_added_tokens_decoder().values())
    special = {t.content for t in added if t.special}
    for pool in (special, {t.content for t in added}):  # special added tokens first, then other added ones
        for token in candidates:
            if token in pool and tokenizer.token_to_id(token) is not None:
                return token, tokenizer.token_to_id(token)
    return None


@dataclass(frozen=True)
class TokenizerInfo:
    """The tokenizer's identity as recorded in the manifest and handed to every task."""

    path: str
    sha256: str
    vocab_size: int      # with added tokens
    max_token_id: int    # the largest id it can produce
    eos_token: str | None
    eos_id: int | None
    bos_token: str | None
    bos_id: int | None
    special_token_ids: dict  # special added tokens: {content: id}

    def to_json(self) -> dict:
        return dict(self.__dict__)


def describe_tokenizer(path: str, *, eos_token: str | None, bos_token: str | None, need_eos: bool,
                       need_bos: bool) -> TokenizerInfo:
    """Load and identify a tokenizer; fail fast when a needed EOS/BOS cannot be found."""
    file = resolve_tokenizer_path(path)
    tokenizer, sha = load_tokenizer(file)
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    eos = find_special(tokenizer, eos_token, _config_token(file.parent, "eos_token"), EOS_CANDIDATES)
    if need_eos and eos is None:
        raise UsageError(f"{file}: no end-of-document token found among its special tokens "
                         f"({', '.join(EOS_CANDIDATES[:4])}, ...); name one with --eos-token, "
                         "or pass --no-append-eos")
    bos = find_special(tokenizer, bos_token, _config_token(file.parent, "bos_token"), BOS_CANDIDATES)
    if need_bos and bos is None:
        raise UsageError(f"{file}: no beginning-of-document token found ({', '.join(BOS_CANDIDATES[:4])}, ...); "
                         "name one with --bos-token")
    specials = {t.content: tid for tid, t in sorted(tokenizer.get_added_tokens_decoder().items()) if t.special}
    max_id = max([*vocab.values(), *template_ids(tokenizer)] or [0])
    size = len(vocab)
    del vocab
    release_free_heap()  # the vocabulary dict (GPT-2: ~5 MB)
    return TokenizerInfo(str(file), sha, size, max_id,
                         eos[0] if eos else None, eos[1] if eos else None,
                         bos[0] if bos else None, bos[1] if bos else None, specials)


def template_ids(tokenizer) -> list[int]:
    """The ids a post-processor's template adds (its special tokens'), which need not be in the vocabulary: the
    token dtype must hold them too (a template's <s> of id 70000 over a vocabulary below 65536)."""
    processor = tokenizer.post_processor
    if processor is None or not hasattr(processor, "__getstate__"):
        return []
    found: list[int] = []

    def walk(node) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                if key == "ids" and isinstance(value, list):
                    found.extend(v for v in value if isinstance(v, int))
                elif key in ("sep", "cls") and isinstance(value, list) and len(value) == 2 and isinstance(value[1], int):
                    found.append(value[1])  # BertProcessing, RobertaProcessing: [token, id]
                else:
                    walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    state = processor.__getstate__()
    walk(json.loads(state) if isinstance(state, (str, bytes)) else state)
    return found


def template_adds(tokenizer, special_tokens: bool, bos_id: int | None, eos_id: int | None) -> tuple[bool, bool]:
    """Whether the tokenizer's post-processor template puts ``bos_id`` in front of / ``eos_id`` after every document
    it encodes with ``special_tokens`` (probed on one short text, with and without the template)."""
    if not special_tokens or (bos_id is None and eos_id is None):
        return False, False
    framed = tokenizer.encode("a", add_special_tokens=True).ids
    bare = tokenizer.encode("a", add_special_tokens=False).ids
    adds_bos = bos_id is not None and framed[:1] == [bos_id] and bare[:1] != [bos_id]
    adds_eos = eos_id is not None and framed[-1:] == [eos_id] and bare[-1:] != [eos_id]
    return adds_bos, adds_eos


class BatchEncoder:
    """Encodes lists of documents into lists of ids, with the job's BOS/EOS rules: each document gets one BOS in
    front and one EOS after it, the template's where it adds them, else repack's (also after a document whose
    own text ends with the EOS token, as Megatron's --append-eod does)."""

    def __init__(self, tokenizer, *, special_tokens: bool, bos_id: int | None, eos_id: int | None) -> None:
        self.tokenizer = tokenizer
        self.special_tokens = special_tokens
        adds_bos, adds_eos = template_adds(tokenizer, special_tokens, bos_id, eos_id)
        self.bos_id = None if adds_bos else bos_id  # the ids repack itself adds
        self.eos_id = None if adds_eos else eos_id
        self._fast = getattr(tokenizer, "encode_batch_fast", None) or tokenizer.encode_batch

    def _finish(self, ids: list[int]) -> list[int]:
        if not ids:  # a text the tokenizer makes nothing of is an empty document (Megatron: no EOD alone)
            return ids
        if self.bos_id is not None:
            ids.insert(0, self.bos_id)
        if self.eos_id is not None:
            ids.append(self.eos_id)
        return ids

    def encode(self, texts: list[str]) -> list[list[int] | str]:
        """Ids per document, or the error message for a document the tokenizer rejected."""
        try:
            encodings = self._fast(texts, add_special_tokens=self.special_tokens)
        except Exception:  # noqa: BLE001 - find the documents that fail, keep the rest
            out: list[list[int] | str] = []
            for text in texts:
                try:
                    out.append(self._finish(list(self._fast([text], add_special_tokens=self.special_tokens)[0].ids)))
                except Exception as exc:  # noqa: BLE001
                    out.append(f"tokenizer failed: {type(exc).__name__}: {str(exc)[:200]}")
            return out
        return [self._finish(e.ids) for e in encodings]

    def encode_arrays(self, texts: list[str]) -> tuple["np.ndarray", "np.ndarray", dict[int, str]]:
        """``encode`` as columns: (the ids of every document back to back (int64), tokens per document,
        {document number: error message} of the documents the tokenizer rejected (length 0)). BOS and
        EOS are placed with numpy, not per document in Python."""
        import numpy as np

        try:
            encodings = self._fast(texts, add_special_tokens=self.special_tokens)
        except Exception:  # noqa: BLE001 - find the documents that fail (``encode``), keep the rest
            results = self.encode(texts)
            errors = {i: r for i, r in enumerate(results) if isinstance(r, str)}
            kept = [[] if isinstance(r, str) else r for r in results]
            lengths = np.fromiter(map(len, kept), dtype=np.int64, count=len(kept))
            return np.fromiter(chain.from_iterable(kept), np.int64, int(lengths.sum())), lengths, errors
        # lengths from len(encoding) (no list built), then each document's ids list made and dropped in
        # turn: the batch's ids never exist as Python lists all at once (~36 B per token)
        lengths = np.fromiter(map(len, encodings), dtype=np.int64, count=len(encodings))
        flat = np.fromiter(chain.from_iterable(e.ids for e in encodings), dtype=np.int64, count=int(lengths.sum()))
        if self.bos_id is None and self.eos_id is None:
            return flat, lengths, {}
        return (*with_bos_eos(flat, lengths, self.bos_id, self.eos_id), {})


def with_bos_eos(flat, lengths, bos_id: int | None, eos_id: int | None):
    """(ids, lengths) of documents given back to back with ``bos_id`` put in front of each and ``eos_id`` appended
    to each (None: not added) (``BatchEncoder._finish``, vectorized). A document of no ids stays empty: Megatron
    writes no document of an EOD alone."""
    import numpy as np

    has = (lengths > 0).astype(np.int64)
    bos, eos = has * int(bos_id is not None), has * int(eos_id is not None)
    new_lengths = lengths + bos + eos
    new_ends = np.cumsum(new_lengths)
    new_starts = new_ends - new_lengths
    out = np.empty(int(new_ends[-1]) if len(new_ends) else 0, dtype=np.int64)
    shift = np.repeat(new_starts - (np.cumsum(lengths) - lengths) + bos, lengths)
    out[np.arange(len(flat)) + shift] = flat
    if bos_id is not None:
        out[new_starts[has > 0]] = bos_id
    if eos_id is not None:
        out[new_ends[has > 0] - 1] = eos_id
    return out, new_lengths
