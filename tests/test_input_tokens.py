"""Specification of the TF-free token path: shard format, TokenShardInput and the build command."""

import json
import os

import jax
import numpy as np
import pytest

from axlearn.common.input_base import InputError
from axlearn.common.input_packing import FEATURE_KEYS, pack_documents
from axlearn.common.input_prefetch import prefetch_in_thread
from axlearn.common.input_token_format import HEADER_SIZE, TokenShard, TokenShardError, write_shard
from axlearn.common.input_tokens import TokenShardInput, build_token_shards, main
from axlearn.common.input_vocab import ByteVocabulary

DOCS = [[5, 6, 7], [8], [9, 10]]
DOC_BYTES = [3, 1, 2]


def _write(tmp_path, docs=DOCS, sizes=DOC_BYTES, name="s.tok", vocab_size=259, vocab_name="bytes"):
    path = str(tmp_path / name)
    write_shard(
        path,
        [np.array(d) for d in docs],
        sizes,
        vocab_name=vocab_name,
        vocab_size=vocab_size,
        eos_id=1,
    )
    return path


def _input(paths, *, is_training, batch=2, length=4, **kwargs):
    process = {k: kwargs.pop(k) for k in ("process_index", "process_count") if k in kwargs}
    cfg = TokenShardInput.default_config().set(
        name="input",
        is_training=is_training,
        global_batch_size=batch,
        max_sequence_length=length,
        paths=paths,
        **kwargs,
    )
    return cfg.instantiate(parent=None, **process)


def _random_docs(seed, num_docs=12, max_len=9):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, max_len, size=num_docs)
    docs = [rng.integers(3, 259, size=int(n)).tolist() for n in lengths]
    return docs, [len(d) + int(rng.integers(0, 3)) for d in docs]


def _stack(batches):
    return {k: np.concatenate([b[k] for b in batches]) for k in batches[0]}


# ----- the shard format -----


def test_shard_round_trips_documents_with_eos(tmp_path):
    shard = TokenShard(_write(tmp_path))
    assert shard.tokens.tolist() == [5, 6, 7, 1, 8, 1, 9, 10, 1]
    assert shard.doc_ends.tolist() == [4, 6, 9]
    assert shard.doc_bytes.tolist() == [3, 1, 2]
    header = shard.header
    assert (header.vocab_name, header.vocab_size, header.num_docs) == ("bytes", 259, 3)
    assert header.itemsize == 2


def test_large_vocabularies_use_four_byte_tokens(tmp_path):
    shard = TokenShard(_write(tmp_path, docs=[[70000, 3]], sizes=[9], vocab_size=100_000))
    assert shard.header.itemsize == 4 and shard.tokens.tolist() == [70000, 3, 1]


def test_missing_shard_names_the_file(tmp_path):
    with pytest.raises(TokenShardError, match="nope.tok: token shard file does not exist"):
        _input([str(tmp_path / "nope.tok")], is_training=True)


def test_glob_matching_nothing_names_the_pattern(tmp_path):
    with pytest.raises(TokenShardError, match=r"x-\*\.tok: no token shard files match"):
        _input([str(tmp_path / "x-*.tok")], is_training=True)


def test_wrong_magic_is_rejected(tmp_path):
    path = tmp_path / "junk.tok"
    path.write_bytes(b"not a shard" * 20)
    with pytest.raises(TokenShardError, match=r"junk.tok: not an axlearn token shard"):
        TokenShard(str(path))


def test_corrupt_header_is_rejected(tmp_path):
    path = _write(tmp_path)
    data = bytearray(open(path, "rb").read())
    data[30] ^= 0xFF  # Inside the token count.
    open(path, "wb").write(bytes(data))
    with pytest.raises(TokenShardError, match=r"s.tok: corrupt token shard header"):
        TokenShard(path)


def test_truncated_shard_is_rejected(tmp_path):
    path = _write(tmp_path)
    data = open(path, "rb").read()
    open(path, "wb").write(data[:-8])
    with pytest.raises(TokenShardError, match=r"s.tok: file has .* bytes; .* implies"):
        TokenShard(path)


def test_corrupt_payload_fails_the_checksum(tmp_path):
    path = _write(tmp_path)
    data = bytearray(open(path, "rb").read())
    data[HEADER_SIZE] ^= 0x01
    open(path, "wb").write(bytes(data))
    with pytest.raises(TokenShardError, match=r"s.tok: corrupt token shard payload"):
        TokenShard(path)


def test_vocabulary_name_mismatch_is_rejected(tmp_path):
    path = _write(tmp_path)
    message = r"s.tok: tokenized with vocabulary 'bytes', but the model expects 'spm.model'"
    with pytest.raises(TokenShardError, match=message):
        _input([path], is_training=True, vocab_name="spm.model")


