"""Specification of TokenShardInput's streams: how training cuts the corpus among the rows
of a batch, and what each process reads (processes are simulated in one process)."""

import numpy as np
import pytest

from axlearn.common.config import ConfigError
from axlearn.common.input_base import InputError
from axlearn.common.input_packing import FEATURE_KEYS, pack_documents
from axlearn.common.input_token_format import write_shard
from axlearn.common.input_tokens import TokenShardInput

DOCS_PER_SHARD = 6


def _corpus(tmp_path, num_shards: int, seed: int = 0):
    """Shards of random documents: (paths, documents in corpus order, their byte counts)."""
    rng = np.random.default_rng(seed)
    paths, docs, sizes = [], [], []
    for i in range(num_shards):
        lengths = rng.integers(1, 12, DOCS_PER_SHARD)
        shard_docs = [rng.integers(3, 259, size=int(n)) for n in lengths]
        shard_sizes = [int(d.size) + int(rng.integers(0, 3)) for d in shard_docs]
        path = str(tmp_path / f"train-{i:05d}.tok")
        write_shard(path, shard_docs, shard_sizes, vocab_name="bytes", vocab_size=259, eos_id=1)
        paths.append(path)
        docs += shard_docs
        sizes += shard_sizes
    return paths, docs, sizes


def _input(paths, *, batch=4, length=8, process_index=0, process_count=1, **fields):
    cfg = TokenShardInput.default_config().set(
        name="input",
        is_training=True,
        global_batch_size=batch,
        max_sequence_length=length,
        paths=paths,
        prefetch_batches=0,
        **fields,
    )
    return cfg.instantiate(parent=None, process_index=process_index, process_count=process_count)


def _stream_documents(docs, num_streams):
    """Each stream's documents: those starting in its equal share of the token positions
    (a document of n tokens spans n + 1 positions, EOS included)."""
    lengths = np.array([d.size + 1 for d in docs])
    starts = np.cumsum(lengths) - lengths
    total = lengths.sum()
    bounds = [g * total // num_streams for g in range(num_streams + 1)]
    return [
        [i for i, s in enumerate(starts) if bounds[g] <= s < bounds[g + 1]]
        for g in range(num_streams)
    ]


@pytest.mark.parametrize("num_shards", [1, 4])
def test_each_stream_packs_its_contiguous_share_of_the_documents(tmp_path, num_shards):
    paths, docs, sizes = _corpus(tmp_path, num_shards)
    batch, length, streams = 4, 8, 2
    inp = _input(paths, batch=batch, length=length, num_streams=streams, shuffle=False)
    rows_per_stream = batch // streams
    batches = [inp.host_batch(step) for step in range(10)]
    for stream, members in enumerate(_stream_documents(docs, streams)):
        expected = pack_documents([docs[i] for i in members], [sizes[i] for i in members], length)
        num_full = expected["input_ids"].shape[0] - 1  # The last chunk wraps into epoch 2.
        assert num_full >= 2
        rows = slice(stream * rows_per_stream, (stream + 1) * rows_per_stream)
        got = {k: np.concatenate([b[k][rows] for b in batches]) for k in FEATURE_KEYS}
        for key in FEATURE_KEYS:
            np.testing.assert_array_equal(got[key][:num_full], expected[key][:num_full], key)


def test_processes_open_disjoint_shards_that_cover_the_corpus(tmp_path):
    paths, _, _ = _corpus(tmp_path, 4)
    # Equal shards, two streams: each stream's documents are exactly two whole shards.
    equal = []
    for i, path in enumerate(paths):
        docs = [np.full(5, 10 + i)] * DOCS_PER_SHARD
        write_shard(path, docs, [5] * DOCS_PER_SHARD, vocab_name="bytes", vocab_size=259, eos_id=1)
        equal.append(path)
    hosts = [_input(equal, num_streams=2, process_index=i, process_count=2) for i in range(2)]
    for host in hosts:
        for step in range(10):  # Several epochs.
            host.host_batch(step)
    opened = [set(host.opened_paths) for host in hosts]
    assert opened[0].isdisjoint(opened[1])
    assert opened[0] | opened[1] == set(equal)


@pytest.mark.parametrize("num_shards, process_count", [(1, 2), (4, 2), (4, 4)])
def test_process_rows_together_equal_the_single_process_batch(tmp_path, num_shards, process_count):
    paths, _, _ = _corpus(tmp_path, num_shards)
    whole = _input(paths, num_streams=4)
    hosts = [
        _input(paths, num_streams=4, process_index=i, process_count=process_count)
        for i in range(process_count)
    ]
    for step in range(8):  # Across epoch boundaries.
        want = whole.host_batch(step)
        parts = [host.host_batch(step) for host in hosts]
        for key in FEATURE_KEYS:
            np.testing.assert_array_equal(np.concatenate([p[key] for p in parts]), want[key])


def test_training_epoch_of_every_stream_visits_its_tokens_once(tmp_path):
    paths, docs, _ = _corpus(tmp_path, 3)
    inp = _input(paths, batch=4, length=1, num_streams=4)
    members = _stream_documents(docs, 4)
    for stream, share in enumerate(members):
        tokens = np.concatenate([np.append(docs[i], 1) for i in share])
        chunks = np.arange(tokens.size)
        got = inp.stream_features(stream, chunks)["target_labels"].ravel()
        assert sorted(got.tolist()) == sorted(tokens.tolist())


def test_default_streams_are_one_for_one_shard_else_the_most_of_min_stream_tokens(tmp_path):
    paths, docs, _ = _corpus(tmp_path, 4)
    total = sum(d.size + 1 for d in docs)
    assert _input(paths[:1], batch=8).num_streams == 1
    assert _input(paths, batch=8).num_streams == 1  # Far below the default minimum.
    fitting = [n for n in (1, 2, 4, 8) if total // n >= total // 3]
    assert _input(paths, batch=8, min_stream_tokens=total // 3).num_streams == max(fitting) == 2
    assert _input(paths, batch=8, min_stream_tokens=1).num_streams == 8


def test_evaluation_reads_one_stream_whatever_num_streams(tmp_path):
    paths, _, _ = _corpus(tmp_path, 4)
    cfg = TokenShardInput.default_config().set(
        name="eval", is_training=False, global_batch_size=4, max_sequence_length=8, paths=paths
    )
    split = cfg.clone(num_streams=4).instantiate(parent=None, process_index=0, process_count=1)
    single = cfg.clone(num_streams=1).instantiate(parent=None, process_index=0, process_count=1)
    assert split.num_streams == 1
    for a, b in zip(split.dataset(), single.dataset()):
        for key in FEATURE_KEYS:
            np.testing.assert_array_equal(a[key], b[key])


def test_num_streams_must_divide_the_global_batch(tmp_path):
    paths, _, _ = _corpus(tmp_path, 2)
    message = r"input.num_streams: 3 does not divide global_batch_size 4"
    with pytest.raises(ConfigError, match=message):
        _input(paths, num_streams=3)


def test_a_stream_without_documents_is_named(tmp_path):
    path = str(tmp_path / "long.tok")
    docs = [np.full(40, 7), np.full(2, 8)]
    write_shard(path, docs, [40, 2], vocab_name="bytes", vocab_size=259, eos_id=1)
    inp = _input([path], num_streams=4)
    with pytest.raises(InputError, match=r"input: stream 1 of 4 holds no document"):
        inp.host_batch(0)
