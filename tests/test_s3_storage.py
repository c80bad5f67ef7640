"""Checkpoints, summaries, the config record and token shards at storage URLs.

`memory://` runs in process. `s3://` runs against a real S3-compatible server that the
module starts on the loopback interface (moto, from the `dev` extra); TensorStore's s3
driver reaches it through `AWS_ENDPOINT_URL_S3` (see `file_system`), and what lands in
the bucket is read back independently with boto3.
"""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
import zlib
from typing import Any, NamedTuple

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from tensorboard.backend.event_processing import event_accumulator

from axlearn.common import file_system
from axlearn.common.checkpointer import INDEX_FILE, Checkpointer, step_dir_name
from axlearn.common.config import ConfigError
from axlearn.common.input_token_format import TokenShardError, write_shard
from axlearn.common.input_tokens import TokenShardInput
from axlearn.common.run_dir import RunDir
from axlearn.common.run_record import check_trainer_dir, record_config
from axlearn.common.summary_writer import JSONL_FILE_NAME, SummaryWriter
from tests.fresh_python import REPO, fresh_env

# ----- the server -----


class S3Server(NamedTuple):
    client: Any  # A boto3 S3 client of the server: the independent reader and writer.
    endpoint: str


def _free_loopback_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(name="s3_server", scope="module")
def fixture_s3_server(tmp_path_factory):
    moto_server = pytest.importorskip(
        "moto.server", reason="moto[server] (the dev extra) provides the S3 test server"
    )
    boto3 = pytest.importorskip("boto3")
    port = _free_loopback_port()
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    no_profiles = tmp_path_factory.mktemp("aws") / "empty"
    no_profiles.write_text("")
    env = {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_REGION": "us-east-1",
        "AWS_ENDPOINT_URL_S3": endpoint,
        # Nothing from this machine's AWS set-up, and no instance-metadata probes.
        "AWS_CONFIG_FILE": str(no_profiles),
        "AWS_SHARED_CREDENTIALS_FILE": str(no_profiles),
        "AWS_EC2_METADATA_DISABLED": "true",
    }
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
        yield S3Server(client, endpoint)
    finally:
        server.stop()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@pytest.fixture(name="bucket")
def fixture_bucket(s3_server) -> str:
    name = f"axlearn-{uuid.uuid4().hex[:12]}"
    s3_server.client.create_bucket(Bucket=name)
    return name


def _keys(s3_server: S3Server, bucket: str, prefix: str = "") -> list[str]:
    pages = s3_server.client.get_paginator("list_objects_v2").paginate(
        Bucket=bucket, Prefix=prefix
    )
    return sorted(item["Key"] for page in pages for item in page.get("Contents", []))


def _get(s3_server: S3Server, bucket: str, key: str) -> bytes:
    return s3_server.client.get_object(Bucket=bucket, Key=key)["Body"].read()


def _download(s3_server: S3Server, bucket: str, prefix: str, local_dir) -> None:
    for key in _keys(s3_server, bucket, prefix):
        path = os.path.join(local_dir, os.path.relpath(key, prefix))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(_get(s3_server, bucket, key))


# ----- shared state and checks -----


def _state(seed: int) -> dict:
    """Leaves of the kinds a trainer state holds, from NumPy values."""
    rng = np.random.default_rng(seed)
    return {
        "model": {
            "w": jnp.asarray(rng.normal(size=(6, 5)).astype(np.float32)),
            "emb": jnp.asarray(rng.normal(size=(7, 3)).astype(ml_dtypes.bfloat16)),
        },
        "count": jnp.int32(seed),
        "host_table": rng.normal(size=(2, 2)),
    }


def _assert_state_equal(actual: dict, seed: int) -> None:
    expected = _state(seed)
    for path in [("model", "w"), ("model", "emb"), ("count",), ("host_table",)]:
        a, e = actual, expected
        for key in path:
            a, e = a[key], e[key]
        np.testing.assert_array_equal(np.asarray(a), np.asarray(e), err_msg=str(path))
        assert np.asarray(a).dtype == np.asarray(e).dtype, path


def _checkpointer(directory: str, **kwargs) -> Checkpointer:
    cfg = Checkpointer.default_config().set(name="checkpointer", dir=directory, **kwargs)
    return cfg.instantiate(parent=None)


def _write_summaries(directory: str) -> None:
    writer = SummaryWriter.default_config().set(name="summary_writer", dir=directory)
    writer = writer.instantiate(parent=None)
    for step in (1, 2, 3):
        writer(step, {"loss": 1.0 / step, "lr": np.float32(0.5), "note": f"step {step}"})
    writer.close()


# ----- memory:// in process -----


def test_checkpoint_round_trips_through_a_memory_store():
    directory = f"memory://{uuid.uuid4().hex}/checkpoints"
    with _checkpointer(directory, keep_last_n=2) as checkpointer:
        for step in (1, 2, 3):
            checkpointer.save(step, _state(step), extra={"next": step + 1})
        checkpointer.wait_until_finished()
        assert checkpointer.committed_steps() == [2, 3]
        step, restored, extra = checkpointer.restore(state=_state(0))
    assert (step, extra) == (3, {"next": 4})
    _assert_state_equal(restored, 3)


