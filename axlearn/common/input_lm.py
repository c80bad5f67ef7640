"""Language-model preprocessing of text sources on the tf.data path, as AXLearn's configs
name it (`input_lm.lm_text_preprocessor`).

`lm_text_preprocessor` turns a dataset of `{'text': ...}` documents into packed LM
examples by the packing contract of `input_packing` (that of `lm_text_processor`), in
windows: the documents are taken `window_size` at a time and each window is packed on
its own, so the packer holds one window in memory and no example spans two windows.
Examples with more than `max_padding_fraction` padding (a window's last, short one) are
dropped, and the rest shuffled in a buffer of `shuffle_buffer_size` examples.

TensorFlow is imported when a built processor runs, not when this module is imported.
"""

from typing import Any, Optional

from axlearn.common.config import ConfigError, register_configurable
from axlearn.common.input_tf_data import DatasetToDatasetFn, lm_text_processor


@register_configurable
def lm_text_preprocessor(
    *,
    vocab_cfg: Any = None,
    max_sequence_length: Optional[int] = None,
    replace_newlines_with: Optional[str] = None,
    window_size: int = 128,
    max_padding_fraction: float = 1.0,
    shuffle_buffer_size: int = 0,
    seed: Optional[int] = None,
) -> DatasetToDatasetFn:
    """A processor: text documents -> packed LM examples (see the module docstring).

    Args:
        vocab_cfg: The vocabulary or its config; the source sets it (as it does
            max_sequence_length and replace_newlines_with).
        max_sequence_length: T, tokens per example.
        replace_newlines_with: Replaces '\\n' before tokenizing (None: kept).
        window_size: Documents packed together.
        max_padding_fraction: Examples whose share of padding positions exceeds this are
            dropped (1: none are).
        shuffle_buffer_size: Examples shuffled together after packing (0: no shuffling).
        seed: Seeds the shuffle (None: 0).
    """
    if vocab_cfg is None or max_sequence_length is None:
        raise ConfigError(
            "lm_text_preprocessor: vocab_cfg and max_sequence_length are set by the source "
            f"(mixture_train_input_source); got {vocab_cfg!r} and {max_sequence_length!r}"
        )
    if window_size < 1 or not 0.0 <= max_padding_fraction <= 1.0 or shuffle_buffer_size < 0:
        raise ConfigError(
            "lm_text_preprocessor: window_size must be >= 1, max_padding_fraction in [0, 1] "
            f"and shuffle_buffer_size >= 0; got {window_size}, {max_padding_fraction}, "
            f"{shuffle_buffer_size}"
        )
    pack = lm_text_processor(
        vocab_cfg=vocab_cfg,
        max_sequence_length=max_sequence_length,
        is_training=True,
        replace_newlines_with=replace_newlines_with,
    )

    def process(ds):
        import tensorflow as tf  # pylint: disable=import-outside-toplevel

        ds = ds.batch(window_size).flat_map(
            lambda window: pack(tf.data.Dataset.from_tensor_slices(window))
        )
        if max_padding_fraction < 1.0:

            def mostly_live(example):
                padding = tf.reduce_mean(tf.cast(example["input_segment_ids"] == 0, tf.float32))
                return padding <= max_padding_fraction

            ds = ds.filter(mostly_live)
        if shuffle_buffer_size:
            ds = ds.shuffle(shuffle_buffer_size, seed=seed or 0, reshuffle_each_iteration=True)
        return ds

    return process
