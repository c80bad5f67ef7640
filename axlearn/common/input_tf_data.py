"""The tf.data input path: TFDS sources, processors and a per-process batcher.

`Input` chains three configured functions: `source` builds a `tf.data.Dataset` of
examples (`tfds_dataset`, or `axlearn.experiments.text.gpt.common.tfds_input` for
tokenized, packed text), `processor` maps it to model examples (`identity`,
`lm_text_processor`), and `batcher` (`batch`) forms global batches and keeps this
process's rows. Everything then crosses into NumPy as the shared input interface
(`input_base`) describes.

TensorFlow, TFDS and seqio are imported inside functions only: this module imports
(and its configs build and print) on machines without TensorFlow.

Multi-process: every process runs the whole pipeline and keeps rows
[i*b, (i+1)*b) of each global batch, so the slices tile the global batch exactly as a
single process would produce it. Resuming skips the consumed batches of the (seeded,
deterministic) pipeline.
"""

from collections.abc import Callable, Iterator
from typing import Any, Optional

import jax
import numpy as np

from axlearn.common.config import (
    REQUIRED,
    ConfigError,
    InstantiableConfig,
    Required,
    config_class,
    maybe_instantiate,
    register_configurable,
)
from axlearn.common.input_base import BaseInput, Batch, InputError
from axlearn.common.module import Module

# () -> tf.data.Dataset of examples.
BuildDatasetFn = Callable[[], Any]
# tf.data.Dataset -> tf.data.Dataset.
DatasetToDatasetFn = Callable[[Any], Any]


def _tf():
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    return tf


# ----- sources -----


@register_configurable
def tfds_dataset(
    dataset_name: str,
    *,
    split: str,
    is_training: bool,
    download: bool = False,
    train_shuffle_files: bool = True,
    train_shuffle_buffer_size: int = 0,
    data_dir: Optional[str] = None,
    seed: Optional[int] = None,
) -> BuildDatasetFn:
    """A TFDS split as a source: shuffled (files, then a buffer) and repeated when training.

    Args:
        dataset_name: A TFDS name, optionally with config and version ('pile/x:1.0.0').
        split: A TFDS split, slicing allowed ('test[:5000]').
        is_training: Whether to shuffle and repeat forever.
        download: Whether to download and prepare the dataset if absent.
        train_shuffle_files: When training, read the split's files in a seeded random order.
        train_shuffle_buffer_size: When training, shuffle examples in a buffer of this size
            (0: no example shuffling).
        data_dir: The TFDS data directory (None: TFDS's default, $TFDS_DATA_DIR).
        seed: Seeds file and example shuffling (None: 0).
    """

    def build():
        import tensorflow_datasets as tfds  # pylint: disable=import-outside-toplevel

        tf = _tf()
        where = f"tfds dataset '{dataset_name}' (data_dir={data_dir or 'TFDS default'})"
        try:
            builder = tfds.builder(dataset_name, data_dir=data_dir)
        except Exception as e:  # pylint: disable=broad-except
            # TFDS appends the list of every known dataset; its first line is the message.
            raise InputError(f"{where} cannot be found: {str(e).splitlines()[0]}") from e
        if download:
            builder.download_and_prepare()
        elif not tf.io.gfile.exists(builder.data_dir):
            raise InputError(
                f"{where} is not prepared: expected files in {builder.data_dir} "
                "(set download=True or point data_dir at a prepared copy)"
            )
        read_config = tfds.ReadConfig(shuffle_seed=seed or 0)
        try:
            ds = builder.as_dataset(
                split=split,
                shuffle_files=is_training and train_shuffle_files,
                read_config=read_config,
            )
        except Exception as e:  # pylint: disable=broad-except
            raise InputError(f"{where}: cannot read split '{split}': {e}") from e
        if is_training:
            if train_shuffle_buffer_size > 0:
                ds = ds.shuffle(
                    train_shuffle_buffer_size, seed=seed or 0, reshuffle_each_iteration=True
                )
            ds = ds.repeat()
        return ds

    return build


