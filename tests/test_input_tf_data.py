"""Specification of the tf.data path, checked against the TF-free token path."""

import io
import json

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
tfds = pytest.importorskip("tensorflow_datasets")
seqio = pytest.importorskip("seqio")

# pylint: disable=wrong-import-position
from axlearn.common import input_tf_data
from axlearn.common.config import config_for_function
from axlearn.common.input_base import InputError
from axlearn.common.input_packing import FEATURE_KEYS, pack_documents
from axlearn.common.input_tokens import TokenShardInput, build_token_shards
from axlearn.common.input_vocab import ByteVocabulary, load_vocabulary
from axlearn.experiments.text.common import vocab
from axlearn.experiments.text.gpt.common import tfds_input

TEXTS = [
    "hello world",
    "",
    "ab",
    "x" * 20,
    "é\nq",
    "Über\n\nline two",
    "the quick brown fox jumps over the lazy dog",
]


def texts_source(texts, is_training: bool):
    """A source of {'text': ...} examples, repeated when training (like tfds_dataset)."""

    def build():
        ds = tf.data.Dataset.from_tensor_slices({"text": tf.constant(list(texts), tf.string)})
        return ds.repeat() if is_training else ds

    return build


def _tf_input(
    *, is_training, texts=TEXTS, vocab_cfg=None, batch=4, length=8, newline=None, **kwargs
):
    vocab_cfg = vocab_cfg if vocab_cfg is not None else ByteVocabulary()
    cfg = input_tf_data.Input.default_config().set(
        name="input",
        is_training=is_training,
        source=config_for_function(texts_source).set(texts=texts, is_training=is_training),
        processor=config_for_function(input_tf_data.lm_text_processor).set(
            vocab_cfg=vocab_cfg,
            max_sequence_length=length,
            is_training=is_training,
            replace_newlines_with=newline,
        ),
        batcher=config_for_function(input_tf_data.batch).set(global_batch_size=batch),
    )
    return cfg.instantiate(parent=None, **kwargs)


def _token_input(
    tmp_path, *, is_training, texts=TEXTS, vocabulary=None, batch=4, length=8, newline=None
):
    paths = build_token_shards(
        texts,
        vocab=vocabulary or ByteVocabulary(),
        output_prefix=str(tmp_path / "shard"),
        replace_newlines_with=newline,
    )
    cfg = TokenShardInput.default_config().set(
        name="input",
        is_training=is_training,
        global_batch_size=batch,
        max_sequence_length=length,
        paths=paths,
        shuffle=False,
    )
    return cfg.instantiate(parent=None)


def _assert_same(a, b):
    assert a.keys() == b.keys()
    for key in a:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)


def _take(iterator, n):
    return [next(iterator) for _ in range(n)]


def _spm_model(tmp_path):
    import sentencepiece  # pylint: disable=import-outside-toplevel

    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter([t for t in TEXTS if t] * 10 + ["lorem ipsum dolor sit amet"] * 10),
        model_writer=model,
        vocab_size=60,
        pad_id=0,
        eos_id=1,
        unk_id=2,
        bos_id=-1,
        hard_vocab_limit=False,
        minloglevel=2,
    )
    path = tmp_path / "tiny.model"
    path.write_bytes(model.getvalue())
    return path


def test_eval_batches_match_the_token_path(tmp_path):
    tf_batches = list(_tf_input(is_training=False, newline="<n>").dataset())
    token_batches = list(_token_input(tmp_path, is_training=False, newline="<n>").dataset())
    assert len(tf_batches) == len(token_batches) > 1
    for a, b in zip(tf_batches, token_batches):
        _assert_same(a, b)


def test_training_streams_match_the_token_path_across_epochs(tmp_path):
    tf_batches = _take(_tf_input(is_training=True).dataset(), 8)
    token_batches = _take(_token_input(tmp_path, is_training=True).dataset(), 8)
    for a, b in zip(tf_batches, token_batches):
        _assert_same(a, b)


def test_sentencepiece_paths_match(tmp_path, monkeypatch):
    model = _spm_model(tmp_path)
    monkeypatch.setenv("AXLEARN_VOCAB_DIR", str(tmp_path))
    seqio_vocab = config_for_function(vocab).set(sentencepiece_model_name="tiny.model")
    tf_batches = list(_tf_input(is_training=False, vocab_cfg=seqio_vocab, newline="<n>").dataset())
    token_batches = list(
        _token_input(
            tmp_path, is_training=False, vocabulary=load_vocabulary(str(model)), newline="<n>"
        ).dataset()
    )
    assert len(tf_batches) == len(token_batches)
    for a, b in zip(tf_batches, token_batches):
        _assert_same(a, b)


def test_eval_packing_and_padding_match_the_reference():
    texts = ["abc", "d", "ef"]
    batches = list(_tf_input(is_training=False, texts=texts, batch=2, length=4).dataset())
    vocabulary = ByteVocabulary()
    expected = pack_documents([vocabulary.encode(t) for t in texts], [3, 1, 2], 4)
    got = {k: np.concatenate([b[k] for b in batches]) for k in FEATURE_KEYS}
    assert got["input_ids"].shape == (4, 4)  # 3 chunks, padded to 2 batches of 2.
    for key in FEATURE_KEYS:
        np.testing.assert_array_equal(got[key][:3], expected[key])
        assert not got[key][3].any()


