"""Vocabularies that both input paths share, with no TensorFlow at import.

One interface (`Vocabulary`): `encode`, `decode`, `vocab_size`, `eos_id`, `bos_id`,
`pad_id` (-1: the vocabulary has none), `kind`, `name` and `file_sha256` (of the model
file; '' for bytes). Three kinds:

- 'bytes' (`ByteVocabulary`): id = UTF-8 byte + 3 (0 pad, 1 eos, 2 unk), 259 ids. It
  encodes exactly as `seqio.ByteVocabulary` does, in pure Python/NumPy.
- 'sentencepiece' (`SentencePieceVocabulary`): a SentencePiece `.model` file, read with
  the `sentencepiece` package; its special ids are the model's own (`eos_id()`, ...).
- 'huggingface' (`HuggingFaceVocabulary`): a Hugging Face `tokenizer.json`, read with
  the `tokenizers` package. Its eos/bos/pad tokens come from, in order: an explicit
  token, the `tokenizer_config.json` beside it, the post-processor's template, then
  the usual special-token names ('</s>', '<|endoftext|>', ...).

Token shards record their vocabulary's eos id, so they take any special ids. The tf.data
path and `input_packing.pack_documents` assume pad 0 and eos 1 (T5/seqio style):
`load_vocabulary` checks that convention unless asked for `any_special_ids`.

Model files are looked up by name: an absolute path, or a relative one that exists, is
used as is; other names are looked up in `vocab_dir()`: `$AXLEARN_VOCAB_DIR` if set,
else `<repo>/axlearn/data/vocab`.

Models pad the vocabulary up for efficient matmuls: `padded_vocab_size(259) == 384`
(the byte vocabulary's model size: the next multiple of 128).
"""

import hashlib
import importlib
import json
import os
from collections.abc import Sequence
from typing import Any, Optional

import numpy as np

from axlearn.common.config import register_validator

PAD_ID = 0
EOS_ID = 1
NO_ID = -1  # A special token the vocabulary does not have.
BYTES_VOCAB_NAME = "bytes"
VOCAB_DIR_ENV = "AXLEARN_VOCAB_DIR"
HF_TOKENIZER_FILE = "tokenizer.json"  # The file a Hugging Face model directory holds.
_HF_TOKENIZER_CONFIG = "tokenizer_config.json"  # Names eos/bos/pad tokens, when present.
# Special-token names recognized when nothing else says which token ends a document.
_EOS_NAMES = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "<|eos|>", "[EOS]")
_BOS_NAMES = ("<s>", "<|begin_of_text|>", "<bos>", "<|bos|>", "<|startoftext|>", "[BOS]")


class VocabularyError(ValueError):
    """A vocabulary that cannot be found, read, or does not follow the id convention."""