# ----- processors -----


def _identity_fn(ds):
    return ds


@register_configurable
def identity() -> DatasetToDatasetFn:
    """A processor that leaves examples unchanged."""
    return _identity_fn


@register_configurable
def lm_text_processor(
    *,
    vocab_cfg: Any,
    max_sequence_length: int,
    is_training: bool,
    replace_newlines_with: Optional[str] = None,
    text_key: Optional[str] = None,
) -> DatasetToDatasetFn:
    """Tokenizes text examples and packs them into LM examples, per `input_packing`.

    Args:
        vocab_cfg: A vocabulary or its config (with `encode_tf` and `eos_id`).
        max_sequence_length: T, tokens per example.
        is_training: Training streams run forever (the source repeats); eval streams end
            with one partially padded example.
        replace_newlines_with: Replaces '\\n' before tokenizing (for vocabularies without
            a newline piece). Byte counts are of the original text.
        text_key: The text feature (None: 'text').
    """
    del is_training  # The packing is the same; only the source decides whether it ends.
    text_key = text_key or "text"

    def process(ds):
        tf = _tf()
        vocab = maybe_instantiate(vocab_cfg)
        eos = tf.constant([vocab.eos_id], tf.int64)
        length_t = max_sequence_length

        def to_block(example):
            text = example[text_key]
            num_bytes = tf.cast(tf.strings.length(text, unit="BYTE"), tf.int64)
            if replace_newlines_with is not None:
                rewrite = replace_newlines_with.replace("\\", "\\\\")
                text = tf.strings.regex_replace(text, "\n", rewrite)
            ids = tf.cast(vocab.encode_tf(text), tf.int64)
            length = tf.size(ids, out_type=tf.int64) + 1
            offsets = tf.range(length, dtype=tf.int64)
            return {
                "inputs": tf.concat([eos, ids], 0),
                "targets": tf.concat([ids, eos], 0),
                "starts": tf.equal(offsets, 0),
                "shares": (num_bytes * (offsets + 1)) // length - (num_bytes * offsets) // length,
            }

        def to_features(chunk):
            size = tf.shape(chunk["inputs"])[0]
            padding = [[0, length_t - size]]
            valid = tf.pad(tf.ones([size], tf.bool), padding)
            index = tf.range(length_t)
            starts = tf.logical_and(tf.pad(chunk["starts"], padding), valid)
            starts = tf.logical_or(starts, tf.equal(index, 0))  # A chunk opens a segment.
            segment_ids = tf.cumsum(tf.cast(starts, tf.int32)) * tf.cast(valid, tf.int32)
            start_index = tf.boolean_mask(index, starts)
            positions = index - tf.gather(start_index, tf.maximum(segment_ids - 1, 0))
            features = {
                "input_ids": tf.pad(chunk["inputs"], padding),
                "target_labels": tf.pad(chunk["targets"], padding),
                "input_segment_ids": segment_ids,
                "input_positions": positions * tf.cast(valid, tf.int32),
                "target_num_bytes": tf.reduce_sum(chunk["shares"]),
            }
            features = {k: tf.cast(v, tf.int32) for k, v in features.items()}
            for key in ("input_ids", "target_labels", "input_segment_ids", "input_positions"):
                features[key] = tf.ensure_shape(features[key], [length_t])
            return features

        ds = ds.map(to_block, num_parallel_calls=tf.data.AUTOTUNE)
        ds = ds.filter(lambda block: tf.size(block["targets"]) > 1)  # Skip empty documents.
        ds = ds.unbatch().batch(length_t)
        return ds.map(to_features, num_parallel_calls=tf.data.AUTOTUNE)

    return process


# ----- batching -----


@register_configurable
def default_pad_example_fn(example: dict[str, Any]) -> dict[str, Any]:
    """A padding example: zeros shaped like `example` (so its targets are all padding)."""
    tf = _tf()
    return tf.nest.map_structure(tf.zeros_like, example)


