"""Megatron's indexed dataset format: a `.bin` of token ids and the `.idx` that cuts it into documents.

This is the format Megatron-LM, Megatron-Core and NeMo read and write (`megatron/core/datasets/
indexed_dataset.py`). A dataset is a path prefix P with two files:

    P.bin   the token ids of every sequence, back to back, in the index's dtype (little-endian)
    P.idx   b"MMIDIDX\\x00\\x00"  (9 bytes)
            version            uint64 = 1
            dtype code         uint8   (1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16)
            sequence count S   uint64
            document count D   uint64  (the number of documents + 1)
            sequence lengths   int32[S]   tokens per sequence
            sequence pointers  int64[S]   byte offset of each sequence in P.bin
            document indices   int64[D]   the first sequence of each document, then S

Our writer puts one document in one sequence, its EOS included (Megatron's `--append-eod`). A reader
accepts several sequences per document (Megatron's sentence splitting) as long as they lie back to back.

Every index read here is untrusted: `parse_index` refuses a header, version, dtype, count or offset that
does not describe a whole `.bin` and says which, and `check_bin_size` holds it against the data file.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

HEADER = b"MMIDIDX\x00\x00"
VERSION = 1
_PREAMBLE = len(HEADER) + 8 + 1 + 8 + 8  # header, version, dtype code, sequence count, document count

DTYPE_CODES: dict[int, str] = {
    1: "uint8", 2: "int8", 3: "int16", 4: "int32", 5: "int64", 6: "float64", 7: "float32", 8: "uint16",
}  # fmt: skip
TOKEN_DTYPES = ("uint8", "uint16", "int16", "int32", "int64")
"""The dtypes a token file may have: Megatron's integer ones (it writes uint16 below 65500 ids, else int32)."""
WRITE_DTYPES = ("uint16", "int32")
"""The dtypes our writer uses, as Megatron's `DType.optimal_dtype` picks them."""


class IndexFormatError(ValueError):
    """The `.idx` (or its `.bin`) does not follow the format; `problem` says where."""

    def __init__(self, problem: str) -> None:
        super().__init__(problem)
        self.problem = problem


def dtype_code(dtype: str) -> int:
    """Megatron's code of a numpy dtype name."""
    return {name: code for code, name in DTYPE_CODES.items()}[dtype]


def index_size(n_sequences: int, n_documents: int) -> int:
    """Bytes of an index of `n_sequences` sequences and `n_documents` documents."""
    return _PREAMBLE + n_sequences * 12 + (n_documents + 1) * 8


def encode_index(dtype: str, sequence_lengths: np.ndarray, document_indices: np.ndarray) -> bytes:
    """The `.idx` bytes of sequences of `sequence_lengths` tokens stored back to back, cut at `document_indices`
    (the first sequence of each document, then the sequence count)."""
    lengths = np.asarray(sequence_lengths, dtype="<i4")
    docs = np.asarray(document_indices, dtype="<i8")
    itemsize = np.dtype(dtype).itemsize
    pointers = np.zeros(lengths.size, dtype="<i8")
    if lengths.size > 1:
        np.cumsum(lengths[:-1].astype(np.int64) * itemsize, out=pointers[1:])
    head = HEADER + struct.pack("<QBQQ", VERSION, dtype_code(dtype), lengths.size, docs.size)
    return head + lengths.tobytes() + pointers.tobytes() + docs.tobytes()


@dataclass(frozen=True)
class MegatronIndex:
    """A parsed and checked `.idx`."""

    dtype: str
    sequence_lengths: np.ndarray
    sequence_pointers: np.ndarray
    document_indices: np.ndarray

    @property
    def n_sequences(self) -> int:
        """Sequences in the index."""
        return int(self.sequence_lengths.size)

    @property
    def n_documents(self) -> int:
        """Documents in the index."""
        return int(self.document_indices.size) - 1

    @property
    def n_tokens(self) -> int:
        """Tokens of every sequence: the `.bin` holds exactly these."""
        return int(self.sequence_lengths.sum(dtype=np.int64))

    def document_offsets(self) -> np.ndarray:
        """Token offset of each document's start in the `.bin`, then the token count (n_documents + 1 entries)."""
        starts = np.concatenate(([0], np.cumsum(self.sequence_lengths, dtype=np.int64)))
        return starts[self.document_indices]