def test_summaries_round_trip_through_a_memory_store():
    directory = f"memory://{uuid.uuid4().hex}/summaries"
    _write_summaries(directory)
    lines = file_system.read_text(file_system.join(directory, JSONL_FILE_NAME)).splitlines()
    assert [json.loads(line) for line in lines] == [
        {"step": s, "loss": 1.0 / s, "lr": 0.5, "note": f"step {s}"} for s in (1, 2, 3)
    ]


def test_trainer_dir_url_no_driver_accepts_is_a_config_error():
    with pytest.raises(ConfigError, match=r"--trainer_dir=nosuch://b/run: .*not a storage URL"):
        check_trainer_dir("nosuch://b/run")


def test_checkpointer_dir_url_no_driver_accepts_is_a_config_error():
    with pytest.raises(ConfigError, match=r"checkpointer.dir='nosuch://b/ckpt': .*not a storage"):
        _checkpointer("nosuch://b/ckpt")


# ----- s3:// on the test server -----


@pytest.mark.slow
def test_files_are_objects_that_boto3_reads_and_writes(s3_server, bucket):
    root = f"s3://{bucket}/run"
    file_system.write_bytes(file_system.join(root, "a", "x.bin"), b"\x00\x01")
    file_system.write_text(file_system.join(root, "config.txt"), "max_step: 6\n")
    s3_server.client.put_object(Bucket=bucket, Key="run/a/y.bin", Body=b"from boto3")
    assert _keys(s3_server, bucket) == ["run/a/x.bin", "run/a/y.bin", "run/config.txt"]
    assert _get(s3_server, bucket, "run/a/x.bin") == b"\x00\x01"
    assert file_system.read_bytes(f"{root}/a/y.bin") == b"from boto3"
    assert file_system.listdir(root) == ["a", "config.txt"]
    assert file_system.glob(f"{root}/a/*.bin") == [f"{root}/a/x.bin", f"{root}/a/y.bin"]
    file_system.rmtree(file_system.join(root, "a"))
    assert _keys(s3_server, bucket) == ["run/config.txt"]


def test_checkpoint_saves_and_restores_on_s3(s3_server, bucket):
    with _checkpointer(f"s3://{bucket}/checkpoints") as checkpointer:
        checkpointer.save(7, _state(7), extra={"next": 8})
        checkpointer.wait_until_finished()
        step, restored, extra = checkpointer.restore(state=_state(0))
    assert (step, extra) == (7, {"next": 8})
    _assert_state_equal(restored, 7)
    # The index records what boto3 reads from the bucket, file by file.
    prefix = f"checkpoints/{step_dir_name(7)}/"
    index = json.loads(_get(s3_server, bucket, prefix + INDEX_FILE))
    keys = [key[len(prefix) :] for key in _keys(s3_server, bucket, prefix)]
    assert sorted(index["files"]) == [key for key in keys if key != INDEX_FILE]
    for name, record in index["files"].items():
        data = _get(s3_server, bucket, prefix + name)
        assert record == {"size": len(data), "crc32": zlib.crc32(data)}, name


def test_garbage_collection_deletes_old_checkpoints_from_the_bucket(s3_server, bucket):
    with _checkpointer(f"s3://{bucket}/checkpoints", keep_last_n=1) as checkpointer:
        for step in (1, 2, 3):
            checkpointer.save(step, _state(step))
        checkpointer.wait_until_finished()
    steps = {key.split("/")[1] for key in _keys(s3_server, bucket, "checkpoints/")}
    assert steps == {step_dir_name(3)}


def test_altered_object_falls_back_to_the_previous_checkpoint(s3_server, bucket):
    with _checkpointer(f"s3://{bucket}/checkpoints", keep_last_n=2) as checkpointer:
        checkpointer.save(1, _state(1))
        checkpointer.save(2, _state(2))
        checkpointer.wait_until_finished()
        key = f"checkpoints/{step_dir_name(2)}/arrays/model/w/0.0"
        data = bytearray(_get(s3_server, bucket, key))
        data[0] ^= 0x40
        s3_server.client.put_object(Bucket=bucket, Key=key, Body=bytes(data))
        step, restored, _ = checkpointer.restore(state=_state(0))
    assert step == 1
    _assert_state_equal(restored, 1)


def test_summaries_land_in_the_bucket(s3_server, bucket, tmp_path):
    _write_summaries(f"s3://{bucket}/run/summaries/train")
    _download(s3_server, bucket, "run/summaries/train/", tmp_path)
    with open(tmp_path / JSONL_FILE_NAME, encoding="utf-8") as f:
        records = [json.loads(line) for line in f]
    assert [(r["step"], r["loss"]) for r in records] == [(1, 1.0), (2, 0.5), (3, 1.0 / 3)]
    # TensorBoard's own reader reads the event file from the bucket.
    acc = event_accumulator.EventAccumulator(str(tmp_path))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("loss")] == [
        (1, 1.0),
        (2, 0.5),
        (3, pytest.approx(1.0 / 3)),
    ]


