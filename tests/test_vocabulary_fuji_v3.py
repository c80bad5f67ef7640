"""FujiV3Vocabulary on a small Llama-3-like tokenizer.json built here with `tokenizers`
(the reference for its ids)."""

import numpy as np
import pytest
import tokenizers
from tokenizers import models, pre_tokenizers

from axlearn.common.golden_text import parse_flat_text
from axlearn.common.input_vocab import VocabularyError
from axlearn.experiments.text.gpt.vocabulary_fuji_v3 import FujiV3Vocabulary

WORDS = ["[UNK]", "hello", "world", "fuji", "v3"]
SPECIALS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>",
    "<|finetune_right_pad_id|>",
]


def _tokenizer_file(tmp_path, specials=SPECIALS) -> str:
    tokenizer = tokenizers.Tokenizer(
        models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]")
    )
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens(specials)
    path = tmp_path / "Llama-3-tokenizer.json"
    tokenizer.save(str(path))
    return str(path)


def _vocab(path: str) -> FujiV3Vocabulary:
    return FujiV3Vocabulary.default_config().set(filename=path).instantiate()


def test_ids_and_special_ids_are_the_tokenizers(tmp_path):
    path = _tokenizer_file(tmp_path)
    vocab, reference = _vocab(path), tokenizers.Tokenizer.from_file(path)
    text = "hello fuji world v3 hello"
    assert vocab.encode(text) == reference.encode(text, add_special_tokens=False).ids
    specials = ("<|begin_of_text|>", "<|end_of_text|>", "<|finetune_right_pad_id|>")
    assert (vocab.bos_id, vocab.eos_id, vocab.pad_id) == tuple(
        reference.token_to_id(t) for t in specials
    )
    assert vocab.vocab_size == len(WORDS) + len(SPECIALS)
    ids = vocab.encode("hello world") + [vocab.eos_id] + vocab.encode("fuji")
    assert vocab.decode(ids) == "hello world"  # Up to the first eos.
    np.testing.assert_array_equal(vocab.encode_array("fuji v3"), [3, 4])


def test_config_text_of_axlearn_builds_it(tmp_path):
    path = _tokenizer_file(tmp_path)
    klass = "axlearn.experiments.text.gpt.vocabulary_fuji_v3.FujiV3Vocabulary"
    text = f"filename: {path!r}\nklass: {klass!r}"
    assert parse_flat_text(text).instantiate().eos_id == len(WORDS) + 1


def test_a_tokenizer_without_a_pad_token_is_refused(tmp_path):
    path = _tokenizer_file(tmp_path, specials=SPECIALS[:2])
    with pytest.raises(VocabularyError, match="has none of the pad tokens"):
        _vocab(path)


@pytest.mark.slow  # Imports TensorFlow.
def test_encode_tf_gives_the_ids_of_encode(tmp_path):
    tf = pytest.importorskip("tensorflow")
    vocab = _vocab(_tokenizer_file(tmp_path))
    ids = tf.function(vocab.encode_tf)(tf.constant("world hello v3"))
    assert ids.numpy().tolist() == vocab.encode("world hello v3")