def test_vocabulary_larger_than_the_model_names_the_override_that_fixes_it(tmp_path):
    path = _write(tmp_path)
    with pytest.raises(TokenShardError) as e:
        _input([path], is_training=True, model_vocab_size=256)
    assert "--config_override=model.decoder.vocab_size=259 (or larger)" in str(e.value)


def test_vocabulary_larger_than_the_model_is_rejected(tmp_path):
    path = _write(tmp_path)
    message = r"s.tok: vocabulary 'bytes' has 259 ids, more than the model's vocab_size 256"
    with pytest.raises(TokenShardError, match=message):
        _input([path], is_training=True, model_vocab_size=256)


def test_shards_of_different_vocabularies_are_rejected(tmp_path):
    a = _write(tmp_path, name="a.tok")
    b = _write(tmp_path, name="b.tok", vocab_name="other", vocab_size=300)
    with pytest.raises(TokenShardError, match="b.tok: vocabulary 'other'"):
        _input([a, b], is_training=True)


def test_empty_split_is_rejected(tmp_path):
    path = _write(tmp_path, docs=[[]], sizes=[0])
    with pytest.raises(InputError, match=r"s.tok'\] hold no documents"):
        _input([path], is_training=False)


# ----- batches -----


def test_eval_batches_follow_the_packing_contract_and_pad_the_last_batch(tmp_path):
    batches = list(_input([_write(tmp_path)], is_training=False).dataset())
    # 9 aligned positions -> 3 chunks of 4 -> 2 global batches of 2, the last padded.
    assert len(batches) == 2
    got = _stack(batches)
    expected = pack_documents(DOCS, DOC_BYTES, max_sequence_length=4)
    for key in FEATURE_KEYS:
        np.testing.assert_array_equal(got[key][:3], expected[key])
        assert not got[key][3].any()  # The padding row.
    assert got["input_ids"].shape == (4, 4) and got["target_num_bytes"].shape == (4,)


def test_eval_restarts_on_every_dataset_call(tmp_path):
    inp = _input([_write(tmp_path)], is_training=False)
    first, second = list(inp.dataset()), list(inp.dataset())
    for a, b in zip(first, second):
        np.testing.assert_array_equal(a["input_ids"], b["input_ids"])


def test_sharded_corpus_reads_like_one_shard(tmp_path):
    docs, sizes = _random_docs(1)
    single = _write(tmp_path, docs, sizes, name="single.tok")
    parts = [
        _write(tmp_path, docs[:5], sizes[:5], name="part-0.tok"),
        _write(tmp_path, docs[5:], sizes[5:], name="part-1.tok"),
    ]
    assert sorted(map(str, tmp_path.glob("part-*.tok"))) == sorted(map(str, parts))
    a = list(_input([single], is_training=False, batch=4, length=8).dataset())
    b = list(_input([str(tmp_path / "part-*.tok")], is_training=False, batch=4, length=8).dataset())
    for key in FEATURE_KEYS:
        np.testing.assert_array_equal(_stack(a)[key], _stack(b)[key])


def test_training_epoch_visits_every_token_once(tmp_path):
    # 3 + 1 documents of lengths 4, 2, 3 + 3 with EOS = 12 positions = 3 batches of 2 x 2.
    docs, sizes = [[5, 6, 7], [8], [9, 10], [11, 12]], [3, 1, 2, 2]
    inp = _input([_write(tmp_path, docs, sizes)], is_training=True, batch=2, length=2)
    batches = inp.dataset()
    epoch = _stack([next(batches) for _ in range(3)])
    stored = TokenShard(str(tmp_path / "s.tok")).tokens
    assert sorted(epoch["target_labels"].ravel().tolist()) == sorted(stored.tolist())


def test_training_order_is_seeded(tmp_path):
    docs, sizes = _random_docs(2, num_docs=30)
    path = _write(tmp_path, docs, sizes)

    def first_batches(seed):
        it = _input([path], is_training=True, seed=seed, length=8).dataset()
        return _stack([next(it) for _ in range(4)])["input_ids"]

    np.testing.assert_array_equal(first_batches(0), first_batches(0))
    assert not np.array_equal(first_batches(0), first_batches(1))


def test_restored_iterator_continues_exactly(tmp_path):
    docs, sizes = _random_docs(3)
    path = _write(tmp_path, docs, sizes)
    uninterrupted = _input([path], is_training=True, batch=4, length=8).dataset()
    expected = [next(uninterrupted) for _ in range(12)]  # Several epochs.

    first = _input([path], is_training=True, batch=4, length=8)
    batches = first.dataset()
    for _ in range(7):
        next(batches)
    state = json.loads(json.dumps(first.get_state()))
    restored = _input([path], is_training=True, batch=4, length=8)
    restored.set_state(state)
    resumed = restored.dataset()
    for want in expected[7:]:
        got = next(resumed)
        for key in FEATURE_KEYS:
            np.testing.assert_array_equal(got[key], want[key])


