"""Specification of axlearn.common.input_builtin: the stdlib corpus, split, cached and packed."""

import os

import numpy as np
import pytest

from axlearn.common import input_builtin
from axlearn.common.input_base import InputError
from axlearn.common.input_builtin import (
    BuiltinTextInput,
    build_corpus_shards,
    split_of,
    stdlib_source_files,
)
from axlearn.common.input_token_format import TokenShard, TokenShardError
from axlearn.common.input_vocab import ByteVocabulary


def _make_tree(root, files):
    for relative, text in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_corpus_is_sorted_python_sources_without_tests_or_site_packages(tmp_path):
    _make_tree(
        tmp_path,
        {
            "os.py": "a",
            "json/decoder.py": "b",
            "json/__init__.py": "c",
            "json/data.txt": "d",
            "test/test_os.py": "e",
            "unittest/test/test_case.py": "f",
            "idlelib/idle_test/x.py": "g",
            "site-packages/pkg.py": "h",
            "__pycache__/os.py": "i",
        },
    )
    assert stdlib_source_files(str(tmp_path)) == ["json/__init__.py", "json/decoder.py", "os.py"]


def test_split_is_a_stable_share_of_the_stdlib():
    files = stdlib_source_files()
    validation = [f for f in files if split_of(f, 0.02) == "validation"]
    assert 0.005 * len(files) < len(validation) < 0.05 * len(files)
    assert validation == [f for f in files if split_of(f, 0.02) == "validation"]
    # Growing the fraction only moves files from train to validation.
    assert set(validation) <= {f for f in files if split_of(f, 0.1) == "validation"}


def test_splits_are_disjoint_and_cover_the_corpus(tmp_path):
    files = {f"m{i}.py": f"x = {i}\n" for i in range(40)}
    _make_tree(tmp_path / "lib", files)
    paths = build_corpus_shards(
        cache_dir=str(tmp_path / "cache"), validation_fraction=0.3, root=str(tmp_path / "lib")
    )
    vocab = ByteVocabulary()
    texts = {}
    for split, path in paths.items():
        shard = TokenShard(path)
        starts = np.concatenate([[0], shard.doc_ends[:-1]])
        texts[split] = [vocab.decode(shard.tokens[s:e]) for s, e in zip(starts, shard.doc_ends)]
    assert texts["train"] and texts["validation"]
    assert sorted(texts["train"] + texts["validation"]) == sorted(files.values())
    for name, text in files.items():
        assert text in texts[split_of(name, 0.3)]


def test_second_build_reuses_the_cache_and_a_changed_file_rebuilds(tmp_path, monkeypatch):
    _make_tree(tmp_path / "lib", {f"m{i}.py": "pass\n" for i in range(60)})
    kwargs = dict(
        cache_dir=str(tmp_path / "cache"), validation_fraction=0.2, root=str(tmp_path / "lib")
    )
    first = build_corpus_shards(**kwargs)

    def no_writes(*args, **kw):
        raise AssertionError("the cache was rebuilt")

    with monkeypatch.context() as patch:
        patch.setattr(input_builtin, "write_shard", no_writes)
        assert build_corpus_shards(**kwargs) == first
    (tmp_path / "lib" / "m0.py").write_text("changed = True\n")
    assert build_corpus_shards(**kwargs) != first


def test_empty_split_names_the_corpus(tmp_path):
    _make_tree(tmp_path / "lib", {"only.py": "pass\n"})
    message = r"lib: the built-in corpus's '(train|validation)' split is empty"
    with pytest.raises(InputError, match=message):
        build_corpus_shards(
            cache_dir=str(tmp_path / "cache"), validation_fraction=0.0, root=str(tmp_path / "lib")
        )


def _builtin(tmp_path, **kwargs):
    cfg = BuiltinTextInput.default_config().set(
        name="builtin",
        global_batch_size=4,
        max_sequence_length=256,
        cache_dir=str(tmp_path),
        **kwargs,
    )
    return cfg.instantiate(parent=None)


def test_training_batches_are_stdlib_bytes(tmp_path):
    batch = next(iter(_builtin(tmp_path, is_training=True, model_vocab_size=384)))
    assert batch["input_ids"].shape == (4, 256)
    # Byte ids: every live target is a byte (>= 3) or EOS (1).
    live = batch["target_labels"][batch["input_segment_ids"] > 0]
    assert np.all((live == 1) | ((live >= 3) & (live < 259)))
    assert batch["target_num_bytes"].sum() > 0


def test_validation_is_a_finite_padded_pass(tmp_path):
    batches = list(_builtin(tmp_path, is_training=False, split="validation").dataset())
    assert batches and all(b["input_ids"].shape == (4, 256) for b in batches)
    total_bytes = sum(int(b["target_num_bytes"].sum()) for b in batches)
    root = input_builtin.stdlib_dir()
    files = [f for f in stdlib_source_files() if split_of(f, 0.02) == "validation"]
    assert total_bytes == sum(os.path.getsize(os.path.join(root, f)) for f in files)


def test_model_vocabulary_smaller_than_bytes_is_rejected(tmp_path):
    message = "vocabulary 'bytes' has 259 ids, more than the model's vocab_size 256"
    with pytest.raises(TokenShardError, match=message):
        _builtin(tmp_path, is_training=True, model_vocab_size=256)
