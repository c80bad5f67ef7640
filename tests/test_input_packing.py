"""Specification of axlearn.common.input_packing: the packing contract, checked by hand."""

import numpy as np

from axlearn.common.input_packing import FEATURE_KEYS, byte_shares, pack_documents

# Three documents (token ids, no EOS) and the UTF-8 bytes of their texts.
DOCS = [[5, 6, 7], [8], [9, 10]]
DOC_BYTES = [3, 1, 2]


def test_documents_pack_into_eos_separated_chunks():
    packed = pack_documents(DOCS, DOC_BYTES, max_sequence_length=4)
    # Stream: EOS 5 6 7 EOS 8 EOS 9 10 EOS, chunks of 4 + 1 overlapping by one.
    np.testing.assert_array_equal(
        packed["input_ids"], [[1, 5, 6, 7], [1, 8, 1, 9], [10, 0, 0, 0]]
    )
    np.testing.assert_array_equal(
        packed["target_labels"], [[5, 6, 7, 1], [8, 1, 9, 10], [1, 0, 0, 0]]
    )


def test_segment_ids_restart_per_chunk_and_are_zero_on_padding():
    packed = pack_documents(DOCS, DOC_BYTES, max_sequence_length=4)
    np.testing.assert_array_equal(
        packed["input_segment_ids"], [[1, 1, 1, 1], [1, 1, 2, 2], [1, 0, 0, 0]]
    )


def test_positions_count_from_each_segment_start():
    packed = pack_documents(DOCS, DOC_BYTES, max_sequence_length=4)
    np.testing.assert_array_equal(
        packed["input_positions"], [[0, 1, 2, 3], [0, 1, 0, 1], [0, 0, 0, 0]]
    )


def test_target_bytes_spread_over_document_targets():
    packed = pack_documents(DOCS, DOC_BYTES, max_sequence_length=4)
    # doc0 (3 bytes, 4 targets) gives 0,1,1,1; doc1 (1 byte, 2 targets) 0,1; doc2 0,1,1.
    np.testing.assert_array_equal(packed["target_num_bytes"], [3, 2, 1])


def test_byte_shares_sum_to_document_bytes():
    rng = np.random.default_rng(0)
    for _ in range(50):
        length = int(rng.integers(1, 40))
        size = int(rng.integers(0, 200))
        shares = byte_shares(np.full(length, size), np.arange(length), np.full(length, length))
        assert shares.sum() == size and shares.min() >= 0


def test_empty_documents_are_skipped():
    with_empty = pack_documents([[], [5, 6, 7], []], [0, 3, 0], max_sequence_length=4)
    without = pack_documents([[5, 6, 7]], [3], max_sequence_length=4)
    for key in FEATURE_KEYS:
        np.testing.assert_array_equal(with_empty[key], without[key])


def test_shapes_and_dtypes():
    packed = pack_documents(DOCS, DOC_BYTES, max_sequence_length=3)
    for key in FEATURE_KEYS:
        assert packed[key].dtype == np.int32
    assert packed["input_ids"].shape == (3, 3)  # 9 aligned positions.
    assert packed["target_num_bytes"].shape == (3,)
