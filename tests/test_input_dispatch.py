"""input_dispatch.SpmdInputDispatcher, input_tf_data.per_feed_batch and
input_base.partition_by_path_rank: a logical batch fed through padded per-process
batches holds exactly the rows a single process batches (NumPy and the plain `batch`
batcher as references)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec

from axlearn.common.config import ConfigError, config_for_function
from axlearn.common.input_base import partition_by_path_rank
from axlearn.common.input_dispatch import SpmdInputDispatcher
from axlearn.common.sharding import create_mesh

RNG = np.random.default_rng(0)


def _dispatcher(feeds: int, index: int, **kwargs) -> SpmdInputDispatcher:
    cfg = SpmdInputDispatcher.default_config().set(
        name="input_dispatcher", num_physical_feeds=feeds, physical_feed_index=index, **kwargs
    )
    return cfg.instantiate(parent=None)


def test_a_small_logical_batch_is_padded_to_the_physical_batch_of_a_large_mesh():
    # 32 logical rows, 64 devices over 8 processes: 4 logical rows a feed, 8 physical.
    dispatcher = _dispatcher(8, 3, global_logical_batch_size=32, global_physical_batch_size=64)
    assert (dispatcher.feed_logical_batch_size, dispatcher.feed_physical_batch_size) == (4, 8)
    rows = RNG.integers(1, 9, size=(4, 5)).astype(np.int32)
    physical = dispatcher.logical_to_physical({"input_ids": rows})["input_ids"]
    np.testing.assert_array_equal(physical, np.concatenate([rows, np.zeros((4, 5), np.int32)]))


def test_fewer_logical_rows_than_feeds_leave_the_other_feeds_padding_only():
    batches = [
        _dispatcher(4, i, global_logical_batch_size=2).logical_to_physical(
            {"target_labels": np.full((1, 3), i + 1, np.int32)}
        )["target_labels"]
        for i in range(4)
    ]
    assert [b.shape for b in batches] == [(1, 3)] * 4
    np.testing.assert_array_equal(np.concatenate(batches)[:, 0], [1, 2, 0, 0])


def test_a_physical_batch_that_does_not_split_over_the_feeds_is_rejected():
    dispatcher = _dispatcher(4, 0, global_logical_batch_size=8, global_physical_batch_size=6)
    with pytest.raises(ConfigError, match="global_physical_batch_size: 6 rows must split"):
        _ = dispatcher.feed_physical_batch_size


@pytest.mark.slow  # Imports TensorFlow.
def test_per_feed_batches_of_all_processes_hold_the_single_process_batch():
    tf = pytest.importorskip("tensorflow")
    from axlearn.common import input_tf_data  # pylint: disable=import-outside-toplevel

    def source():
        ids = tf.reshape(tf.range(1, 41, dtype=tf.int32), [10, 4])
        return tf.data.Dataset.from_tensor_slices({"input_ids": ids})

    def build(batcher, **kwargs):
        cfg = input_tf_data.Input.default_config().set(
            name="input",
            is_training=False,
            source=config_for_function(lambda: source),
            processor=config_for_function(input_tf_data.identity),
            batcher=batcher,
            **kwargs,
        )
        return cfg

    single = build(config_for_function(input_tf_data.batch).set(global_batch_size=4))
    want = [b["input_ids"] for b in single.instantiate(parent=None).dataset()]
    per_process = []
    for index in range(4):
        cfg = build(
            config_for_function(input_tf_data.per_feed_batch),
            input_dispatcher=SpmdInputDispatcher.default_config().set(
                global_logical_batch_size=4, global_physical_batch_size=8
            ),
        )
        feed = cfg.instantiate(parent=None, process_index=index, process_count=4)
        assert feed.global_batch_size == 8 and feed.host_batch_size == 2
        per_process.append([b["input_ids"] for b in feed.dataset()])
    assert len({len(batches) for batches in per_process}) == 1  # Every feed ends together.
    for step, logical in enumerate(want):
        physical = np.concatenate([batches[step] for batches in per_process])
        live = physical[physical.any(axis=1)]
        np.testing.assert_array_equal(live, logical[logical.any(axis=1)])


def test_partition_by_path_rank_picks_the_first_matching_rule_by_path_and_rank():
    partition = partition_by_path_rank(
        {
            ("target_num_bytes", 1): PartitionSpec(None),
            (None, 1): PartitionSpec("fsdp"),
            (None, 2): PartitionSpec("fsdp", "seq"),
        }
    )
    mesh = create_mesh((1, 1), ("fsdp", "seq"), jax.devices()[:1])
    batch = {"input_ids": jnp.zeros((2, 4)), "target_num_bytes": jnp.zeros((2,))}
    with jax.set_mesh(mesh):
        jaxpr = jax.make_jaxpr(partition)(batch)
    constraints = [
        eqn.params["sharding"].spec
        for eqn in jaxpr.eqns
        if eqn.primitive.name == "sharding_constraint"
    ]
    # Leaves in key order: input_ids [2, 4], then target_num_bytes [2].
    assert constraints == [PartitionSpec("fsdp", "seq"), PartitionSpec(None)]
    with pytest.raises(ValueError, match="no rule for input 'x' of rank 3"):
        partition({"x": jnp.zeros((1, 1, 1))})
