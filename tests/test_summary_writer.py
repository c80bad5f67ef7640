"""Tests of axlearn.common.summary_writer: event files, metrics.jsonl and write policy."""

import errno
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tensorboard.backend.event_processing import event_accumulator

from axlearn.common.config import ConfigError
from axlearn.common.summary import WeightedScalar
from axlearn.common import summary_writer as summary_writer_lib
from axlearn.common.summary_writer import JSONL_FILE_NAME, SummaryWriter, SummaryWriteError


def _writer(tmp_path, **kwargs) -> SummaryWriter:
    cfg = SummaryWriter.default_config().set(name="summary_writer", dir=str(tmp_path), **kwargs)
    return cfg.instantiate(parent=None)


def _events(logdir) -> event_accumulator.EventAccumulator:
    """Reads every event of `logdir` back with TensorBoard's own reader."""
    everything = {
        event_accumulator.SCALARS: 0,
        event_accumulator.HISTOGRAMS: 0,
        event_accumulator.TENSORS: 0,
    }
    acc = event_accumulator.EventAccumulator(str(logdir), size_guidance=everything)
    acc.Reload()
    return acc


def _jsonl(logdir) -> list[dict]:
    with open(os.path.join(logdir, JSONL_FILE_NAME), encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def test_scalars_of_every_kind_are_readable_by_tensorboard(tmp_path):
    writer = _writer(tmp_path)
    writer(
        3,
        {
            "python_int": 7,
            "python_float": 0.25,
            "numpy": np.float32(1.5),
            "jax": jnp.asarray(-2.0),
            "nested": {"loss": WeightedScalar(jnp.asarray(3.5), jnp.asarray(10.0))},
        },
    )
    writer.close()
    acc = _events(tmp_path)
    values = {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    assert values == {
        "python_int": [(3, 7.0)],
        "python_float": [(3, 0.25)],
        "numpy": [(3, 1.5)],
        "jax": [(3, -2.0)],
        "nested/loss": [(3, 3.5)],  # A WeightedScalar is written as its mean.
    }


def test_arrays_become_histograms_with_exact_statistics(tmp_path):
    values = np.random.default_rng(0).normal(size=(50,)).astype(np.float32)
    writer = _writer(tmp_path)
    writer(1, {"weights": jnp.asarray(values)})
    writer.close()
    histogram = _events(tmp_path).Histograms("weights")[0].histogram_value
    as64 = values.astype(np.float64)
    assert histogram.num == 50
    assert sum(histogram.bucket) == 50
    np.testing.assert_allclose(histogram.min, as64.min())
    np.testing.assert_allclose(histogram.max, as64.max())
    np.testing.assert_allclose(histogram.sum, as64.sum(), rtol=1e-12)
    np.testing.assert_allclose(histogram.sum_squares, (as64**2).sum(), rtol=1e-12)


def test_strings_are_written_as_text(tmp_path):
    writer = _writer(tmp_path)
    writer(2, {"note": "hello"})
    writer.close()
    event = _events(tmp_path).Tensors("note")[0]
    assert event.step == 2
    assert event.tensor_proto.string_val == [b"hello"]


def test_jsonl_has_one_exact_line_per_write(tmp_path):
    writer = _writer(tmp_path)
    writer(0, {"loss": WeightedScalar(2.5, 4.0), "lr": np.float64(0.125), "n": np.int32(3)})
    writer(10, {"a": {"b": 1.0}, "hist": np.arange(4.0), "text": "x"})
    writer.close()
    assert _jsonl(tmp_path) == [
        {"step": 0, "loss": 2.5, "lr": 0.125, "n": 3},
        {"step": 10, "a/b": 1.0, "text": "x"},  # Histograms stay in the event file only.
    ]


def test_only_steps_divisible_by_write_every_n_steps_are_written(tmp_path):
    writer = _writer(tmp_path, write_every_n_steps=3)
    assert [writer.should_write(step) for step in range(7)] == [
        True, False, False, True, False, False, True,
    ]
    for step in range(8):
        writer(step, {"x": float(step)})
    writer.close()
    assert [(e.step, e.value) for e in _events(tmp_path).Scalars("x")] == [
        (0, 0.0), (3, 3.0), (6, 6.0),
    ]
    assert [record["step"] for record in _jsonl(tmp_path)] == [0, 3, 6]


def test_max_queue_defers_flushing_until_the_queue_is_full(tmp_path):
    writer = _writer(tmp_path, max_queue=3)
    writer(0, {"x": 0.0})
    writer(1, {"x": 1.0})
    assert _jsonl(tmp_path) == []
    writer(2, {"x": 2.0})
    assert [record["step"] for record in _jsonl(tmp_path)] == [0, 1, 2]
    writer.close()


def test_without_max_queue_every_write_is_on_disk_at_once(tmp_path):
    writer = _writer(tmp_path)
    writer(0, {"x": 1.0})
    assert _jsonl(tmp_path) == [{"step": 0, "x": 1.0}]
    assert [e.value for e in _events(tmp_path).Scalars("x")] == [1.0]
    writer.close()


def test_open_before_the_first_write_creates_the_files_once(tmp_path):
    # The trainer opens its writer before the first step, so no step waits on the import.
    writer = _writer(tmp_path)
    writer.open()
    writer.open()
    event_files = [f for f in os.listdir(tmp_path) if f.startswith("events.out.tfevents.")]
    assert len(event_files) == 1 and _jsonl(tmp_path) == []
    writer(0, {"x": 1.0})
    assert [f for f in os.listdir(tmp_path) if f.startswith("events.out.")] == event_files
    assert [e.value for e in _events(tmp_path).Scalars("x")] == [1.0]
    writer.close()


def test_processes_other_than_0_write_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(jax, "process_index", lambda: 1)
    writer = _writer(tmp_path / "out")
    writer(0, {"x": 1.0})
    writer.close()
    assert not os.path.exists(tmp_path / "out")


def test_missing_dir_is_an_error_naming_the_field():
    writer = SummaryWriter.default_config().set(name="writer").instantiate(parent=None)
    with pytest.raises(ConfigError, match=r"writer\.dir"):
        writer(0, {"x": 1.0})


def test_unsupported_values_are_an_error_naming_the_summary(tmp_path):
    writer = _writer(tmp_path)
    with pytest.raises(TypeError, match="'bad'"):
        writer(0, {"bad": object()})


def test_bad_write_every_n_steps_is_rejected(tmp_path):
    with pytest.raises(ConfigError, match="write_every_n_steps"):
        _writer(tmp_path, write_every_n_steps=0)


# ----- a full disk, and resuming -----


def test_a_write_cut_off_by_a_full_disk_leaves_only_whole_lines(tmp_path, monkeypatch):
    writer = _writer(tmp_path)
    writer(0, {"x": 1.0})
    real_write = os.write

    def full_after_a_few_bytes(fd, data):
        real_write(fd, bytes(data[:7]))  # Part of the line lands, then the disk is full.
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(summary_writer_lib.os, "write", full_after_a_few_bytes)
    path = os.path.join(tmp_path, JSONL_FILE_NAME)
    with pytest.raises(SummaryWriteError) as error:
        writer(1, {"x": 2.0})
    assert str(error.value) == f"Writing summaries to {path} failed: No space left on device"
    monkeypatch.undo()
    assert _jsonl(tmp_path) == [{"step": 0, "x": 1.0}]


def test_records_past_the_resumed_step_and_a_cut_off_line_are_dropped(tmp_path):
    lines = [json.dumps({"step": step, "x": float(step)}) + "\n" for step in range(1, 7)]
    with open(os.path.join(tmp_path, JSONL_FILE_NAME), "w", encoding="utf-8") as f:
        f.write("".join(lines) + '{"step": 7, "x"')  # Step 7 was cut off by a crash.
    writer = _writer(tmp_path)
    writer.drop_records_after(4)
    writer(5, {"x": 50.0})
    writer.close()
    assert _jsonl(tmp_path) == [{"step": s, "x": float(s)} for s in range(1, 5)] + [
        {"step": 5, "x": 50.0}
    ]


def test_dropping_records_after_the_files_opened_is_an_error(tmp_path):
    writer = _writer(tmp_path)
    writer.open()
    with pytest.raises(RuntimeError, match="drop_records_after"):
        writer.drop_records_after(0)
    writer.close()


# ----- trackers: several at once, W&B -----


def test_an_unknown_tracker_is_an_error_naming_the_field_and_a_close_name(tmp_path):
    with pytest.raises(ConfigError, match=r"summary_writer.trackers: unknown tracker 'wandbb' "
                       r"\(did you mean 'wandb'\?\)"):
        _writer(tmp_path, trackers=["jsonl", "wandbb"])


def test_only_the_chosen_trackers_write(tmp_path):
    writer = _writer(tmp_path, trackers=["jsonl"])
    writer(1, {"loss": 0.5})
    writer.close()
    assert os.listdir(tmp_path) == [JSONL_FILE_NAME]


class _BrokenRun:
    """A W&B run whose every log fails, as one that lost its connection."""

    settings = None

    def __init__(self):
        self.calls = 0

    def log(self, values, step):
        self.calls += 1
        raise ConnectionError("the W&B server went away\nand more")


def test_a_tracker_that_fails_warns_once_and_the_others_write_on(tmp_path, monkeypatch, caplog):
    pytest.importorskip("wandb")  # The writer checks that the package is there.
    broken = _BrokenRun()
    monkeypatch.setattr(
        summary_writer_lib._WandbRun, "_start", lambda self, config: setattr(self, "_run", broken)
    )
    writer = _writer(tmp_path, trackers=["jsonl", "wandb"], run_dir=str(tmp_path / "run"))
    for step in (1, 2, 3):
        writer(step, {"loss": float(step)})
    writer.close()
    summary_writer_lib.finish_wandb_runs()
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "ConnectionError: the W&B server went away" in warnings[0]
    assert "training goes on" in warnings[0] and broken.calls == 1
    assert [r["step"] for r in _jsonl(tmp_path)] == [1, 2, 3]


def _wandb_records(path) -> list:
    """The records of a W&B run file (`run-ID.wandb`), parsed with wandb's own protos:
    LevelDB-log framing (32 KiB blocks; records of a 7-byte header, crc32 length type, and
    data; a record split over blocks as first, middle, last) after a 7-byte file header."""
    from wandb.proto import wandb_internal_pb2  # pylint: disable=import-outside-toplevel

    data, block, pos = path.read_bytes(), 32768, 7
    assert data[:4] == b":W&B"
    records, pending = [], b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # A block's tail too short for a header is padding.
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        if kind == 0:
            break
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # Full, or the last piece.
            records.append(wandb_internal_pb2.Record.FromString(pending))
            pending = b""
    return records


def _finished_wandb_records(path) -> list:
    """`_wandb_records` once the run file ends with its exit record: wandb's service
    finishes writing the file after `finish()` returns."""
    deadline = time.monotonic() + 60
    while True:
        try:
            records = _wandb_records(path)
        except Exception:  # pylint: disable=broad-except  (a record still being written)
            records = []
        if any(r.WhichOneof("record_type") == "exit" for r in records):
            return records
        assert time.monotonic() < deadline, f"{path} has no exit record"
        time.sleep(0.1)


def _wandb_run_files(run_dir) -> list:
    return sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))


