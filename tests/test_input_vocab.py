"""Specification of the vocabularies: axlearn.common.input_vocab and experiments.text.common."""

import io

import pytest

from axlearn.common.input_base import InputError
from axlearn.common.input_vocab import (
    ByteVocabulary,
    SentencePieceVocabulary,
    VocabularyError,
    load_vocabulary,
    padded_vocab_size,
    require_package,
    vocabulary_name,
)
from axlearn.experiments.text.common import vocab

SAMPLES = ["", "hello", "héllo wörld\n", "日本語のテキスト", "emoji 🙂, tabs\t", "\x00\x7f"]


def _train_spm(path, **ids):
    import sentencepiece  # pylint: disable=import-outside-toplevel

    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(["the quick brown fox", "jumps over the lazy dog", "hi"] * 20),
        model_writer=model,
        vocab_size=40,
        hard_vocab_limit=False,
        minloglevel=2,
        **ids,
    )
    path.write_bytes(model.getvalue())
    return path


T5_IDS = dict(pad_id=0, eos_id=1, unk_id=2, bos_id=-1)


def test_byte_vocabulary_encodes_like_seqio():
    seqio = pytest.importorskip("seqio")
    reference = seqio.ByteVocabulary()
    ours = ByteVocabulary()
    assert (ours.vocab_size, ours.eos_id, ours.pad_id) == (
        reference.vocab_size,
        reference.eos_id,
        reference.pad_id,
    )
    for text in SAMPLES:
        assert ours.encode(text) == list(reference.encode(text))


def test_byte_vocabulary_ids_are_bytes_plus_three():
    assert ByteVocabulary().encode("aé") == [ord("a") + 3, 0xC3 + 3, 0xA9 + 3]


def test_byte_vocabulary_decodes_up_to_eos():
    vocabulary = ByteVocabulary()
    for text in SAMPLES:
        assert vocabulary.decode(vocabulary.encode(text)) == text
    assert vocabulary.decode(vocabulary.encode("ab") + [1] + vocabulary.encode("cd")) == "ab"


def test_byte_vocabulary_tf_encoding_matches_python():
    tf = pytest.importorskip("tensorflow")
    vocabulary = ByteVocabulary()
    for text in SAMPLES:
        assert vocabulary.encode_tf(tf.constant(text)).numpy().tolist() == vocabulary.encode(text)


def test_model_vocabulary_is_padded_to_a_multiple_of_128():
    assert padded_vocab_size(259) == 384
    assert padded_vocab_size(256) == 256
    assert padded_vocab_size(32000) == 32000 and padded_vocab_size(50257) == 50304


def test_bytes_name_gives_the_byte_vocabulary():
    assert isinstance(vocab("bytes"), ByteVocabulary)
    assert vocabulary_name(vocab("bytes")) == "bytes"


def test_missing_model_names_the_directory_and_variable(tmp_path, monkeypatch):
    monkeypatch.setenv("AXLEARN_VOCAB_DIR", str(tmp_path))
    message = r"'bpe_48k.model' not found: expected the file .*bpe_48k.model .*AXLEARN_VOCAB_DIR"
    with pytest.raises(VocabularyError, match=message):
        vocab("bpe_48k.model")


def test_sentencepiece_model_is_found_in_the_vocab_dir(tmp_path, monkeypatch):
    import sentencepiece  # pylint: disable=import-outside-toplevel

    path = _train_spm(tmp_path / "tiny.model", **T5_IDS)
    monkeypatch.setenv("AXLEARN_VOCAB_DIR", str(tmp_path))
    loaded = vocab("tiny.model")
    reference = sentencepiece.SentencePieceProcessor(model_file=str(path))
    text = "the lazy fox says hello"
    assert list(loaded.encode(text)) == reference.encode(text)
    assert vocabulary_name(loaded) == "tiny.model"
    assert loaded.eos_id == 1


def test_tf_free_sentencepiece_matches_seqio(tmp_path):
    seqio = pytest.importorskip("seqio")
    path = _train_spm(tmp_path / "tiny.model", **T5_IDS)
    ours, reference = load_vocabulary(str(path)), seqio.SentencePieceVocabulary(str(path))
    assert isinstance(ours, SentencePieceVocabulary)
    assert ours.vocab_size == reference.vocab_size
    for text in ["the quick dog", "hello world again", ""]:
        ids = ours.encode(text)
        assert ids == list(reference.encode(text))
        assert ours.decode(ids) == reference.decode(ids)


def test_model_with_other_special_ids_is_rejected(tmp_path):
    # SentencePiece's defaults: unk 0, bos 1, eos 2, no pad.
    path = _train_spm(tmp_path / "default_ids.model")
    message = r"default_ids.model: vocabulary has pad_id=-1, eos_id=2; expected pad_id=0, eos_id=1"
    with pytest.raises(VocabularyError, match=message):
        load_vocabulary(str(path))


# A module name no environment has: what a missing optional package looks like.
_MISSING = "axlearn_test_no_such_package"


def test_a_missing_package_is_an_error_naming_what_needs_it_and_the_extra():
    with pytest.raises(VocabularyError) as e:
        require_package(_MISSING, needed_by="m.model: a SentencePiece model")
    assert str(e.value) == (
        f"m.model: a SentencePiece model needs the '{_MISSING}' package: "
        "pip install 'axlearn[data]'"
    )


def test_a_missing_package_raises_the_callers_error_type():
    with pytest.raises(InputError, match=f"^d.parquet: reading it needs the '{_MISSING}'"):
        require_package(_MISSING, needed_by="d.parquet: reading it", error=InputError)
