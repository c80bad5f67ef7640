"""Specification of axlearn.common.input_fake: synthetic batches for benchmarks."""

import numpy as np
import pytest

from axlearn.common.config import ConfigError
from axlearn.common.input_fake import FakeLmInput


def _fake(*, is_training=True, batch=4, length=16, vocab_size=50, **kwargs):
    process = {k: kwargs.pop(k) for k in ("process_index", "process_count") if k in kwargs}
    cfg = FakeLmInput.default_config().set(
        name="fake",
        is_training=is_training,
        global_batch_size=batch,
        max_sequence_length=length,
        vocab_size=vocab_size,
        **kwargs,
    )
    return cfg.instantiate(parent=None, **process)


def test_batches_have_the_shared_keys_shapes_and_dtypes():
    batch = next(iter(_fake()))
    assert {k: (v.shape, v.dtype) for k, v in batch.items()} == {
        "input_ids": ((4, 16), np.int32),
        "target_labels": ((4, 16), np.int32),
        "input_segment_ids": ((4, 16), np.int32),
        "input_positions": ((4, 16), np.int32),
        "target_num_bytes": ((4,), np.int32),
    }


def test_targets_are_the_next_tokens_and_ids_avoid_special_tokens():
    batch = next(iter(_fake()))
    np.testing.assert_array_equal(batch["input_ids"][:, 1:], batch["target_labels"][:, :-1])
    assert batch["input_ids"].min() >= 3 and batch["input_ids"].max() < 50
    np.testing.assert_array_equal(batch["input_positions"][0], np.arange(16))


def test_tokens_are_roughly_uniform():
    batch = next(iter(_fake(batch=64, length=256, vocab_size=13)))
    counts = np.bincount(batch["input_ids"].ravel(), minlength=13)[3:]
    expected = batch["input_ids"].size / 10
    assert np.all(np.abs(counts - expected) < 0.1 * expected)


def test_batches_are_deterministic_per_seed_and_differ_per_step():
    a, b = iter(_fake(seed=1)), iter(_fake(seed=1))
    first_a, first_b = next(a), next(b)
    np.testing.assert_array_equal(first_a["input_ids"], first_b["input_ids"])
    assert not np.array_equal(first_a["input_ids"], next(a)["input_ids"])
    assert not np.array_equal(first_a["input_ids"], next(iter(_fake(seed=2)))["input_ids"])


def test_restored_iterator_continues_exactly():
    it = iter(_fake())
    expected = [next(it) for _ in range(6)]
    first = _fake()
    batches = iter(first)
    for _ in range(4):
        next(batches)
    restored = _fake()
    restored.set_state(first.get_state())
    resumed = iter(restored)
    for want in expected[4:]:
        np.testing.assert_array_equal(next(resumed)["input_ids"], want["input_ids"])


def test_process_slices_tile_the_global_batch():
    whole = next(iter(_fake()))
    parts = [next(iter(_fake(process_index=i, process_count=2))) for i in range(2)]
    for key in whole:
        np.testing.assert_array_equal(np.concatenate([p[key] for p in parts]), whole[key])


def test_eval_yields_a_fixed_number_of_batches_each_pass():
    fake = _fake(is_training=False, num_eval_batches=3)
    assert len(list(fake.dataset())) == 3 and len(list(fake.dataset())) == 3


def test_indivisible_batch_is_rejected():
    message = "global batch size 3 is not divisible by the process count 2"
    with pytest.raises(ConfigError, match=message):
        next(iter(_fake(batch=3, process_index=0, process_count=2)))
