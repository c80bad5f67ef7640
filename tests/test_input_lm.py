"""input_lm.lm_text_preprocessor and gpt.common.mixture_train_input_source against the
NumPy packing reference (`input_packing.pack_documents`), window by window."""

import numpy as np
import pytest

from axlearn.common.config import ConfigError, config_for_function
from axlearn.common.input_lm import lm_text_preprocessor
from axlearn.common.input_packing import FEATURE_KEYS, pack_documents
from axlearn.common.input_vocab import ByteVocabulary
from axlearn.experiments.text.gpt import common

# TensorFlow's import and tf.data tracing take seconds; TensorFlow is imported by the
# tests, not at collection.
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("tensorflow")]


@pytest.fixture(name="tensorflow", scope="module")
def fixture_tensorflow():
    return pytest.importorskip("tensorflow")


def _tf():
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    return tf

DOCS = ["hello world", "ab", "x" * 9, "the quick brown fox", "q", "Über"]
T = 8


def _docs(texts):
    tf = _tf()
    return tf.data.Dataset.from_tensor_slices({"text": tf.constant(texts, tf.string)})


def _examples(ds, n=None):
    rows = list(ds.take(n).as_numpy_iterator() if n else ds.as_numpy_iterator())
    return {key: np.stack([r[key] for r in rows]) for key in FEATURE_KEYS}


def _reference(texts):
    vocab = ByteVocabulary()
    return pack_documents(
        [vocab.encode(t) for t in texts], [len(t.encode()) for t in texts], T
    )


def _windowed_reference(texts, window):
    parts = [_reference(texts[i : i + window]) for i in range(0, len(texts), window)]
    return {key: np.concatenate([p[key] for p in parts]) for key in FEATURE_KEYS}


def test_each_window_of_documents_is_packed_on_its_own():
    process = lm_text_preprocessor(vocab_cfg=ByteVocabulary(), max_sequence_length=T, window_size=2)
    got = _examples(process(_docs(DOCS)))
    want = _windowed_reference(DOCS, 2)
    for key in FEATURE_KEYS:
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)


def test_examples_with_too_much_padding_are_dropped():
    process = lm_text_preprocessor(
        vocab_cfg=ByteVocabulary(), max_sequence_length=T, window_size=3, max_padding_fraction=0.5
    )
    got = _examples(process(_docs(DOCS)))
    want = _windowed_reference(DOCS, 3)
    keep = (want["input_segment_ids"] == 0).mean(axis=1) <= 0.5
    assert not keep.all()
    np.testing.assert_array_equal(got["input_ids"], want["input_ids"][keep])


def test_mixture_draws_by_weight_from_preprocessed_components(monkeypatch):
    corpora = {"a": DOCS[:3], "b": ["zzzzzzzzzzzzzzzz"]}

    def fake_tfds(name, *, split, is_training, **kwargs):
        del split, kwargs
        assert is_training
        return lambda: _docs(corpora[name]).repeat()

    monkeypatch.setattr(common, "tfds_dataset", fake_tfds)
    components = [
        dict(name="a", weight=1.0, shuffle_buffer_size=0, split="train", info=""),
        dict(name="b", weight=0.0, shuffle_buffer_size=0, split="train", info=""),
    ]
    build = common.mixture_train_input_source(
        is_training=True,
        vocab_cfg=ByteVocabulary(),
        preprocessor=config_for_function(lm_text_preprocessor).set(window_size=3),
        data_mixture_components=components,
        max_sequence_length=T,
    )
    want = _reference(corpora["a"])
    got = _examples(build(), n=len(want["input_ids"]))
    np.testing.assert_array_equal(got["input_ids"], want["input_ids"])


def test_mixture_components_with_unknown_keys_are_rejected():
    with pytest.raises(ConfigError, match=r"components\[0\]: unknown keys \['rate'\]"):
        common.mixture_train_input_source(
            vocab_cfg=ByteVocabulary(),
            preprocessor=config_for_function(lm_text_preprocessor),
            data_mixture_components=[dict(name="a", weight=1.0, split="train", rate=2)],
            max_sequence_length=T,
        )
