"""Specification of TokenShardMixtureInput: rows drawn from several token shard sources
by weight, deterministic, resumable, and the same however many processes read it."""

import json
import math

import numpy as np
import pytest

from axlearn.common.config import ConfigError
from axlearn.common.input_base import InputError
from axlearn.common.input_mixture import TokenShardMixtureInput, token_shard_mixture
from axlearn.common.input_packing import FEATURE_KEYS
from axlearn.common.input_token_format import write_shard
from axlearn.common.input_tokens import TokenShardInput, build_token_shards
from axlearn.common.input_vocab import ByteVocabulary

BATCH, LENGTH = 8, 8


def _texts(letters: str, count: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    return ["".join(rng.choice(list(letters), size=int(n))) for n in rng.integers(3, 20, count)]


@pytest.fixture(name="sources", scope="module")
def fixture_sources(tmp_path_factory):
    """Two corpora of disjoint alphabets, a to m and n to z, as shard globs."""
    directory = tmp_path_factory.mktemp("mixture")
    globs = []
    for name, letters, seed in (("am", "abcdefghijklm", 0), ("nz", "nopqrstuvwxyz", 1)):
        prefix = str(directory / name)
        build_token_shards(_texts(letters, 40, seed), vocab=ByteVocabulary(), output_prefix=prefix)
        globs.append(f"{prefix}-*.tok")
    return globs


def _mixture(sources, weights=(3, 1), *, process_index=0, process_count=1, **fields):
    cfg = token_shard_mixture(
        list(zip(sources, weights)),
        name="mixture",
        global_batch_size=BATCH,
        max_sequence_length=LENGTH,
        prefetch_batches=0,
        **fields,
    )
    return cfg.instantiate(parent=None, process_index=process_index, process_count=process_count)


def _take(inp, n):
    batches = inp.dataset()
    return [next(batches) for _ in range(n)]


def _assert_same(a, b):
    for key in FEATURE_KEYS:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)


def _row_alphabet(targets: np.ndarray) -> str:
    """'am' or 'nz': the corpus a row's letters come from (EOS, id 1, aside)."""
    letters = {chr(t - 3) for t in targets if t > 2}  # Byte ids are byte + 3.
    assert letters and (letters <= set("abcdefghijklm") or letters <= set("nopqrstuvwxyz"))
    return "am" if letters <= set("abcdefghijklm") else "nz"


def test_same_seed_gives_the_same_batches_and_another_seed_others(sources):
    first, again = _take(_mixture(sources, seed=5), 6), _take(_mixture(sources, seed=5), 6)
    for a, b in zip(first, again):
        _assert_same(a, b)
    other = _take(_mixture(sources, seed=6), 6)
    assert any(not np.array_equal(a["input_ids"], b["input_ids"]) for a, b in zip(first, other))


def test_rows_follow_the_weights_within_a_binomial_bound(sources):
    steps = 150
    batches = _take(_mixture(sources, (3, 1)), steps)
    rows = [_row_alphabet(row) for batch in batches for row in batch["target_labels"]]
    n, p = len(rows), 0.75
    bound = 5 * math.sqrt(n * p * (1 - p))
    assert abs(rows.count("am") - n * p) < bound


def test_each_source_is_consumed_in_order_without_skipping(sources):
    mixed = _take(_mixture(sources), 20)
    for index, glob in enumerate(sources):
        alone = TokenShardInput.default_config().set(
            name="alone", is_training=True, global_batch_size=BATCH, max_sequence_length=LENGTH,
            paths=[glob], prefetch_batches=0,
        ).instantiate(parent=None, process_index=0, process_count=1)
        alphabet = ("am", "nz")[index]
        taken = np.concatenate(
            [
                b["input_ids"][[_row_alphabet(row) == alphabet for row in b["target_labels"]]]
                for b in mixed
            ]
        )
        own = np.concatenate([alone.host_batch(step)["input_ids"] for step in range(20)])
        np.testing.assert_array_equal(taken, own[: len(taken)])


def test_restored_mixture_continues_bit_exactly(sources):
    uninterrupted = _take(_mixture(sources), 12)
    first = _mixture(sources)
    _take(first, 7)
    state = json.loads(json.dumps(first.get_state()))
    assert state["batches_consumed"] == 7
    restored = _mixture(sources)
    restored.set_state(state)
    for want, got in zip(uninterrupted[7:], _take(restored, 5)):
        _assert_same(got, want)


def test_process_rows_together_equal_the_single_process_batch(sources):
    whole = _take(_mixture(sources), 5)
    hosts = [_take(_mixture(sources, process_index=i, process_count=2), 5) for i in range(2)]
    for step, want in enumerate(whole):
        got = {k: np.concatenate([hosts[0][step][k], hosts[1][step][k]]) for k in FEATURE_KEYS}
        _assert_same(got, want)


def test_a_mixture_is_for_training_only(sources):
    cfg = token_shard_mixture(
        [(sources[0], 1.0)], name="mixture", global_batch_size=BATCH, max_sequence_length=LENGTH
    ).set(is_training=False)
    with pytest.raises(ConfigError, match=r"mixture.is_training: a mixture is a training input"):
        cfg.instantiate(parent=None)


@pytest.mark.parametrize(
    "weights, message", [((1,), "2 sources and 1 weights"), ((1, 0), "must all be > 0")]
)
def test_weights_are_one_positive_number_per_source(sources, weights, message):
    cfg = TokenShardMixtureInput.default_config().set(
        name="mixture", is_training=True, global_batch_size=BATCH, max_sequence_length=LENGTH,
        sources=[TokenShardInput.default_config().set(paths=[s]) for s in sources],
        weights=list(weights),
    )
    with pytest.raises(ConfigError, match=message):
        cfg.instantiate(parent=None)


def test_a_source_with_its_own_batch_shape_is_rejected(sources):
    own = TokenShardInput.default_config().set(paths=[sources[1]], max_sequence_length=16)
    message = r"mixture.sources\[1\].max_sequence_length=16 differs from the mixture's 8"
    with pytest.raises(ConfigError, match=message):
        _mixture([sources[0], own])


def test_sources_of_different_vocabularies_are_rejected(sources, tmp_path):
    other = str(tmp_path / "other-00000.tok")
    write_shard(other, [np.array([5, 6, 7])], [3], vocab_name="other", vocab_size=300, eos_id=1)
    with pytest.raises(ConfigError, match=r"mixture.sources\[1\]: shards of vocabulary"):
        _mixture([sources[0], other])


def test_a_state_without_source_chunks_is_rejected(sources):
    with pytest.raises(InputError, match="source_chunks"):
        _mixture(sources).set_state({"batches_consumed": 3})