def test_config_record_is_kept_in_the_bucket(s3_server, bucket):
    trainer_dir = f"s3://{bucket}/run"
    text = "klass: 'a.Trainer'\nmax_step: 6\nmodel.dim: 8\n"
    record_config(RunDir(trainer_dir), text, allow_change=False, write=True)
    assert _get(s3_server, bucket, "run/config.txt") == text.encode()
    # Once the run has a checkpoint, a change that may not happen between restarts is refused.
    file_system.write_text(f"{trainer_dir}/checkpoints/step_00000002/index.json", "{}")
    changed = text.replace("dim: 8", "dim: 16")
    with pytest.raises(ConfigError, match=r"run/config.txt: the config changed .* model.dim"):
        record_config(RunDir(trainer_dir), changed, allow_change=False, write=True)


def _write_shards(directory) -> list[str]:
    rng = np.random.default_rng(0)
    paths = []
    for i in range(2):
        docs = [rng.integers(3, 200, size=n) for n in rng.integers(5, 40, size=12)]
        path = os.path.join(directory, f"train-{i:05d}.tok")
        sizes = [4 * len(d) for d in docs]
        write_shard(path, docs, sizes, vocab_name="test", vocab_size=256, eos_id=1)
        paths.append(path)
    return paths


def _token_input(paths: list[str]) -> TokenShardInput:
    cfg = TokenShardInput.default_config().set(
        name="input", is_training=True, global_batch_size=4, max_sequence_length=16, paths=paths
    )
    return cfg.instantiate(parent=None)


def test_token_shards_are_read_from_a_bucket_glob(s3_server, bucket, tmp_path):
    local = _write_shards(tmp_path)
    for path in local:
        with open(path, "rb") as f:
            s3_server.client.put_object(
                Bucket=bucket, Key=f"data/{os.path.basename(path)}", Body=f.read()
            )
    from_bucket = _token_input([f"s3://{bucket}/data/train-*.tok"])
    from_disk = _token_input(local)
    for step in range(3):
        ours, theirs = from_bucket.host_batch(step), from_disk.host_batch(step)
        assert sorted(ours) == sorted(theirs)
        for name in theirs:
            np.testing.assert_array_equal(ours[name], theirs[name], err_msg=name)


def test_bucket_glob_matching_nothing_names_the_pattern(s3_server, bucket):
    pattern = f"s3://{bucket}/data/valid-*.tok"
    with pytest.raises(TokenShardError, match=re.escape(f"{pattern}: no token shard files match")):
        _token_input([pattern])


# ----- a run in the bucket, killed and resumed -----

RUN_FLAGS = (
    "--config=gpt_test",
    "--data_dir=FAKE",
    "--jax_backend=cpu",
    "--config_override=input.max_sequence_length=64",
    "--config_override=summary_writer.write_every_n_steps=1",
    "--config_override=summary_writer.max_queue=1",
    "--config_override=checkpointer.save_policy.n=1",
)


def _start_run(trainer_dir: str, max_step: int) -> subprocess.Popen:
    command = [
        sys.executable, "-m", "axlearn.common.launch_trainer_main", *RUN_FLAGS,
        f"--trainer_dir={trainer_dir}", f"--config_override=max_step={max_step}",
    ]
    return subprocess.Popen(
        command, env=fresh_env(1), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True,
    )


def _committed_steps(s3_server: S3Server, bucket: str) -> list[int]:
    keys = _keys(s3_server, bucket, "run/checkpoints/")
    return sorted(int(k.split("/")[2][len("step_") :]) for k in keys if k.endswith(INDEX_FILE))


@pytest.mark.slow
def test_run_killed_after_its_first_commit_resumes_from_it_on_s3(s3_server, bucket):
    trainer_dir = f"s3://{bucket}/run"
    first = _start_run(trainer_dir, max_step=1000)
    try:
        deadline = time.monotonic() + 300
        while not _committed_steps(s3_server, bucket):
            assert first.poll() is None, first.communicate()[0][-3000:]
            assert time.monotonic() < deadline, "no checkpoint committed in 300 s"
            time.sleep(0.2)
        first.send_signal(signal.SIGKILL)
    finally:
        first.kill()
        first.communicate()
    committed = _committed_steps(s3_server, bucket)
    last = committed[-1]
    second = _start_run(trainer_dir, max_step=last + 2)
    output = second.communicate(timeout=300)[0]
    assert second.returncode == 0, output[-3000:]
    assert f"Restored step {last} from {trainer_dir}/checkpoints" in output
    assert _committed_steps(s3_server, bucket)[-1] == last + 2
    metrics = _get(s3_server, bucket, "run/summaries/train/metrics.jsonl").decode()
    steps = [json.loads(line)["step"] for line in metrics.splitlines()]
    assert steps[-2:] == [last + 1, last + 2]
    assert b"max_step: " in _get(s3_server, bucket, "run/config.txt")