@register_configurable
def batch(
    global_batch_size: int,
    *,
    pad_example_fn: Callable[[Any], Any] = default_pad_example_fn,
    prefetch_buffer_size: int = -1,
) -> Callable[..., Any]:
    """A batcher: global batches of `global_batch_size`, of which a process keeps its rows.

    Returns `fn(ds, *, is_training, process_index, process_count) -> ds`. Eval datasets
    end with a global batch filled up with `pad_example_fn` examples; training drops
    nothing (its stream is infinite). `prefetch_buffer_size`: batches prefetched by
    tf.data (-1: autotuned, 0: none).
    """

    def batcher(ds, *, is_training: bool, process_index: int, process_count: int):
        tf = _tf()
        if global_batch_size % process_count:
            raise ConfigError(
                f"batcher.global_batch_size {global_batch_size} is not divisible by the "
                f"process count {process_count}"
            )
        host_size = global_batch_size // process_count
        if not is_training:
            spec = ds.element_spec
            shapes = [s.shape for s in tf.nest.flatten(spec)]
            if not all(shape.is_fully_defined() for shape in shapes):
                raise InputError(
                    f"Padding the last eval batch needs examples of fixed shape, got {spec}"
                )
            zeros = tf.nest.map_structure(lambda s: tf.zeros(s.shape, s.dtype), spec)
            padding = tf.data.Dataset.from_tensors(pad_example_fn(zeros))
            # N examples + (B - 1) pads make exactly ceil(N / B) full batches.
            ds = ds.concatenate(padding.repeat(global_batch_size - 1))
        ds = ds.batch(global_batch_size, drop_remainder=True)
        lo = process_index * host_size
        ds = ds.map(lambda x: tf.nest.map_structure(lambda t: t[lo : lo + host_size], x))
        if prefetch_buffer_size:
            size = tf.data.AUTOTUNE if prefetch_buffer_size == -1 else prefetch_buffer_size
            ds = ds.prefetch(size)
        return ds

    return batcher


@register_configurable
def per_feed_batch(
    feed_batch_size: Optional[int] = None,
    *,
    is_training: Optional[bool] = None,
    pad_example_fn: Callable[[Any], Any] = default_pad_example_fn,
    prefetch_buffer_size: int = -1,
) -> Callable[..., Any]:
    """A batcher for an input with an `input_dispatcher`: batches of `feed_batch_size`
    rows per logical feed (the dispatcher's feed_logical_batch_size; the input sets it
    and `is_training`).

    Returns `fn(ds, *, is_training, process_index, process_count) -> ds`, where the
    process arguments are this feed's logical index and the number of logical feeds: as
    `batch` does, every feed runs the whole pipeline, forms batches of feed_batch_size x
    process_count rows and keeps its own rows, so that every feed yields the same number
    of batches and an eval pass ends at the same batch everywhere.
    """
    del is_training  # The input passes it to the batcher on each call.
    if feed_batch_size is None:
        raise ConfigError("per_feed_batch.feed_batch_size: set by the input's input_dispatcher")

    def batcher(ds, *, is_training: bool, process_index: int, process_count: int):
        logical_batch = batch(
            feed_batch_size * process_count,
            pad_example_fn=pad_example_fn,
            prefetch_buffer_size=prefetch_buffer_size,
        )
        return logical_batch(
            ds, is_training=is_training, process_index=process_index, process_count=process_count
        )

    return batcher


# ----- the input -----


