"""Specification of the run's data record (`data.json`): each input source's vocabulary,
shard count and header fingerprint are recorded, and a restart on other data under the
same --data_dir is refused with one line naming what changed, unless --allow_data_change.

The references are the tokenizer library (vocabulary size), hashlib (the vocabulary file's
SHA-256) and the shard files on disk (their count)."""

import glob
import hashlib
import json
import logging
import os
import pathlib
import random
import subprocess
import sys

import pytest

from axlearn.common import data_record, run_dir
from axlearn.common.checkpointer import INDEX_FILE
from axlearn.common.config import ConfigError
from axlearn.common.input_tokens import build_token_shards
from axlearn.common.input_vocab import ByteVocabulary, load_vocabulary
from axlearn.common.launch_trainer import build_trainer_config
from axlearn.common.run_dir import CHECKPOINTS
from tests.fresh_python import REPO, fresh_env

WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex bad jam".split()


def _texts(count: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12))) for _ in range(count)]


def _train_bpe(path) -> str:
    tokenizers = pytest.importorskip("tokenizers")
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=120, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False
    )
    tokenizer.train_from_iterator(_texts(300), trainer)
    tokenizer.save(str(path))
    return str(path)


def _build(prefix, vocab, count: int = 60) -> list[str]:
    return build_token_shards(
        _texts(count), vocab=vocab, output_prefix=str(prefix), tokens_per_shard=400
    )


def _described(data_dir) -> dict:
    cfg = build_trainer_config(
        config_name="gpt_test", mesh_selector="cpu", data_dir=str(data_dir),
        config_overrides=["evalers={}"],
    )
    return data_record.describe_data(cfg)


@pytest.fixture(name="bpe_file")
def fixture_bpe_file(tmp_path):
    return _train_bpe(tmp_path / "tokenizer.json")


# ----- what is recorded -----


def test_token_shards_record_the_tokenizer_its_size_and_the_shard_count(tmp_path, bpe_file):
    tokenizers = pytest.importorskip("tokenizers")
    _build(tmp_path / "data" / "train", load_vocabulary(bpe_file, any_special_ids=True))
    source = _described(tmp_path / "data")["input"]
    with open(bpe_file, "rb") as f:
        sha256 = hashlib.sha256(f.read()).hexdigest()
    assert source["vocabulary"]["name"] == "tokenizer.json"
    assert source["vocabulary"]["size"] == tokenizers.Tokenizer.from_file(bpe_file).get_vocab_size()
    assert source["vocabulary"]["sha256"] == sha256
    assert source["shards"] == len(glob.glob(str(tmp_path / "data" / "train-*.tok"))) > 1


def test_each_source_of_a_mixture_is_recorded(tmp_path):
    _build(tmp_path / "a" / "train", ByteVocabulary())
    _build(tmp_path / "b" / "train", ByteVocabulary(), count=20)
    described = _described(f"{tmp_path / 'a'}:0.7,{tmp_path / 'b'}:0.3")
    shards = [len(glob.glob(str(tmp_path / d / "train-*.tok"))) for d in "ab"]
    assert [s["shards"] for _, s in sorted(described.items())] == shards
    assert len(described) == 2 and all(p.startswith("input.") for p in described)


def test_fake_data_records_its_vocabulary_size_and_seed():
    cfg = build_trainer_config(config_name="gpt_test", mesh_selector="cpu", data_dir="FAKE")
    described = data_record.describe_data(cfg)
    assert described["input"] == {
        "kind": "fake", "vocabulary": {"size": cfg.model.decoder.vocab_size}, "seed": 0
    }
    assert set(described) == {"input", *(f"evalers['{n}'].input" for n in cfg.evalers)}


def test_builtin_data_records_the_byte_vocabulary_of_its_split(tmp_path, monkeypatch):
    monkeypatch.setenv("AXLEARN_CACHE_DIR", str(tmp_path))
    cfg = build_trainer_config(config_name="gpt_test", mesh_selector="cpu", data_dir="BUILTIN")
    source = data_record.describe_data(cfg)["input"]
    assert source["kind"] == "builtin" and source["split"] == "train"
    assert (source["vocabulary"]["name"], source["vocabulary"]["size"]) == (
        "bytes", ByteVocabulary().vocab_size
    )


# ----- comparing with the last start's -----


def _record_with_a_checkpoint(run: pathlib.Path, description: dict) -> None:
    """Records the data as a run's start does, and a committed checkpoint after it."""
    data_record.write_data_record(run_dir.RunDir(str(run)), description)
    step = run / CHECKPOINTS / "step_00000001"
    step.mkdir(parents=True)
    (step / INDEX_FILE).write_text("{}")


def test_other_data_replaces_the_record_of_a_start_that_left_no_checkpoint(tmp_path, bpe_file):
    _build(tmp_path / "data" / "train", ByteVocabulary())
    run = run_dir.RunDir(str(tmp_path / "run"))
    data_record.write_data_record(run, _described(tmp_path / "data"))
    _build(tmp_path / "data" / "train", load_vocabulary(bpe_file, any_special_ids=True))
    data_record.check_data_record(run, _described(tmp_path / "data"), allow_change=False)


