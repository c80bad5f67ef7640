"""The input configs print as the golden spec does, and build and run without TensorFlow."""

import textwrap

import pytest

from axlearn.common import input_tf_data
from axlearn.common.config import config_for_function
from axlearn.common.golden_text import parse_flat_text
from axlearn.experiments.text.common import vocab
from axlearn.experiments.text.gpt.common import tfds_input
from tests.fresh_python import assert_prints_ok


# The `input.` and `evalers['openwebtext_2'].input.` lines of the 2.7B GPT spec.
TRAIN_INPUT_SPEC = """\
batcher.fn: 'axlearn.common.input_tf_data.batch'
batcher.global_batch_size: 2048
batcher.pad_example_fn: 'axlearn.common.input_tf_data.default_pad_example_fn'
batcher.prefetch_buffer_size: -1
is_training: True
klass: 'axlearn.common.input_tf_data.Input'
processor.fn: 'axlearn.common.input_tf_data.identity'
source.dataset_name: 'pajama_honeycrisp_15t_202408072230'
source.download: False
source.fn: 'axlearn.common.input_tf_data.tfds_dataset'
source.is_training: True
source.split: 'train'
source.train_shuffle_buffer_size: 0
source.train_shuffle_files: False"""

EVAL_INPUT_SPEC = """\
batcher.fn: 'axlearn.common.input_tf_data.batch'
batcher.global_batch_size: 2048
batcher.pad_example_fn: 'axlearn.common.input_tf_data.default_pad_example_fn'
batcher.prefetch_buffer_size: -1
is_training: False
klass: 'axlearn.common.input_tf_data.Input'
processor.fn: 'axlearn.common.input_tf_data.identity'
source.dataset_name: 'pile/openwebtext_2:1.0.0'
source.fn: 'axlearn.experiments.text.gpt.common.tfds_input'
source.is_training: False
source.max_sequence_length: 4096
source.replace_newlines_with: '<n>'
source.split: 'test[:5000]'
source.train_shuffle_buffer_size: 16384
source.vocab_cfg.fn: 'axlearn.experiments.text.common.vocab'
source.vocab_cfg.sentencepiece_model_name: 'bpe_48k_honeycrisp.model'"""


def _train_input_config():
    return input_tf_data.Input.default_config().set(
        is_training=True,
        source=config_for_function(input_tf_data.tfds_dataset).set(
            dataset_name="pajama_honeycrisp_15t_202408072230",
            split="train",
            download=False,
            train_shuffle_files=False,
            train_shuffle_buffer_size=0,
            is_training=True,
        ),
        processor=config_for_function(input_tf_data.identity),
        batcher=config_for_function(input_tf_data.batch).set(global_batch_size=2048),
    )


def _eval_input_config():
    return input_tf_data.Input.default_config().set(
        is_training=False,
        source=config_for_function(tfds_input).set(
            dataset_name="pile/openwebtext_2:1.0.0",
            split="test[:5000]",
            max_sequence_length=4096,
            replace_newlines_with="<n>",
            train_shuffle_buffer_size=16384,
            vocab_cfg=config_for_function(vocab).set(
                sentencepiece_model_name="bpe_48k_honeycrisp.model"
            ),
            is_training=False,
        ),
        processor=config_for_function(input_tf_data.identity),
        batcher=config_for_function(input_tf_data.batch).set(global_batch_size=2048),
    )


def test_training_input_prints_as_the_spec():
    assert _train_input_config().debug_string() == TRAIN_INPUT_SPEC


def test_eval_input_prints_as_the_spec():
    assert _eval_input_config().debug_string() == EVAL_INPUT_SPEC


def test_spec_text_parses_back_to_the_same_configs():
    assert parse_flat_text(TRAIN_INPUT_SPEC).debug_string() == TRAIN_INPUT_SPEC
    assert parse_flat_text(EVAL_INPUT_SPEC).debug_string() == EVAL_INPUT_SPEC


@pytest.mark.slow
def test_inputs_build_and_run_without_tensorflow(tmp_path):
    script = textwrap.dedent(
        f"""
        import sys

        class BlockTensorFlow:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("tensorflow", "tensorflow_datasets", "seqio"):
                    raise ImportError("blocked: " + name)

        sys.meta_path.insert(0, BlockTensorFlow())
        from axlearn.common import input_tf_data
        from axlearn.common.input_builtin import BuiltinTextInput
        from axlearn.experiments.text.common import vocab
        from tests.test_input_spec import _eval_input_config, _train_input_config

        for cfg in (_train_input_config(), _eval_input_config()):
            cfg.set(name="input").instantiate(parent=None)
        assert vocab("bytes").encode("a") == [100]
        builtin = BuiltinTextInput.default_config().set(
            name="input", is_training=True, global_batch_size=2, max_sequence_length=64,
            cache_dir={str(tmp_path)!r},
        ).instantiate(parent=None)
        assert next(iter(builtin))["input_ids"].shape == (2, 64)
        assert not any(m.split(".")[0] in ("tensorflow", "seqio") for m in sys.modules)
        print("ok")
        """
    )
    assert_prints_ok(script, marker="ok")