def padded_vocab_size(vocab_size: int, multiple: int = 128) -> int:
    """The model's vocabulary size: `vocab_size` rounded up to a multiple of `multiple`."""
    return -(-vocab_size // multiple) * multiple


def require_package(
    module: str, *, needed_by: str, error: type[Exception] = VocabularyError
) -> Any:
    """`module` imported, or `error`: "<needed_by> needs the '<module>' package" and how to
    install it (the data extra). The inputs' one check for an optional package."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise error(
            f"{needed_by} needs the '{module}' package: pip install 'axlearn[data]'"
        ) from None


def file_sha256(path: str) -> str:
    """Hex SHA-256 of a file's bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


class Vocabulary:
    """The interface every vocabulary here implements (attributes set by subclasses)."""

    kind: str  # 'bytes', 'sentencepiece' or 'huggingface'.
    name: str  # 'bytes' or the model file's base name; shards record it.
    file_sha256: str = ""  # Of the model file; '' for bytes.
    eos_id: int  # Ends every document in token shards.
    bos_id: int = NO_ID
    pad_id: int = NO_ID

    @property
    def vocab_size(self) -> int:
        """Number of ids: every id `encode` returns is below it."""
        raise NotImplementedError(type(self))

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, no special tokens added."""
        raise NotImplementedError(type(self))

    def encode_array(self, text: str) -> np.ndarray:
        """`encode` as an int32 array (byte vocabularies override it with a fast path)."""
        return np.asarray(self.encode(text), dtype=np.int32)

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids` up to the first eos."""
        raise NotImplementedError(type(self))

    def _ids_before_eos(self, ids: Sequence[int]) -> list[int]:
        ids = [int(i) for i in ids]
        return ids[: ids.index(self.eos_id)] if self.eos_id in ids else ids


# A vocabulary object may be a config field's value (an input's `vocab_cfg`), as AXLearn
# lets seqio vocabularies be: it is read, never copied into golden text as data.
register_validator(match_fn=lambda value: isinstance(value, Vocabulary), validate_fn=lambda _: None)


class ByteVocabulary(Vocabulary):
    """UTF-8 bytes as tokens: id = byte + 3 (0 = pad, 1 = eos, 2 = unk)."""

    kind = "bytes"
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

    def encode_array(self, text: str) -> np.ndarray:
        return self.encode_bytes(text.encode("utf-8"))

    def encode(self, text: str) -> list[int]:
        return self.encode_array(text).tolist()

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids` up to the first eos; special ids are dropped."""
        data = bytearray()
        for i in self._ids_before_eos(ids):
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


class SentencePieceVocabulary(Vocabulary):
    """A SentencePiece model read with the `sentencepiece` package (no TensorFlow).

    Special ids are the model's (`eos_id()`, `bos_id()`, `pad_id()`; -1 for none);
    `eos_token` names another piece to end documents with, e.g. for a model without eos.
    """

    kind = "sentencepiece"

    def __init__(self, model_file: str, *, eos_token: Optional[str] = None):
        sentencepiece = require_package("sentencepiece", needed_by=f"{model_file}: a SentencePiece model")
        self.model_file = model_file
        self.name = os.path.basename(model_file)
        self._eos_token = eos_token
        try:
            self._processor = sentencepiece.SentencePieceProcessor(model_file=model_file)
        except (RuntimeError, OSError) as e:
            raise VocabularyError(
                f"{model_file}: not a SentencePiece model ({_first_line(e)}); a vocabulary is "
                f"'{BYTES_VOCAB_NAME}', a SentencePiece .model or a Hugging Face "
                f"{HF_TOKENIZER_FILE}"
            ) from None
        self.file_sha256 = file_sha256(model_file)
        self.bos_id = self._processor.bos_id()
        self.pad_id = self._processor.pad_id()
        if eos_token is None:
            self.eos_id = self._processor.eos_id()
        else:
            self.eos_id = self._processor.piece_to_id(eos_token)
            if self._processor.id_to_piece(self.eos_id) != eos_token:
                raise VocabularyError(f"{model_file}: eos token {eos_token!r} is not a piece")
        if self.eos_id == NO_ID:
            raise VocabularyError(
                f"{model_file}: the model has no eos piece (eos_id=-1); name the piece that "
                "ends a document with --eos_token"
            )

    def __reduce__(self):  # Worker processes reload the model from its file.
        return (_load_sentencepiece, (self.model_file, self._eos_token))

    @property
    def vocab_size(self) -> int:
        return self._processor.get_piece_size()

    def encode(self, text: str) -> list[int]:
        return list(self._processor.encode(text))

    def decode(self, ids: Sequence[int]) -> str:
        return self._processor.decode(self._ids_before_eos(ids))


def _load_sentencepiece(model_file: str, eos_token: Optional[str]) -> SentencePieceVocabulary:
    return SentencePieceVocabulary(model_file, eos_token=eos_token)


class HuggingFaceVocabulary(Vocabulary):
    """A Hugging Face `tokenizer.json` read with the `tokenizers` package.

    `encode` adds no special tokens. eos/bos are `eos_token`/`bos_token` if given, else
    found as the module docstring says; a tokenizer whose eos cannot be found is refused.
    """

    kind = "huggingface"

    def __init__(
        self,
        tokenizer_file: str,
        *,
        eos_token: Optional[str] = None,
        bos_token: Optional[str] = None,
    ):
        tokenizers = require_package("tokenizers", needed_by=f"{tokenizer_file}: a Hugging Face tokenizer")
        self.model_file = tokenizer_file
        self.name = os.path.basename(tokenizer_file)
        self._tokens = (eos_token, bos_token)
        try:
            self._tokenizer = tokenizers.Tokenizer.from_file(tokenizer_file)
            with open(tokenizer_file, encoding="utf-8") as f:
                spec = json.load(f)
        except Exception as e:  # pylint: disable=broad-except
            raise VocabularyError(
                f"{tokenizer_file}: not a Hugging Face tokenizer file ({_first_line(e)})"
            ) from None
        self.file_sha256 = file_sha256(tokenizer_file)
        self._vocab = self._tokenizer.get_vocab(with_added_tokens=True)
        config = _tokenizer_config(os.path.dirname(tokenizer_file))
        template = _template_special_tokens(spec.get("post_processor"))
        specials = [t.content for t in self._tokenizer.get_added_tokens_decoder().values()]
        specials = [t for t in specials if t in self._vocab]
        self.eos_id = self._special_id(
            "eos", eos_token, config.get("eos_token"), template[1], specials, _EOS_NAMES
        )
        if self.eos_id == NO_ID:
            raise VocabularyError(
                f"{tokenizer_file}: cannot tell which token ends a document (special tokens: "
                f"{specials or 'none'}); pass it with --eos_token=TOKEN"
            )
        self.bos_id = self._special_id(
            "bos", bos_token, config.get("bos_token"), template[0], specials, _BOS_NAMES
        )
        padding = self._tokenizer.padding or {}
        self.pad_id = self._special_id("pad", None, config.get("pad_token"), None, [], ())
        if self.pad_id == NO_ID and "pad_id" in padding:
            self.pad_id = int(padding["pad_id"])

    def __reduce__(self):  # Worker processes reload the tokenizer from its file.
        return (_load_huggingface, (self.model_file, *self._tokens))

    def _special_id(
        self,
        role: str,
        explicit: Optional[str],
        configured: Optional[str],
        from_template: Optional[str],
        specials: list[str],
        usual_names: Sequence[str],
    ) -> int:
        """The id of the `role` token, from the first source that names one."""
        if explicit is not None:
            if explicit not in self._vocab:
                raise VocabularyError(
                    f"{self.model_file}: {role} token {explicit!r} is not in the vocabulary"
                )
            return self._vocab[explicit]
        for token in (configured, from_template):
            if token is not None and token in self._vocab:
                return self._vocab[token]
        candidates = [t for t in specials if t in usual_names]
        if len(candidates) > 1:
            raise VocabularyError(
                f"{self.model_file}: several special tokens could be the {role} token "
                f"({candidates}); pass one with --{role}_token=TOKEN"
            )
        return self._vocab[candidates[0]] if candidates else NO_ID

    @property
    def vocab_size(self) -> int:
        return max(self._vocab.values()) + 1

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """(ids, the (start, end) characters of `text` behind each), as `encode`."""
        encoding = self._tokenizer.encode(text, add_special_tokens=False)
        return encoding.ids, encoding.offsets

    def decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(self._ids_before_eos(ids), skip_special_tokens=True)


def _load_huggingface(
    tokenizer_file: str, eos_token: Optional[str], bos_token: Optional[str]
) -> HuggingFaceVocabulary:
    return HuggingFaceVocabulary(tokenizer_file, eos_token=eos_token, bos_token=bos_token)


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__


def _tokenizer_config(directory: str) -> dict[str, Optional[str]]:
    """eos/bos/pad token names from a Hugging Face `tokenizer_config.json`, if there is one."""
    path = os.path.join(directory, _HF_TOKENIZER_CONFIG)
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise VocabularyError(f"{path}: unreadable tokenizer config ({_first_line(e)})") from None
    result = {}
    for key in ("eos_token", "bos_token", "pad_token"):
        value = config.get(key)
        if isinstance(value, dict):  # Serialized AddedToken.
            value = value.get("content")
        result[key] = value if isinstance(value, str) else None
    return result


def _template_special_tokens(processor: Optional[dict]) -> tuple[Optional[str], Optional[str]]:
    """(bos, eos): special tokens a post-processor puts before / after a single sequence."""
    if not isinstance(processor, dict):
        return None, None
    kind = processor.get("type")
    if kind == "Sequence":
        found = [_template_special_tokens(p) for p in processor.get("processors", [])]
        bos = next((b for b, _ in found if b is not None), None)
        eos = next((e for _, e in found if e is not None), None)
        return bos, eos
    if kind in ("BertProcessing", "RobertaProcessing"):
        return processor["cls"][0], processor["sep"][0]
    if kind == "TemplateProcessing":
        items = processor.get("single") or []

        def special(item: dict) -> Optional[str]:
            return item.get("SpecialToken", {}).get("id") if isinstance(item, dict) else None

        return (special(items[0]), special(items[-1])) if items else (None, None)
    return None, None


def check_id_convention(vocab: Any, *, where: str) -> None:
    """Raises unless `vocab` has pad id 0 and eos id 1, which the tf.data path assumes."""
    if vocab.pad_id != PAD_ID or vocab.eos_id != EOS_ID:
        raise VocabularyError(
            f"{where}: vocabulary has pad_id={vocab.pad_id}, eos_id={vocab.eos_id}; expected "
            f"pad_id={PAD_ID}, eos_id={EOS_ID} (train SentencePiece with --pad_id=0 --eos_id=1 "
            "--unk_id=2 --bos_id=-1); token shards take any ids"
        )


def vocab_dir() -> str:
    """Where model files are looked up: $AXLEARN_VOCAB_DIR, else <repo>/axlearn/data/vocab."""
    default = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data", "vocab")
    return os.environ.get(VOCAB_DIR_ENV) or default


def resolve_vocab_file(name: str) -> str:
    """The path of model file `name`: as is if absolute or present, else in vocab_dir().

    A directory stands for the Hugging Face `tokenizer.json` inside it.
    """
    if os.path.isabs(name) or os.path.exists(name):
        path = name
    else:
        path = os.path.join(vocab_dir(), name)
    if os.path.isdir(path):
        path = os.path.join(path, HF_TOKENIZER_FILE)
    if not os.path.isfile(path):
        directory = os.path.dirname(path)
        present = sorted(os.listdir(directory)) if os.path.isdir(directory) else []
        raise VocabularyError(
            f"Vocabulary model '{name}' not found: expected the file {path} (directory from "
            f"${VOCAB_DIR_ENV} or the default <repo>/axlearn/data/vocab; it holds: "
            f"{present or 'nothing'}); use '{BYTES_VOCAB_NAME}' for the byte vocabulary"
        )
    return path


def load_vocabulary(
    name: str,
    *,
    any_special_ids: bool = False,
    eos_token: Optional[str] = None,
    bos_token: Optional[str] = None,
) -> Vocabulary:
    """The vocabulary `name`: 'bytes', a SentencePiece model, or a Hugging Face tokenizer.

    A name ending in '.json' (or a directory holding tokenizer.json) is a Hugging Face
    tokenizer; any other is a SentencePiece model. Unless `any_special_ids`, a vocabulary
    without pad 0 / eos 1 is refused (see `check_id_convention`). `eos_token`/`bos_token`
    name the special tokens explicitly (`bos_token`: Hugging Face only).
    """
    if name == BYTES_VOCAB_NAME:
        if eos_token is not None or bos_token is not None:
            raise VocabularyError("The byte vocabulary's special ids are fixed: no --eos_token")
        return ByteVocabulary()
    path = resolve_vocab_file(name)
    if path.endswith(".json"):
        vocab = HuggingFaceVocabulary(path, eos_token=eos_token, bos_token=bos_token)
    elif bos_token is not None:
        raise VocabularyError(f"{path}: --bos_token applies to Hugging Face tokenizers only")
    else:
        vocab = SentencePieceVocabulary(path, eos_token=eos_token)
    if not any_special_ids:
        check_id_convention(vocab, where=path)
    return vocab


def vocabulary_name(vocab: Any) -> str:
    """A vocabulary's name as recorded in token shards: 'bytes' or the model file's base name."""
    name = getattr(vocab, "name", None)
    if isinstance(name, str) and name:
        return name
    model_file = getattr(vocab, "sentencepiece_model_file", None)  # seqio's vocabulary.
    if model_file:
        return os.path.basename(model_file)
    raise VocabularyError(f"Cannot tell the name of vocabulary {vocab!r}")