@pytest.mark.parametrize("is_training", [True, False])
def test_process_slices_tile_the_global_batch(is_training):
    whole = _take(_tf_input(is_training=is_training).dataset(), 2)
    parts = [
        _take(_tf_input(is_training=is_training, process_index=i, process_count=2).dataset(), 2)
        for i in range(2)
    ]
    for step, want in enumerate(whole):
        assert parts[0][step]["input_ids"].shape == (2, 8)
        _assert_same({k: np.concatenate([p[step][k] for p in parts]) for k in want}, want)


def test_restored_iterator_continues_exactly():
    expected = _take(_tf_input(is_training=True).dataset(), 9)
    first = _tf_input(is_training=True)
    _take(first.dataset(), 5)
    restored = _tf_input(is_training=True)
    restored.set_state(json.loads(json.dumps(first.get_state())))
    for want, got in zip(expected[5:], _take(restored.dataset(), 4)):
        _assert_same(got, want)


def test_empty_eval_split_is_an_error():
    with pytest.raises(InputError, match="input: the evaluation input produced no batches"):
        list(_tf_input(is_training=False, texts=["", ""]).dataset())


def test_element_spec_is_the_global_batch():
    spec = _tf_input(is_training=True, process_index=0, process_count=2).element_spec()
    assert spec["input_ids"].shape == (4, 8) and spec["input_ids"].dtype == np.int32
    assert spec["target_num_bytes"].shape == (4,)


# ----- TFDS -----


class TinyTexts(tfds.core.GeneratorBasedBuilder):
    """A local TFDS dataset for tests (no download)."""

    VERSION = tfds.core.Version("1.0.0")
    # No source file lookup (checksums): TFDS's lookup needs importlib_resources here.
    code_path = None

    def _info(self):
        return tfds.core.DatasetInfo(
            builder=self, features=tfds.features.FeaturesDict({"text": tfds.features.Text()})
        )

    def _split_generators(self, dl_manager):
        del dl_manager
        return {"train": self._generate_examples(TEXTS[:3]), "test": self._generate_examples(TEXTS)}

    def _generate_examples(self, texts):
        for i, text in enumerate(texts):
            yield i, {"text": text}


@pytest.fixture(name="tfds_dir", scope="module")
def fixture_tfds_dir(tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("tfds")
    TinyTexts(data_dir=str(data_dir)).download_and_prepare()
    return str(data_dir)


def _tfds_lm_input(tfds_dir, *, split, is_training, batch, length, newline):
    """An Input over the local TFDS dataset, built like the spec's eval input."""
    source = config_for_function(tfds_input).set(
        dataset_name="tiny_texts",
        split=split,
        max_sequence_length=length,
        replace_newlines_with=newline,
        train_shuffle_buffer_size=8,
        vocab_cfg=config_for_function(vocab).set(sentencepiece_model_name="bytes"),
        is_training=is_training,
        data_dir=tfds_dir,
    )
    cfg = input_tf_data.Input.default_config().set(
        name="input",
        is_training=is_training,
        source=source,
        processor=config_for_function(input_tf_data.identity),
        batcher=config_for_function(input_tf_data.batch).set(global_batch_size=batch),
    )
    return cfg.instantiate(parent=None)


def test_tfds_input_matches_the_token_path(tfds_dir, tmp_path):
    tf_input = _tfds_lm_input(
        tfds_dir, split="test", is_training=False, batch=4, length=8, newline="<n>"
    )
    tf_batches = list(tf_input.dataset())
    # TFDS stores examples in its own order; the token path reads them in that order.
    raw = input_tf_data.tfds_dataset(
        "tiny_texts", split="test", is_training=False, data_dir=tfds_dir
    )()
    texts = [example["text"].decode("utf-8") for example in raw.as_numpy_iterator()]
    assert sorted(texts) == sorted(TEXTS)
    token_input = _token_input(tmp_path, is_training=False, texts=texts, newline="<n>")
    token_batches = list(token_input.dataset())
    assert len(tf_batches) == len(token_batches)
    for a, b in zip(tf_batches, token_batches):
        _assert_same(a, b)


def test_tfds_training_source_repeats_with_seeded_shuffling(tfds_dir):
    def first_texts():
        build = input_tf_data.tfds_dataset(
            "tiny_texts",
            split="train",
            is_training=True,
            train_shuffle_buffer_size=8,
            data_dir=tfds_dir,
        )
        return [x["text"] for x in build().take(9).as_numpy_iterator()]

    texts = first_texts()
    assert texts == first_texts()
    assert sorted(set(texts)) == sorted(t.encode() for t in TEXTS[:3])


def test_unprepared_tfds_dataset_names_the_directory(tmp_path):
    build = input_tf_data.tfds_dataset(
        "tiny_texts", split="test", is_training=False, data_dir=str(tmp_path / "empty")
    )
    message = r"tiny_texts.* is not prepared: expected files in .*empty"
    with pytest.raises(InputError, match=message):
        build()


def test_unknown_tfds_dataset_is_named(tmp_path):
    build = input_tf_data.tfds_dataset(
        "no_such_dataset_xyz", split="test", is_training=False, data_dir=str(tmp_path)
    )
    with pytest.raises(InputError, match="'no_such_dataset_xyz'.*cannot be found"):
        build()


def test_shuffled_tfds_training_input_resumes_exactly(tfds_dir):
    def make():
        return _tfds_lm_input(
            tfds_dir, split="train", is_training=True, batch=2, length=4, newline=None
        )

    expected = _take(make().dataset(), 10)
    first = make()
    _take(first.dataset(), 6)
    restored = make()
    restored.set_state(first.get_state())
    for want, got in zip(expected[6:], _take(restored.dataset(), 4)):
        _assert_same(got, want)
