"""`python -m axlearn.bench --input_only` and `--compare_data_dirs`: the training input of a
named config measured alone, and one config run on two data directories."""

import json

import numpy as np
import pytest

from axlearn import bench
from axlearn.common.input_tokens import build_token_shards
from axlearn.common.input_vocab import ByteVocabulary

SMALL_BATCH = (
    "--config_override=input.global_batch_size=4",
    "--config_override=input.max_sequence_length=64",
)


@pytest.fixture(name="data_dir")
def fixture_data_dir(tmp_path):
    """A data directory of byte-vocabulary shards (train and validation)."""
    texts = [f"document {i}: " + "some words of text " * (i % 7 + 1) for i in range(200)]
    for split in ("train", "validation"):
        build_token_shards(texts, vocab=ByteVocabulary(), output_prefix=str(tmp_path / "data" / split))
    return tmp_path / "data"


def test_input_only_reads_this_process_s_rows_of_the_shards(data_dir, tmp_path):
    out = tmp_path / "input.json"
    bench.main([
        "--config=gpt_test", f"--data_dir={data_dir}", "--input_only", "--steps=5",
        "--warmup_steps=1", *SMALL_BATCH, f"--json_out={out}",
    ])
    result = json.loads(out.read_text())
    # The whole batch of one process: 4 sequences of 64 tokens.
    assert result["tokens_per_batch"] == 4 * 64
    assert result["data_dir"] == str(data_dir)
    rate = result["input_tokens_per_s_per_process"]
    np.testing.assert_allclose(rate, result["batches_per_s"] * 4 * 64, rtol=1e-9)
    np.testing.assert_allclose(result["avg_batch_ms"], 1000 / result["batches_per_s"], rtol=1e-9)
    assert rate > 0


def test_input_only_table_shows_the_input_columns(capsys):
    bench.main(["--config=gpt_test", "--data_dir=FAKE", "--input_only", "--steps=3", "--warmup_steps=1", *SMALL_BATCH])
    table = capsys.readouterr().out
    assert "Input tokens/s/process" in table and "Tokens/batch/process" in table
    assert "MFU" not in table


def test_compare_data_dirs_runs_the_config_on_each_directory_in_rounds(data_dir, monkeypatch):
    calls = []

    def fake_run(tree, argv, *, xla_flags=""):
        del tree, xla_flags
        calls.append(list(argv))
        fake = "--data_dir=FAKE" in argv
        return {"tokens_per_s_per_device": 100.0 if fake else 97.0, "avg_step_time_s": 1.0}

    monkeypatch.setattr(bench, "_run_in_tree", fake_run)
    bench.main(["--config=gpt_test", f"--compare_data_dirs=FAKE,{data_dir}", "--rounds=2", *SMALL_BATCH])
    data_flags = [[a for a in argv if a.startswith("--data_dir=")] for argv in calls]
    # A B, then B A; each side names its own data directory and nothing else does.
    assert data_flags == [["--data_dir=FAKE"], [f"--data_dir={data_dir}"],
                          [f"--data_dir={data_dir}"], ["--data_dir=FAKE"]]


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--compare_data_dirs=FAKE"], "two different data directories"),
        (["--compare_data_dirs=FAKE,FAKE"], "two different data directories"),
        (["--compare_data_dirs=FAKE,BUILTIN", "--compare_dirs=a,b"], "at most one of"),
        (["--input_only", "--profile_dir=/tmp/p"], "--input_only runs no device step"),
        (["--compare_data_dirs=FAKE,/no/such/dir"], "/no/such/dir"),
    ],
)
def test_data_comparisons_reject_what_they_cannot_do(flags, message, capsys):
    with pytest.raises(SystemExit):
        bench.main(["--config=gpt_test", *flags])
    assert message in capsys.readouterr().err