def parse_index(raw: bytes) -> MegatronIndex:
    """The index in `raw`, or IndexFormatError naming the first thing that is wrong."""
    if len(raw) < _PREAMBLE:
        raise IndexFormatError(f"has {len(raw)} bytes, fewer than the {_PREAMBLE}-byte header (truncated?)")
    if raw[: len(HEADER)] != HEADER:
        raise IndexFormatError(
            f"starts with {raw[: len(HEADER)]!r}, not Megatron's {HEADER!r} (not a Megatron index; an old "
            "tdeploy index is converted by `tdeploy convert-dataset`)"
        )
    version, code, n_seq, n_doc = struct.unpack_from("<QBQQ", raw, len(HEADER))
    if version != VERSION:
        raise IndexFormatError(f"has version {version}; Megatron's format is version {VERSION}")
    dtype = DTYPE_CODES.get(code)
    if dtype not in TOKEN_DTYPES:
        raise IndexFormatError(f"has dtype code {code} ({dtype or 'unknown'}); token ids need one of {TOKEN_DTYPES}")
    if n_doc < 1:
        raise IndexFormatError("has a document count of 0 (it counts the documents + 1)")
    expected = index_size(n_seq, n_doc - 1)
    if len(raw) != expected:
        cut = ", truncated" if len(raw) < expected else ""
        raise IndexFormatError(
            f"has {len(raw)} bytes, its counts ({n_seq} sequences, {n_doc - 1} documents) need {expected}{cut}"
        )
    lengths = np.frombuffer(raw, dtype="<i4", count=n_seq, offset=_PREAMBLE)
    pointers = np.frombuffer(raw, dtype="<i8", count=n_seq, offset=_PREAMBLE + 4 * n_seq)
    docs = np.frombuffer(raw, dtype="<i8", count=n_doc, offset=_PREAMBLE + 12 * n_seq)
    if n_seq and int(lengths.min()) < 0:
        at = int(np.argmin(lengths))
        raise IndexFormatError(f"sequence {at} has length {int(lengths[at])}")
    itemsize = np.dtype(dtype).itemsize
    expected_pointers = np.concatenate(([0], np.cumsum(lengths[:-1], dtype=np.int64) * itemsize)) if n_seq else pointers
    if n_seq and not np.array_equal(pointers, expected_pointers):
        at = int(np.flatnonzero(pointers != expected_pointers)[0])
        raise IndexFormatError(
            f"sequence {at} starts at byte {int(pointers[at])}, not {int(expected_pointers[at])}: the sequences do "
            "not lie back to back in the .bin"
        )
    if int(docs[0]) != 0:
        raise IndexFormatError(f"its document indices start at {int(docs[0])}, not 0")
    if n_doc > 1 and bool(np.any(np.diff(docs) < 0)):
        at = int(np.flatnonzero(np.diff(docs) < 0)[0]) + 1
        raise IndexFormatError(f"document index {at} ({int(docs[at])}) is below the one before it")
    if int(docs[-1]) != n_seq:
        raise IndexFormatError(f"its last document index is {int(docs[-1])}, not the sequence count {n_seq}")
    return MegatronIndex(dtype, lengths, pointers, docs)


def check_bin_size(index: MegatronIndex, bin_bytes: int) -> None:
    """IndexFormatError unless the `.bin` holds exactly the tokens the index counts."""
    itemsize = np.dtype(index.dtype).itemsize
    expected = index.n_tokens * itemsize
    if bin_bytes != expected:
        cut = ", truncated" if bin_bytes < expected else ""
        raise IndexFormatError(
            f"counts {index.n_tokens} tokens of {index.dtype} ({expected} bytes), the .bin has {bin_bytes} bytes{cut}"
        )