class Input(BaseInput):
    """A tf.data pipeline `batcher(processor(source()))` behind the shared input interface."""

    @config_class
    class Config(BaseInput.Config):
        """Configures Input."""

        source: Required[InstantiableConfig] = REQUIRED  # Builds a BuildDatasetFn.
        processor: Required[InstantiableConfig] = REQUIRED  # Builds a DatasetToDatasetFn.
        # A `batch` config, or `per_feed_batch` with an input_dispatcher.
        batcher: Required[InstantiableConfig] = REQUIRED
        # Feeds a global batch of any size to any mesh (input_dispatch.SpmdInputDispatcher):
        # the batcher then batches each logical feed's rows and this input pads them to
        # the physical batch. None: the batcher's global batch, split over the processes.
        input_dispatcher: Optional[InstantiableConfig] = None
        # Shards the global batch's arrays in the train step, e.g.
        # input_base.partition_by_path_rank; None: by the trainer's batch axes only.
        input_partitioner: Optional[InstantiableConfig] = None

    def __init__(self, cfg: Config, *, parent: Optional[Module], **kwargs):
        super().__init__(cfg, parent=parent, **kwargs)
        cfg = self.config
        batcher = cfg.batcher
        if cfg.input_dispatcher is not None:
            dispatcher = _with_unset(
                cfg.input_dispatcher,
                num_physical_feeds=self._process_count,
                physical_feed_index=self._process_index,
            )
            self._add_child("input_dispatcher", dispatcher)
            feed_rows = self.input_dispatcher.feed_logical_batch_size
            batcher = _with_unset(batcher, feed_batch_size=feed_rows)
        elif "feed_batch_size" in batcher:
            raise ConfigError(
                f"{self.path()}.batcher: {batcher.fn.__name__} batches per feed and needs an "
                "input_dispatcher"
            )
        self._source = _with_unset(cfg.source, is_training=cfg.is_training).instantiate(
            config_path=f"{self.path()}.source"
        )
        self._processor = _with_unset(cfg.processor, is_training=cfg.is_training).instantiate(
            config_path=f"{self.path()}.processor"
        )
        self._batcher = _with_unset(batcher, is_training=cfg.is_training).instantiate(
            config_path=f"{self.path()}.batcher"
        )
        self._partitioner = None
        if cfg.input_partitioner is not None:
            self._partitioner = cfg.input_partitioner.instantiate(
                config_path=f"{self.path()}.input_partitioner"
            )

    @property
    def global_batch_size(self) -> int:
        if "input_dispatcher" in self.children:
            return self.input_dispatcher.global_physical_batch_size
        return self.config.batcher.global_batch_size

    def tf_dataset(self):
        """This process's batches as a tf.data.Dataset (from the start): its rows of each
        global batch, or with an input_dispatcher its logical feed's rows."""
        ds = self._processor(self._source())
        if "input_dispatcher" in self.children:
            read = self.input_dispatcher.feed_read_config()
            process_index, process_count = read["shard_index"], read["num_shards"]
        else:
            process_index, process_count = self.process_index, self.process_count
        return self._batcher(
            ds,
            is_training=self.config.is_training,
            process_index=process_index,
            process_count=process_count,
        )

    def _host_batches(self, start: int) -> Iterator[Batch]:
        ds = self.tf_dataset()
        if start:
            ds = ds.skip(start)
        for batch in ds.as_numpy_iterator():
            batch = {key: np.asarray(value) for key, value in batch.items()}
            if "input_dispatcher" in self.children:
                batch = self.input_dispatcher.logical_to_physical(batch)
            yield batch

    def partition_batch(self, batch: Any) -> Any:
        """The batch sharded by `input_partitioner` (in the jitted step), if it has one."""
        return batch if self._partitioner is None else self._partitioner(batch)

    def element_spec(self) -> dict[str, jax.ShapeDtypeStruct]:
        """Shapes and dtypes of one global (physical) batch (builds the pipeline to read
        them)."""
        spec = self.tf_dataset().element_spec
        return {
            key: jax.ShapeDtypeStruct(
                (self.global_batch_size,) + tuple(s.shape[1:]), np.dtype(s.dtype.as_numpy_dtype)
            )
            for key, s in spec.items()
        }


def _with_unset(cfg: InstantiableConfig, **values: Any) -> InstantiableConfig:
    """`cfg` with those of `values` set that are fields of it still unset (REQUIRED or
    None): what the input knows (is_training, a feed's batch size), AXLearn's configs
    leave to it."""
    unset = {
        key: value
        for key, value in values.items()
        if key in cfg and (getattr(cfg, key) is REQUIRED or getattr(cfg, key) is None)
    }
    return cfg.clone(**unset) if unset else cfg
