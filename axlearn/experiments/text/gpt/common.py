"""Building blocks of GPT experiments.

This file starts with the input builders; the model and trainer builders are added
below by another part of the project. It must stay importable without TensorFlow:
TensorFlow is only imported when a built source is called.
"""

from typing import Any, Optional

from axlearn.common.input_tf_data import BuildDatasetFn, lm_text_processor, tfds_dataset


def tfds_input(
    *,
    dataset_name: str,
    split: str,
    max_sequence_length: int,
    replace_newlines_with: Optional[str],
    train_shuffle_buffer_size: int,
    vocab_cfg: Any,
    is_training: bool,
    data_dir: Optional[str] = None,
    seed: Optional[int] = None,
) -> BuildDatasetFn:
    """A source of packed LM examples from a TFDS text dataset (feature 'text').

    Documents are read with `tfds_dataset` (shuffled with `train_shuffle_buffer_size`
    and repeated when training), tokenized with `vocab_cfg` after replacing newlines
    with `replace_newlines_with` (None: kept) and packed into examples of
    `max_sequence_length` tokens as `axlearn.common.input_packing` specifies.
    `data_dir`: the TFDS data directory (None: TFDS's default); `seed`: shuffling seed
    (None: 0).
    """
    source = tfds_dataset(
        dataset_name,
        split=split,
        is_training=is_training,
        train_shuffle_buffer_size=train_shuffle_buffer_size,
        data_dir=data_dir,
        seed=seed,
    )
    processor = lm_text_processor(
        vocab_cfg=vocab_cfg,
        max_sequence_length=max_sequence_length,
        is_training=is_training,
        replace_newlines_with=replace_newlines_with,
    )

    def build():
        return processor(source())

    return build


# ----- Other GPT builders (model, learner, trainer) are added below by another helper. -----
