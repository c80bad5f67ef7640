"""Specification of `--data_dir` on token shards: any named config trains and evaluates on
a directory (or glob, or weighted list) of shards at its own batch shape; a path that
holds none is an error naming it, except as the TFDS directory of tf.data inputs."""

import json
import math
import re
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest

from axlearn.common import file_system
from axlearn.common.config import ConfigError
from axlearn.common.experiment_registry import build_named_config
from axlearn.common.input_mixture import TokenShardMixtureInput
from axlearn.common.input_tokens import TokenShardInput, build_token_shards
from axlearn.common.input_vocab import ByteVocabulary
from axlearn.common.launch_data import missing_input_packages
from axlearn.common.launch_trainer import build_trainer_config
from tests.fresh_python import REPO, fresh_env


def _texts(count: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    words = ["tee", "fairway", "rough", "green", "hole", "putt"]
    return [" ".join(rng.choice(words, size=int(n))) for n in rng.integers(3, 30, count)]


def _build(prefix, texts) -> list[str]:
    return build_token_shards(
        texts, vocab=ByteVocabulary(), output_prefix=str(prefix), tokens_per_shard=400
    )


@pytest.fixture(name="data_dir")
def fixture_data_dir(tmp_path):
    """DIR/train-*.tok and DIR/validation-*.tok, as `build --output=DIR/train` writes."""
    _build(tmp_path / "data" / "train", _texts(60, seed=0))
    _build(tmp_path / "data" / "validation", _texts(12, seed=1))
    return tmp_path / "data"


def _inputs(cfg):
    return [("input", cfg.input)] + [(name, e.input) for name, e in cfg.evalers.items()]


@pytest.mark.parametrize("config_name", ["gpt_test", "golf_baseline"])
def test_shards_replace_every_input_in_the_configs_batch_shapes(data_dir, config_name):
    original = build_named_config(config_name)
    cfg = build_trainer_config(config_name=config_name, data_dir=str(data_dir))
    assert cfg.input.klass is TokenShardInput
    assert cfg.input.paths == [f"{data_dir}/train-*.tok"] and cfg.input.is_training
    for name, evaler in cfg.evalers.items():
        assert evaler.input.klass is TokenShardInput
        assert evaler.input.paths == [f"{data_dir}/validation-*.tok"]
        assert not evaler.input.is_training
    for (_, got), (_, was) in zip(_inputs(cfg), _inputs(original)):
        assert got.global_batch_size == was.global_batch_size
        assert got.max_sequence_length == was.max_sequence_length
        assert got.model_vocab_size == cfg.model.decoder.vocab_size


def test_train_and_validation_subdirectories_are_read(tmp_path):
    _build(tmp_path / "train" / "part", _texts(20, seed=0))
    _build(tmp_path / "validation" / "part", _texts(5, seed=1))
    cfg = build_trainer_config(config_name="gpt_test", data_dir=str(tmp_path))
    assert cfg.input.paths == [f"{tmp_path}/train/*.tok"]
    assert cfg.evalers["validation"].input.paths == [f"{tmp_path}/validation/*.tok"]


def test_tf_data_configs_read_a_directory_of_shards_too(data_dir):
    cfg = build_trainer_config(config_name="gpt_1b", data_dir=str(data_dir))
    assert cfg.input.klass is TokenShardInput
    assert cfg.evalers["openwebtext_2"].input.paths == [f"{data_dir}/validation-*.tok"]
    assert missing_input_packages(cfg) == (None, [])


def test_a_directory_without_shards_stays_the_tfds_directory_of_tf_data_inputs(tmp_path):
    cfg = build_trainer_config(config_name="gpt_1b", data_dir=str(tmp_path))
    assert cfg.input.source.data_dir == str(tmp_path)
    assert cfg.evalers["openwebtext_2"].input.source.data_dir == str(tmp_path)


def test_a_nonexistent_path_is_an_error_naming_it(tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(ConfigError, match=f"--data_dir={missing}: {missing} does not exist"):
        build_trainer_config(config_name="gpt_test", data_dir=str(missing))


@pytest.mark.slow
def test_main_job_stops_on_a_nonexistent_data_dir_with_one_line_naming_it(tmp_path):
    missing = tmp_path / "nowhere"
    result = subprocess.run(
        [
            sys.executable, "-m", "axlearn.common.launch_trainer_main", "--config=gpt_test",
            f"--data_dir={missing}", f"--trainer_dir={tmp_path / 'run'}",
        ],
        env=fresh_env(1), cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 1 and "Traceback" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"launch_trainer_main: --data_dir={missing}: {missing} does not exist")
    assert not (tmp_path / "run").exists()


def test_a_directory_without_shards_is_an_error_naming_it_and_the_layout(tmp_path):
    message = f"{tmp_path} holds no token shards: expected {tmp_path}/train-*.tok or"
    with pytest.raises(ConfigError, match=re.escape(message)):
        build_trainer_config(config_name="golf_baseline", data_dir=str(tmp_path))


def test_a_glob_matching_no_shards_is_an_error_naming_it(tmp_path):
    pattern = f"{tmp_path}/x-*.tok"
    with pytest.raises(ConfigError, match=re.escape(f"{pattern} matches no token shard files")):
        build_trainer_config(config_name="gpt_1b", data_dir=pattern)


def test_validation_shards_without_training_shards_are_an_error(tmp_path):
    _build(tmp_path / "validation", _texts(5, seed=1))
    with pytest.raises(ConfigError, match="holds validation shards .* but no training shards"):
        build_trainer_config(config_name="gpt_test", data_dir=str(tmp_path))


def test_evalers_without_validation_shards_are_an_error_unless_removed(tmp_path):
    _build(tmp_path / "corpus", _texts(20, seed=0))  # No split: every shard trains.
    message = (
        "holds no validation shards for gpt_test's evalers ['validation'] (expected "
        f"{tmp_path}/validation-*.tok or {tmp_path}/validation/*.tok)"
    )
    with pytest.raises(ConfigError, match=re.escape(message)):
        build_trainer_config(config_name="gpt_test", data_dir=str(tmp_path))
    cfg = build_trainer_config(
        config_name="gpt_test", data_dir=str(tmp_path), config_overrides=["evalers={}"]
    )
    assert cfg.input.paths == [f"{tmp_path}/*.tok"] and cfg.evalers == {}


def test_evalers_may_be_pointed_at_other_shards(data_dir):
    pattern = f"{data_dir}/train-*.tok"
    cfg = build_trainer_config(
        config_name="gpt_test",
        data_dir=pattern,
        config_overrides=[f"evalers['validation'].input.paths=['{data_dir}/validation-*.tok']"],
    )
    assert cfg.input.paths == [pattern]
    assert cfg.evalers["validation"].input.paths == [f"{data_dir}/validation-*.tok"]


def test_weighted_paths_train_on_a_mixture_and_evaluate_on_all_validation_shards(tmp_path):
    for name, seed in (("web", 0), ("code", 1)):
        _build(tmp_path / name / "train", _texts(20, seed=seed))
        _build(tmp_path / name / "validation", _texts(5, seed=seed + 10))
    cfg = build_trainer_config(
        config_name="gpt_test", data_dir=f"{tmp_path}/web:0.7,{tmp_path}/code:0.3"
    )
    assert cfg.input.klass is TokenShardMixtureInput and cfg.input.weights == [0.7, 0.3]
    assert [s.paths for s in cfg.input.sources] == [
        [f"{tmp_path}/web/train-*.tok"], [f"{tmp_path}/code/train-*.tok"],
    ]
    assert (cfg.input.global_batch_size, cfg.input.max_sequence_length) == (16, 256)
    assert cfg.evalers["validation"].input.paths == [
        f"{tmp_path}/web/validation-*.tok", f"{tmp_path}/code/validation-*.tok",
    ]


def test_several_paths_without_weights_are_an_error(data_dir):
    with pytest.raises(ConfigError, match="a mixture gives every source a weight"):
        build_trainer_config(config_name="gpt_test", data_dir=f"{data_dir},{data_dir}")


def test_a_storage_url_directory_is_read_through_file_system(data_dir):
    url = "memory://data-dir-test/corpus"
    for path in sorted(data_dir.iterdir()):
        file_system.write_bytes(f"{url}/{path.name}", path.read_bytes())
    cfg = build_trainer_config(config_name="gpt_test", data_dir=url)
    assert cfg.input.paths == [f"{url}/train-*.tok"]
    local = build_trainer_config(config_name="gpt_test", data_dir=str(data_dir))
    pairs = [(cfg.input, local.input)]
    pairs.append((cfg.evalers["validation"].input, local.evalers["validation"].input))
    for remote_cfg, local_cfg in pairs:
        remote = remote_cfg.set(name="input").instantiate(parent=None)
        want = local_cfg.set(name="input").instantiate(parent=None).host_batch(1)
        for key, value in remote.host_batch(1).items():
            np.testing.assert_array_equal(value, want[key], err_msg=key)


@pytest.mark.slow
def test_gpt_test_trains_and_evaluates_on_shards(data_dir, tmp_path):
    small = [
        "input.global_batch_size=4",
        "input.max_sequence_length=32",
        "evalers['validation'].input.global_batch_size=4",
        "evalers['validation'].input.max_sequence_length=32",
        "max_step=2",
    ]
    cfg = build_trainer_config(
        config_name="gpt_test",
        mesh_selector="cpu",
        data_dir=str(data_dir),
        config_overrides=small,
        trainer_dir=str(tmp_path / "run"),
    )
    summaries = cfg.instantiate(parent=None, devices=jax.devices()[:1]).run()
    assert np.isfinite(summaries["loss"])
    lines = (tmp_path / "run" / "summaries" / "validation" / "metrics.jsonl").read_text()
    metrics = json.loads(lines.splitlines()[-1])
    assert metrics["step"] == 2 and math.isfinite(metrics["bits_per_byte"])


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("localhost", 0))
        return probe.getsockname()[1]


def _train_on_shards(data_dir, trainer_dir, *flags: str, devices: int, background=False):
    """gpt_test for 3 steps on `data_dir`, 2 streams of 2 rows each, no evaluation."""
    command = [
        sys.executable, "-m", "axlearn.common.launch_trainer_main", "--config=gpt_test",
        f"--data_dir={data_dir}", f"--trainer_dir={trainer_dir}", "--jax_backend=cpu",
        "--config_override=input.global_batch_size=4",
        "--config_override=input.max_sequence_length=32",
        "--config_override=input.num_streams=2",
        "--config_override=evalers={}",
        "--config_override=max_step=3",
        "--config_override=log_every_n_steps=1",
        "--config_override=summary_writer.write_every_n_steps=1",
        *flags,
    ]
    env = fresh_env(devices)
    if background:
        return subprocess.Popen(
            command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def _train_losses(trainer_dir) -> dict[int, float]:
    path = trainer_dir / "summaries" / "train" / "metrics.jsonl"
    return {r["step"]: r["loss"] for r in map(json.loads, path.read_text().splitlines())}


@pytest.mark.slow
def test_two_processes_read_disjoint_shards_and_train_as_one_process_does(tmp_path):
    _build(tmp_path / "data" / "train", _texts(80, seed=0))  # Shards of ~400 tokens.
    alone = _train_on_shards(tmp_path / "data", tmp_path / "alone", devices=2)
    assert alone.returncode == 0, alone.stderr[-3000:]
    port = _free_port()
    processes = [
        _train_on_shards(
            tmp_path / "data", tmp_path / "together", f"--distributed_coordinator=localhost:{port}",
            "--num_processes=2", f"--process_id={i}", devices=1, background=True,
        )
        for i in range(2)
    ]
    outputs = [p.communicate(timeout=300)[0] for p in processes]
    for process, output in zip(processes, outputs):
        assert process.returncode == 0, output[-3000:]
    opened = [set(re.findall(r"stream \d of 2 reads (.*)", output)[0].split()) for output in outputs]
    shards = {p.name for p in (tmp_path / "data").glob("train-*.tok")}
    # Each process opens its own stream's shards only (and both the one shard that holds
    # the boundary between the streams' documents); together they cover the corpus.
    assert len(shards) >= 4 and opened[0] | opened[1] == shards
    assert len(opened[0] & opened[1]) <= 1
    reference, together = _train_losses(tmp_path / "alone"), _train_losses(tmp_path / "together")
    assert sorted(together) == [1, 2, 3]
    for step, loss in reference.items():
        assert abs(together[step] - loss) <= 1e-5 * abs(loss), (step, together[step], loss)
