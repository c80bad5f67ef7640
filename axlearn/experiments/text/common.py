"""Text building blocks shared by experiments: vocabularies.

`vocab(name)` resolves a vocabulary by name:
- 'bytes': `axlearn.common.input_vocab.ByteVocabulary` (UTF-8 byte + 3; 259 ids, which
  models pad to 384), pure Python;
- anything else: a SentencePiece model file looked up in `$AXLEARN_VOCAB_DIR`, else
  `<repo>/axlearn/data/vocab` (absolute paths are used as is), loaded as a
  `seqio.SentencePieceVocabulary` (usable by the tf.data path), or, where seqio
  (hence TensorFlow) is not installed, as the TF-free
  `axlearn.common.input_vocab.SentencePieceVocabulary`.
All of them have `encode`, `decode`, `vocab_size` and `eos_id`; ids 0 and 1 are pad and EOS.
"""

from typing import Any, Optional

from axlearn.common.config import register_configurable
from axlearn.common.input_vocab import (
    BYTES_VOCAB_NAME,
    ByteVocabulary,
    SentencePieceVocabulary,
    check_id_convention,
    resolve_vocab_file,
)


@register_configurable
def vocab(sentencepiece_model_name: str, num_extra_ids: Optional[int] = None) -> Any:
    """The vocabulary named `sentencepiece_model_name` ('bytes' or a model file name).

    `num_extra_ids`: sentinel ids appended by seqio (None: 0).
    """
    if sentencepiece_model_name == BYTES_VOCAB_NAME:
        return ByteVocabulary()
    path = resolve_vocab_file(sentencepiece_model_name)
    try:
        import seqio  # pylint: disable=import-outside-toplevel
    except ImportError:
        if num_extra_ids:
            raise ValueError(f"{path}: num_extra_ids needs seqio, which is not installed") from None
        result = SentencePieceVocabulary(path)
        check_id_convention(result, where=path)  # The tf.data path assumes pad 0, eos 1.
        return result
    result = seqio.SentencePieceVocabulary(path, extra_ids=num_extra_ids or 0)
    check_id_convention(result, where=path)
    return result