def _history(records) -> dict[int, dict[str, object]]:
    """Step -> {key: value} of the history records."""
    steps = {}
    for record in records:
        if record.WhichOneof("record_type") == "history":
            items = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                     for item in record.history.item}
            steps[items.pop("_step")] = {k: v for k, v in items.items() if not k.startswith("_")}
    return steps


@pytest.mark.slow
def test_wandb_offline_files_hold_the_scalars_and_the_config_and_a_resume_appends(
    tmp_path, monkeypatch
):
    monkeypatch.setenv("WANDB_MODE", "offline")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    config = dict(trackers=["jsonl", "wandb"], run_dir=str(run_dir), write_every_n_steps=1)
    writer = _writer(run_dir / "summaries" / "train", **config)
    writer(1, {"loss": 2.5, "learner": {"lr": np.float32(0.125)}, "note": "first"})
    writer(2, {"loss": 2.0, "learner": {"lr": np.float32(0.25)}})
    summary_writer_lib.finish_wandb_runs()
    run_id = (run_dir / summary_writer_lib.WANDB_RUN_ID_FILE).read_text()
    (first,) = _wandb_run_files(run_dir)
    assert first.name == f"run-{run_id}.wandb"
    records = _finished_wandb_records(first)
    assert _history(records) == {
        1: {"train/loss": 2.5, "train/learner/lr": 0.125, "train/note": "first"},
        2: {"train/loss": 2.0, "train/learner/lr": 0.25},
    }
    # The config: the root module's golden text lines (here the writer's own).
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    recorded = {u.key: json.loads(u.value_json) for u in run.config.update}
    assert recorded["write_every_n_steps"] == "1"
    assert recorded["klass"] == "'axlearn.common.summary_writer.SummaryWriter'"

    # A restart of the run: a new writer logs on into the same W&B run.
    writer = _writer(run_dir / "summaries" / "train", **config)
    writer(3, {"loss": 1.5})
    summary_writer_lib.finish_wandb_runs()
    files = _wandb_run_files(run_dir)
    assert len(files) == 2 and all(f.name == f"run-{run_id}.wandb" for f in files)
    resumed = [f for f in files if f != first][0]
    assert _history(_finished_wandb_records(resumed)) == {3: {"train/loss": 1.5}}