@pytest.mark.parametrize("is_training", [True, False])
def test_process_slices_tile_the_global_batch(tmp_path, is_training):
    docs, sizes = _random_docs(4)
    path = _write(tmp_path, docs, sizes)
    whole = _input([path], is_training=is_training, batch=4, length=8).dataset()
    hosts = [
        _input(
            [path], is_training=is_training, batch=4, length=8, process_index=i, process_count=2
        ).dataset()
        for i in range(2)
    ]
    for _ in range(3):
        want = next(whole)
        parts = [next(h) for h in hosts]
        assert parts[0]["input_ids"].shape == (2, 8)
        for key in FEATURE_KEYS:
            np.testing.assert_array_equal(np.concatenate([p[key] for p in parts]), want[key])


def test_element_spec_describes_the_global_batch(tmp_path):
    inp = _input(
        [_write(tmp_path)], is_training=True, batch=4, length=8, process_index=1, process_count=2
    )
    spec = inp.element_spec()
    assert spec["input_ids"] == jax.ShapeDtypeStruct((4, 8), np.int32)
    assert spec["target_num_bytes"] == jax.ShapeDtypeStruct((4,), np.int32)
    assert next(inp.dataset())["input_ids"].shape == (2, 8)


def test_bad_state_is_rejected(tmp_path):
    inp = _input([_write(tmp_path)], is_training=True)
    with pytest.raises(InputError, match="batches_consumed"):
        inp.set_state({"step": 3})


# ----- building shards -----


def test_build_command_tokenizes_text_and_json_lines(tmp_path, capsys):
    text = tmp_path / "a.txt"
    text.write_text("héllo\nworld", encoding="utf-8")
    lines = tmp_path / "b.jsonl"
    lines.write_text(json.dumps({"text": "one"}) + "\n\n" + json.dumps({"text": "two"}) + "\n")
    main(["build", "--vocab=bytes", f"--output={tmp_path}/out/train", str(text), str(lines)])
    shard = TokenShard(str(tmp_path / "out" / "train-00000.tok"))
    vocab = ByteVocabulary()
    starts = np.concatenate([[0], shard.doc_ends[:-1]])
    texts = [vocab.decode(shard.tokens[s:e]) for s, e in zip(starts, shard.doc_ends)]
    assert texts == ["héllo\nworld", "one", "two"]
    assert shard.doc_bytes.tolist() == [12, 3, 3]
    assert "3 documents" in capsys.readouterr().out


def test_build_splits_output_into_shards(tmp_path):
    paths = build_token_shards(
        ["abcd", "efgh", "ij"],
        vocab=ByteVocabulary(),
        output_prefix=str(tmp_path / "t"),
        tokens_per_shard=5,
    )
    assert [os.path.basename(p) for p in paths] == ["t-00000.tok", "t-00001.tok", "t-00002.tok"]


def test_newline_replacement_keeps_original_byte_counts(tmp_path):
    (path,) = build_token_shards(
        ["a\nb"],
        vocab=ByteVocabulary(),
        output_prefix=str(tmp_path / "t"),
        replace_newlines_with="<n>",
    )
    shard = TokenShard(path)
    assert ByteVocabulary().decode(shard.tokens) == "a<n>b" and shard.doc_bytes.tolist() == [3]


def test_bad_json_line_names_file_and_line(tmp_path):
    lines = tmp_path / "b.jsonl"
    lines.write_text(json.dumps({"text": "ok"}) + "\n" + json.dumps({"body": "x"}) + "\n")
    message = r"b.jsonl:2: expected an object with a string field 'text'"
    with pytest.raises(InputError, match=message):
        main(["build", f"--output={tmp_path}/t", str(lines)])


def test_missing_text_file_is_named(tmp_path):
    with pytest.raises(InputError, match="missing.txt: input text file does not exist"):
        main(["build", f"--output={tmp_path}/t", str(tmp_path / "missing.txt")])


# ----- prefetching -----


def test_thread_prefetch_yields_everything_in_order():
    assert list(prefetch_in_thread(iter(range(100)), 3)) == list(range(100))


def test_thread_prefetch_reraises_producer_errors():
    def failing():
        yield 1
        raise RuntimeError("broken shard")

    items = prefetch_in_thread(failing(), 2)
    assert next(items) == 1
    with pytest.raises(RuntimeError, match="broken shard"):
        next(items)
