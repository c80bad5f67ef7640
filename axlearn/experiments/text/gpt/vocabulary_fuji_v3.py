"""The Fuji v3 vocabulary: Llama 3's tokenizer (a Hugging Face `tokenizer.json`, 128,256
ids), read with the `tokenizers` library, as AXLearn's Fuji v3 configs name it
(`vocab_cfg.klass: '...vocabulary_fuji_v3.FujiV3Vocabulary'`, `filename:
'Llama-3-tokenizer.json'`).

Documents end with `<|end_of_text|>` (eos, 128001 in Llama 3), start with
`<|begin_of_text|>` (bos) where a caller adds it, and pad with
`<|finetune_right_pad_id|>` (128004; older Llama 3 files call that id
`<|reserved_special_token_2|>`). `encode` adds no special tokens.
"""

from collections.abc import Sequence

import numpy as np

from axlearn.common.config import REQUIRED, Configurable, Required, config_class
from axlearn.common.input_vocab import (
    HuggingFaceVocabulary,
    VocabularyError,
    resolve_vocab_file,
)

EOS_TOKEN = "<|end_of_text|>"
BOS_TOKEN = "<|begin_of_text|>"
PAD_TOKENS = ("<|finetune_right_pad_id|>", "<|reserved_special_token_2|>")


class FujiV3Vocabulary(Configurable):
    """Llama 3's tokenizer with its special ids (see the module docstring)."""

    @config_class
    class Config(Configurable.Config):
        """Configures FujiV3Vocabulary."""

        # A tokenizer.json: an absolute path, or a name in input_vocab.vocab_dir()
        # ($AXLEARN_VOCAB_DIR, else <repo>/axlearn/data/vocab).
        filename: Required[str] = REQUIRED

    def __init__(self, cfg: Config):
        super().__init__(cfg)
        path = resolve_vocab_file(cfg.filename)
        self._vocab = HuggingFaceVocabulary(path, eos_token=EOS_TOKEN, bos_token=BOS_TOKEN)
        import tokenizers  # pylint: disable=import-outside-toplevel  # The `data` extra.

        tokenizer = tokenizers.Tokenizer.from_file(path)
        pads = [tokenizer.token_to_id(token) for token in PAD_TOKENS]
        pads = [i for i in pads if i is not None]
        if not pads:
            raise VocabularyError(f"{path}: has none of the pad tokens {PAD_TOKENS}")
        self.pad_id = pads[0]
        self.eos_id = self._vocab.eos_id
        self.bos_id = self._vocab.bos_id
        self.name = self._vocab.name
        self.file_sha256 = self._vocab.file_sha256

    @property
    def vocab_size(self) -> int:
        return self._vocab.vocab_size

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, no special tokens added."""
        return self._vocab.encode(text)

    def encode_array(self, text: str) -> np.ndarray:
        return np.asarray(self.encode(text), dtype=np.int32)

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids` up to the first eos, special tokens dropped."""
        return self._vocab.decode(ids)

    def encode_tf(self, text):
        """`encode` of a scalar tf.string, for the tf.data path (imports TF lazily)."""
        import tensorflow as tf  # pylint: disable=import-outside-toplevel

        def encode(t):
            return self.encode_array(t.numpy().decode("utf-8"))

        ids = tf.py_function(encode, [text], tf.int32)
        ids.set_shape([None])
        return ids