def test_the_same_data_rebuilt_is_no_change(tmp_path):
    _build(tmp_path / "data" / "train", ByteVocabulary())
    _record_with_a_checkpoint(tmp_path / "run", _described(tmp_path / "data"))
    _build(tmp_path / "data" / "train", ByteVocabulary())
    data_record.check_data_record(
        run_dir.RunDir(str(tmp_path / "run")), _described(tmp_path / "data"), allow_change=False
    )


def test_data_rebuilt_with_another_vocabulary_is_refused_naming_both(tmp_path, bpe_file):
    _build(tmp_path / "data" / "train", ByteVocabulary())
    _record_with_a_checkpoint(tmp_path / "run", _described(tmp_path / "data"))
    _build(tmp_path / "data" / "train", load_vocabulary(bpe_file, any_special_ids=True))
    with pytest.raises(ConfigError, match=r"input: vocabulary 'bytes' .* -> 'tokenizer.json'"):
        data_record.check_data_record(
            run_dir.RunDir(str(tmp_path / "run")), _described(tmp_path / "data"), allow_change=False
        )


def test_more_shards_are_refused_naming_the_counts(tmp_path):
    first = _build(tmp_path / "data" / "train", ByteVocabulary())
    _record_with_a_checkpoint(tmp_path / "run", _described(tmp_path / "data"))
    _build(tmp_path / "data" / "train", ByteVocabulary(), count=120)
    later = len(glob.glob(str(tmp_path / "data" / "train-*.tok")))
    with pytest.raises(ConfigError, match=f"shards {len(first)} -> {later}"):
        data_record.check_data_record(
            run_dir.RunDir(str(tmp_path / "run")), _described(tmp_path / "data"), allow_change=False
        )


def test_a_change_allowed_is_logged_not_refused(tmp_path, bpe_file, caplog):
    _build(tmp_path / "data" / "train", ByteVocabulary())
    _record_with_a_checkpoint(tmp_path / "run", _described(tmp_path / "data"))
    _build(tmp_path / "data" / "train", load_vocabulary(bpe_file, any_special_ids=True))
    with caplog.at_level(logging.WARNING, logger="axlearn.common.data_record"):
        data_record.check_data_record(
            run_dir.RunDir(str(tmp_path / "run")), _described(tmp_path / "data"), allow_change=True
        )
    assert "the data changed since the run's last start (allowed)" in caplog.text


# ----- the launcher, in real processes -----


def _launch(data_dir, trainer_dir, *flags: str) -> subprocess.CompletedProcess:
    command = [
        sys.executable, "-m", "axlearn.common.launch_trainer_main", "--config=gpt_test",
        f"--data_dir={data_dir}", f"--trainer_dir={trainer_dir}", "--jax_backend=cpu",
        "--config_override=input.global_batch_size=2",
        "--config_override=input.max_sequence_length=16",
        "--config_override=evalers={}",
        *flags,
    ]
    return subprocess.run(
        command, cwd=REPO, env=fresh_env(1), capture_output=True, text=True, timeout=300
    )


def _build_command(data_dir, vocab: str, text_file) -> None:
    command = [
        sys.executable, "-m", "axlearn.common.input_tokens", "build", str(text_file),
        f"--vocab={vocab}", f"--output={data_dir}/train", "--num_workers=1",
        "--overwrite",  # The test rebuilds the same directory with another vocabulary.
    ]
    result = subprocess.run(
        command, cwd=REPO, env=fresh_env(), capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]


@pytest.mark.slow
def test_a_restart_on_data_rebuilt_with_another_vocabulary_is_refused_unless_allowed(
    tmp_path, bpe_file
):
    text_file = tmp_path / "corpus.txt"
    text_file.write_text("\n".join(_texts(400)))
    data_dir, trainer_dir = tmp_path / "data", tmp_path / "run"
    _build_command(data_dir, "bytes", text_file)
    first = _launch(data_dir, trainer_dir, "--config_override=max_step=2")
    assert first.returncode == 0, first.stderr[-3000:]
    recorded = json.loads((trainer_dir / run_dir.DATA_RECORD).read_text())["sources"]
    assert recorded["input"]["vocabulary"]["name"] == "bytes"

    _build_command(data_dir, bpe_file, text_file)
    refused = _launch(data_dir, trainer_dir, "--config_override=max_step=3")
    assert refused.returncode == 1
    last = refused.stderr.strip().splitlines()[-1]
    assert "data.json: the data changed since the run's last start" in last
    assert "vocabulary 'bytes'" in last and "-> 'tokenizer.json'" in last
    assert "--allow_data_change" in last

    allowed = _launch(
        data_dir, trainer_dir, "--config_override=max_step=3", "--allow_data_change"
    )
    assert allowed.returncode == 0, allowed.stderr[-3000:]
    recorded = json.loads((trainer_dir / run_dir.DATA_RECORD).read_text())["sources"]
    assert recorded["input"]["vocabulary"]["name"] == "tokenizer.json"
    assert os.path.exists(trainer_dir / "config.txt")
