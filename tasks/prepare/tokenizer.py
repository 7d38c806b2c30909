"""Tokenizers: byte-level BPE (HF `tokenizers`), trained here or loaded from any URL, or plain bytes."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import fsspec
import numpy as np

from tasks.errors import UserError
from tasks.prepare.config import TokenizerConfig
from tasks.prepare.encoding import Encoder, encode_texts
from training.dataset import TokenizerInfo, token_dtype
from training.storage import StorageConfig

BYTE_EOS = 256
TOKENIZER_FILE = "tokenizer.json"


class TextTokenizer:
    """Encodes batches of text to id arrays; knows its vocabulary, EOS id and identity."""

    def __init__(self, kind: str, json_text: str | None = None) -> None:
        self.kind, self.json_text = kind, json_text
        if kind == "bytes":
            self.vocab_size, self.eos_id, self._hf = BYTE_EOS + 1, BYTE_EOS, None
        else:
            from tokenizers import Tokenizer

            self._hf = Tokenizer.from_str(json_text)
            self.vocab_size = self._hf.get_vocab_size()
            self.eos_id = None

    def with_eos(self, eos_token: str) -> TextTokenizer:
        """Resolve the EOS id of a BPE tokenizer (it must know the token)."""
        if self._hf is not None:
            eos = self._hf.token_to_id(eos_token)
            if eos is None:
                raise UserError(
                    f"data.prepare.tokenizer.eos_token={eos_token}: not in the tokenizer's vocabulary",
                    "set eos_token to the tokenizer's end-of-text token",
                )
            self.eos_id = eos
        return self

    @property
    def sha256(self) -> str | None:
        """sha256 of tokenizer.json (None for bytes)."""
        return hashlib.sha256(self.json_text.encode()).hexdigest() if self.json_text else None

    def info(self) -> TokenizerInfo:
        """What the dataset manifest records."""
        return TokenizerInfo(kind=self.kind, sha256=self.sha256, path=TOKENIZER_FILE if self.json_text else None)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """Ids of each text (no EOS; the dataset writer adds it)."""
        return encode_texts(self._hf, texts, token_dtype(self.vocab_size)).documents()

    def encoder(self, workers: int, dtype: str) -> Encoder:
        """Encodes batches on `workers` threads into ids of `dtype` (see tasks/prepare/encoding.py)."""
        return Encoder(self._hf, dtype, workers)


def train_bpe(texts: Iterable[str], cfg: TokenizerConfig) -> TextTokenizer:
    """Train a byte-level BPE of cfg.vocab_size on `texts`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=cfg.vocab_size,
        min_frequency=cfg.min_frequency,
        special_tokens=[cfg.eos_token],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    if tokenizer.get_vocab_size() < cfg.vocab_size:
        raise UserError(
            f"data.prepare.tokenizer.vocab_size={cfg.vocab_size}: the training split only supports "
            f"{tokenizer.get_vocab_size()} tokens",
            f"use vocab_size <= {tokenizer.get_vocab_size()} or a larger corpus",
        )
    return TextTokenizer("bpe", tokenizer.to_str()).with_eos(cfg.eos_token)


def read_tokenizer(url: str, storage: StorageConfig, where: str) -> TextTokenizer:
    """A tokenizer.json from any fsspec URL, parsed (its EOS not resolved); a UserError naming `where`."""
    fix = "point it at a tokenizer.json written by the tokenizers library (Tokenizer.save, or a model's tokenizer.json)"
    try:
        with fsspec.open(url, "r", encoding="utf-8", **storage.fsspec_options(url)) as handle:
            text = handle.read()
    except FileNotFoundError as err:
        raise UserError(f"{where}={url}: no such file", fix) from err
    except (UnicodeDecodeError, IsADirectoryError) as err:
        raise UserError(f"{where}={url}: not a tokenizers JSON file ({err})", fix) from err
    try:
        return TextTokenizer("bpe", text)
    except Exception as err:
        raise UserError(f"{where}={url}: not a tokenizers JSON file ({err})", fix) from err


def load_tokenizer(url: str, cfg: TokenizerConfig, storage: StorageConfig) -> TextTokenizer:
    """A tokenizer.json from any fsspec URL, its EOS resolved from cfg.eos_token."""
    return read_tokenizer(url, storage, "data.prepare.tokenizer.path").with_eos(cfg.eos_token)
