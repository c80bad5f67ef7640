"""Vocabularies that both input paths share, with no TensorFlow at import.

Every vocabulary here follows the id convention the packers rely on: 0 is padding (never
emitted by `encode`, so a target of 0 means "no target"), 1 is end-of-sequence.

- `ByteVocabulary` ('bytes'): id = UTF-8 byte + 3 (0 pad, 1 eos, 2 unk), 259 ids. It
  encodes exactly as `seqio.ByteVocabulary` does, in pure Python/NumPy.
- `SentencePieceVocabulary`: a SentencePiece model file read with the `sentencepiece`
  package (no TF). Models must be trained with pad_id=0, eos_id=1 (T5/seqio style).

Model files are looked up by name in `vocab_dir()`: `$AXLEARN_VOCAB_DIR` if set, else
`<repo>/axlearn/data/vocab`. An absolute path is used as is.

Models pad the vocabulary up for efficient matmuls: `padded_vocab_size(259) == 384`
(the byte vocabulary's model size: the next multiple of 128).
"""

import os
from collections.abc import Sequence
from typing import Any

import numpy as np

PAD_ID = 0
EOS_ID = 1
BYTES_VOCAB_NAME = "bytes"
VOCAB_DIR_ENV = "AXLEARN_VOCAB_DIR"


class VocabularyError(ValueError):
    """A vocabulary that cannot be found or does not follow the id convention."""


def padded_vocab_size(vocab_size: int, multiple: int = 128) -> int:
    """The model's vocabulary size: `vocab_size` rounded up to a multiple of `multiple`."""
    return -(-vocab_size // multiple) * multiple


class ByteVocabulary:
    """UTF-8 bytes as tokens: id = byte + 3 (0 = pad, 1 = eos, 2 = unk)."""

    name = BYTES_VOCAB_NAME
    pad_id = PAD_ID
    eos_id = EOS_ID
    unk_id = 2
    _OFFSET = 3  # Number of special ids before the first byte.

    @property
    def vocab_size(self) -> int:
        return 256 + self._OFFSET

    def encode_bytes(self, data: bytes) -> np.ndarray:
        """Token ids (int32) of raw bytes; the fast path for files."""
        return np.frombuffer(data, dtype=np.uint8).astype(np.int32) + self._OFFSET

    def encode(self, text: str) -> list[int]:
        return self.encode_bytes(text.encode("utf-8")).tolist()

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids` up to the first eos; special ids are dropped."""
        data = bytearray()
        for i in ids:
            i = int(i)
            if i == self.eos_id:
                break
            if self._OFFSET <= i < self.vocab_size:
                data.append(i - self._OFFSET)
        return data.decode("utf-8", errors="ignore")

    def encode_tf(self, text):
        """The TensorFlow twin of `encode` (imports TF lazily)."""
        import tensorflow as tf  # pylint: disable=import-outside-toplevel

        return tf.cast(tf.io.decode_raw(text, tf.uint8), tf.int32) + self._OFFSET

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, ByteVocabulary)

    def __hash__(self) -> int:
        return hash(self.name)


class SentencePieceVocabulary:
    """A SentencePiece model read with the `sentencepiece` package (no TensorFlow)."""

    def __init__(self, model_file: str):
        import sentencepiece  # pylint: disable=import-outside-toplevel

        self.model_file = model_file
        self.name = os.path.basename(model_file)
        self._processor = sentencepiece.SentencePieceProcessor(model_file=model_file)
        check_id_convention(self, where=model_file)

    @property
    def vocab_size(self) -> int:
        return self._processor.get_piece_size()

    @property
    def pad_id(self) -> int:
        return self._processor.pad_id()

    @property
    def eos_id(self) -> int:
        return self._processor.eos_id()

    def encode(self, text: str) -> list[int]:
        return list(self._processor.encode(text))

    def decode(self, ids: Sequence[int]) -> str:
        ids = [int(i) for i in ids]
        if self.eos_id in ids:
            ids = ids[: ids.index(self.eos_id)]
        return self._processor.decode(ids)


def check_id_convention(vocab: Any, *, where: str) -> None:
    """Raises unless `vocab` has pad id 0 and eos id 1, which the packers assume."""
    if vocab.pad_id != PAD_ID or vocab.eos_id != EOS_ID:
        raise VocabularyError(
            f"{where}: vocabulary has pad_id={vocab.pad_id}, eos_id={vocab.eos_id}; expected "
            f"pad_id={PAD_ID}, eos_id={EOS_ID} (train SentencePiece with --pad_id=0 --eos_id=1 "
            "--unk_id=2 --bos_id=-1)"
        )


def vocab_dir() -> str:
    """Where model files are looked up: $AXLEARN_VOCAB_DIR, else <repo>/axlearn/data/vocab."""
    default = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data", "vocab")
    return os.environ.get(VOCAB_DIR_ENV) or default


def resolve_vocab_file(name: str) -> str:
    """The path of model file `name` (absolute paths are kept); raises if it is missing."""
    path = name if os.path.isabs(name) else os.path.join(vocab_dir(), name)
    if not os.path.isfile(path):
        directory = os.path.dirname(path)
        present = sorted(os.listdir(directory)) if os.path.isdir(directory) else []
        raise VocabularyError(
            f"Vocabulary model '{name}' not found: expected the file {path} (directory from "
            f"${VOCAB_DIR_ENV} or the default <repo>/axlearn/data/vocab; it holds: "
            f"{present or 'nothing'}); use '{BYTES_VOCAB_NAME}' for the byte vocabulary"
        )
    return path


def load_vocabulary(name: str) -> Any:
    """'bytes' -> ByteVocabulary; else the SentencePiece model file `name` (see vocab_dir())."""
    if name == BYTES_VOCAB_NAME:
        return ByteVocabulary()
    return SentencePieceVocabulary(resolve_vocab_file(name))


def vocabulary_name(vocab: Any) -> str:
    """A vocabulary's name as recorded in token shards: 'bytes' or the model file's base name."""
    name = getattr(vocab, "name", None)
    if isinstance(name, str) and name:
        return name
    model_file = getattr(vocab, "sentencepiece_model_file", None)  # seqio's vocabulary.
    if model_file:
        return os.path.basename(model_file)
    raise VocabularyError(f"Cannot tell the name of vocabulary {vocab!r}")
