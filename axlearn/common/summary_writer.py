"""Writes summaries to TensorBoard event files and to a JSON-lines metrics file.

`SummaryWriter(step, summaries)` records a nested dict of summaries (flattened with '/')
in `cfg.dir`:
- `events.out.tfevents.*`: TensorBoard events. Records are framed by the `tensorboard`
  package's own `RecordWriter` and built from its `Event`/`Summary` protos. We do not use
  its `EventFileWriter`, because that one imports TensorFlow (seconds of start-up, and not
  installed on the GPU machines) just to open a local file.
- `metrics.jsonl`: one JSON object per write, `{"step": step, name: value, ...}`, holding
  the scalars and strings of that write (histograms stay in the event file only). The
  file only ever ends in a whole line: a write that fails part way (a full disk) is cut
  back off. `drop_records_after(step)`, called by a resuming trainer, drops the records
  past the restored step (and a cut-off last line of an older crash), so that each step
  appears once.

- W&B (`trackers` naming "wandb", the `wandb` extra): the scalars and strings of each
  write, named `<dir's last name>/<summary>` (`train/loss`, `validation/loss`), in one W&B
  run per run directory (`run_dir`, the trainer's) that the trainer's and the evalers'
  writers of this process share. The run records the root module's config (its golden
  text lines) and keeps its id in `run_dir/wandb_run_id`, so that a resumed run logs on
  into the same W&B run (its steps past the restored one are W&B's to drop or keep).
  `WANDB_MODE=offline` writes the run under `run_dir/wandb/` without a network (`wandb
  sync` uploads it later). A W&B run that cannot start or log warns once and is left
  out: training goes on.

`trackers` chooses any of TRACKERS, several at once (None: TensorBoard and JSON lines).

`cfg.dir` may be a local path or a storage URL (`gs://`, `s3://`, `memory://`, see
`file_system`). Object stores have no append: there, both files are held in memory and
each flush rewrites them whole, so a writer to a URL should flush less often (`max_queue`).

Only process 0 writes; every process must still call the writer, because fetching a
sharded value to the host is a collective.
"""

import importlib.util
import json
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any, Optional

import jax
import numpy as np

from axlearn.common import file_system
from axlearn.common.config import ConfigError, close_names, config_class
from axlearn.common.module import Module
from axlearn.common.run_dir import METRICS_JSONL, WANDB_RUN_ID, RunDir
from axlearn.common.summary import WeightedScalar

# Event files are flushed at least this often even when `max_queue` is not reached, so a
# crashed run keeps its recent summaries (TensorFlow's writers use the same interval).
_FLUSH_SECS = 120.0
# Buckets of a histogram summary.
_HISTOGRAM_BUCKETS = 30
JSONL_FILE_NAME = METRICS_JSONL  # Each writer's JSON lines, in its directory.
# Where summaries can go (SummaryWriter.Config.trackers), and where they go by default.
TRACKERS = ("tensorboard", "jsonl", "wandb")
DEFAULT_TRACKERS = ("tensorboard", "jsonl")
# The file in the run directory that holds its W&B run's id.
WANDB_RUN_ID_FILE = WANDB_RUN_ID


class SummaryWriteError(RuntimeError):
    """Writing summaries failed (e.g. the disk is full); the message names the file."""


def _write_whole(fd: int, data: bytes) -> None:
    """Appends `data` to the file open as `fd`, or nothing: a write that fails part way
    is cut back off, so the file still ends where it did."""
    start = os.fstat(fd).st_size
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    except BaseException:
        os.ftruncate(fd, start)
        raise


class _JsonLines:
    """A JSON-lines file appended to a whole line at a time. Lines are queued in memory
    until `flush`; a local file gets them in one write (`_write_whole`), an object store
    a rewrite of the whole object."""

    def __init__(self, path: str):
        self._path = path
        self._lines: list[str] = []
        if file_system.is_local(path):
            local = file_system.local_path(path)
            self._fd: Optional[int] = os.open(local, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            self._object = None
        else:
            self._fd, self._object = None, file_system.open_append(path)

    def append(self, record: dict[str, Any]) -> None:
        self._lines.append(json.dumps(record) + "\n")

    def flush(self, *, durable: bool = False) -> None:
        data, self._lines = "".join(self._lines).encode("utf-8"), []
        try:
            if self._fd is not None:
                if data:
                    _write_whole(self._fd, data)
                if durable:
                    os.fsync(self._fd)
            elif data:
                self._object.write(data)
                self._object.flush()
        except OSError as e:
            raise SummaryWriteError(
                f"Writing summaries to {self._path} failed: {e.strerror or e}"
            ) from e

    def close(self) -> None:
        try:
            self.flush()
        finally:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
            elif self._object is not None:
                self._object.close()


def drop_records_after(path: str, step: int) -> int:
    """Rewrites the JSON-lines file `path` (if any) without its records past `step` and
    without lines that are not whole records (a last line cut off by a crash); returns
    how many lines it dropped. The rewrite replaces the file atomically."""
    try:
        text = file_system.read_text(path)
    except FileNotFoundError:
        return 0
    kept, dropped = [], 0
    for line in text.splitlines(keepends=True):
        try:
            record = json.loads(line) if line.endswith("\n") else None
        except ValueError:
            record = None
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            if record["step"] <= step:
                kept.append(line)
                continue
        dropped += 1
    if dropped:
        file_system.write_text(path, "".join(kept))
    return dropped


def flatten_summaries(summaries: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """{'a': {'b': x}} -> {'a/b': x}; empty dicts and None values are dropped."""
    flat = {}
    for key, value in summaries.items():
        name = f"{prefix}/{key}" if prefix else str(key)
        if isinstance(value, Mapping):
            flat.update(flatten_summaries(value, name))
        elif value is not None:
            flat[name] = value
    return flat


def host_value(x: Any) -> Any:
    """A jax array as a NumPy value on this host; other values unchanged.

    A sharded array that this process does not fully hold is all-gathered, which every
    process must take part in.
    """
    if not isinstance(x, jax.Array):
        return x
    if x.is_fully_addressable:
        return np.asarray(x)
    if x.is_fully_replicated:
        return np.asarray(x.addressable_data(0))
    from jax.experimental import multihost_utils  # Only multi-process runs need it.

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def _python_scalar(value: np.ndarray) -> Any:
    """A 0-d array as a Python int, float or bool (what JSON writes)."""
    return value.item()


def _histogram_proto(values: np.ndarray, summary_pb2) -> Any:
    values = values.astype(np.float64).ravel()
    values = values[np.isfinite(values)]
    if values.size == 0:
        return summary_pb2.HistogramProto()
    low, high = float(values.min()), float(values.max())
    if low == high:
        edges = np.array([low, np.nextafter(high, np.inf)])
    else:
        edges = np.linspace(low, high, _HISTOGRAM_BUCKETS + 1)
    counts, edges = np.histogram(values, bins=edges)
    return summary_pb2.HistogramProto(
        min=low,
        max=high,
        num=float(values.size),
        sum=float(values.sum()),
        sum_squares=float(np.dot(values, values)),
        # TensorBoard reads bucket i as (bucket_limit[i-1], bucket_limit[i]].
        bucket_limit=[float(e) for e in edges[1:]],
        bucket=[float(c) for c in counts],
    )


class _EventFile:
    """One TensorBoard event file, written through tensorboard's RecordWriter."""

    def __init__(self, logdir: str):
        # Imported here: the trainer must run where tensorboard is not installed.
        from tensorboard.compat.proto import event_pb2, summary_pb2
        from tensorboard.summary.writer.record_writer import RecordWriter

        self._event_pb2, self._summary_pb2 = event_pb2, summary_pb2
        name = "events.out.tfevents.%010d.%s.%d.%d" % (
            time.time(),
            socket.gethostname(),
            os.getpid(),
            id(self),
        )
        self._file = file_system.open_append(file_system.join(logdir, name))
        self._records = RecordWriter(self._file)
        # The first event names the file format, as TensorBoard expects.
        self._add(event_pb2.Event(wall_time=time.time(), file_version="brain.Event:2"))
        self.flush()

    def _add(self, event: Any) -> None:
        self._records.write(event.SerializeToString())

    def write(self, step: int, values: dict[str, Any]) -> None:
        summary = self._summary_pb2.Summary()
        for name, value in values.items():
            if isinstance(value, str):
                summary.value.add(
                    tag=name, tensor=self._text_tensor(value), metadata=self._text_metadata()
                )
            elif value.ndim == 0:
                summary.value.add(tag=name, simple_value=float(value))
            else:
                summary.value.add(tag=name, histo=_histogram_proto(value, self._summary_pb2))
        self._add(self._event_pb2.Event(wall_time=time.time(), step=step, summary=summary))

    def _text_tensor(self, text: str) -> Any:
        from tensorboard.compat.proto import tensor_pb2, tensor_shape_pb2, types_pb2

        return tensor_pb2.TensorProto(
            dtype=types_pb2.DT_STRING,
            tensor_shape=tensor_shape_pb2.TensorShapeProto(),
            string_val=[text.encode("utf-8")],
        )

    def _text_metadata(self) -> Any:
        # The text plugin shows string tensors that carry its name.
        return self._summary_pb2.SummaryMetadata(
            plugin_data=self._summary_pb2.SummaryMetadata.PluginData(plugin_name="text")
        )

    def flush(self, *, durable: bool = False) -> None:
        self._records.flush()
        if durable:
            file_system.fsync(self._file)

    def close(self) -> None:
        self.flush()
        self._records.close()


def _one_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


class _WandbRun:
    """The W&B run of one run directory in this process (`wandb_run`): started on first
    use, resumed by the id in `run_dir/WANDB_RUN_ID_FILE`. A failure to start or to log
    warns once, naming the cause, and the run is left out from then on."""

    def __init__(self, run_dir: str, *, project: Optional[str], entity: Optional[str]):
        self._run_dir = run_dir
        self._project = project or "axlearn"
        self._entity = entity
        self._run: Any = None
        self._failed = False
        self._lock = threading.Lock()

    @property
    def run(self) -> Any:
        """The wandb Run object, None before the first log or after a failure."""
        return self._run

    def _fail(self, what: str, error: BaseException) -> None:
        if self._failed:  # Warned once already.
            return
        self._failed = True
        logging.warning(
            "W&B (run directory %s) failed to %s (%s); its summaries go to the other "
            "trackers only, and training goes on",
            self._run_dir, what, _one_line(error),
        )

    def _start(self, config: Mapping[str, Any]) -> None:
        import wandb  # pylint: disable=import-outside-toplevel

        id_path = RunDir(self._run_dir).wandb_run_id
        try:
            run_id = file_system.read_text(id_path).strip() or None
        except FileNotFoundError:
            run_id = None
        resumed = run_id is not None
        run_id = run_id or secrets.token_hex(4)
        local_dir = (
            file_system.local_path(self._run_dir) if file_system.is_local(self._run_dir) else None
        )
        self._run = wandb.init(
            project=self._project,
            entity=self._entity,
            id=run_id,
            resume="allow",
            name=os.path.basename(self._run_dir.rstrip("/")) or None,
            dir=local_dir,
            config=dict(config),
            reinit="create_new",
            # The launcher's stdout and stderr stay its own: no console capture, no banner.
            settings=wandb.Settings(console="off", silent=True, disable_git=True, save_code=False),
        )
        if not resumed:
            file_system.write_text(id_path, run_id)
        logging.info(
            "W&B run %s (%s, %s) in project %s",
            run_id, "resumed" if resumed else "new", self._run.settings.mode, self._project,
        )

    def log(self, step: int, values: Mapping[str, Any], config: Any) -> None:
        """Logs `values` at `step`; `config()` gives the run's config at the start."""
        with self._lock:
            if self._failed:
                return
            if self._run is None:
                try:
                    self._start(config())
                except Exception as e:  # pylint: disable=broad-except
                    self._fail("start", e)
                    return
            try:
                self._run.log(dict(values), step=int(step))
            except Exception as e:  # pylint: disable=broad-except
                self._fail(f"log step {step}", e)

    def finish(self) -> None:
        with self._lock:
            run, self._run = self._run, None
            if run is not None:
                try:
                    run.finish()
                except Exception as e:  # pylint: disable=broad-except
                    self._fail("finish", e)


_wandb_runs: dict[str, _WandbRun] = {}
_wandb_runs_lock = threading.Lock()


def wandb_run(run_dir: str, *, project: Optional[str], entity: Optional[str]) -> _WandbRun:
    """The W&B run of `run_dir` in this process (one for all its writers)."""
    with _wandb_runs_lock:
        if run_dir not in _wandb_runs:
            _wandb_runs[run_dir] = _WandbRun(run_dir, project=project, entity=entity)
        return _wandb_runs[run_dir]


def finish_wandb_runs() -> None:
    """Finishes every W&B run of this process (they also finish when it exits)."""
    with _wandb_runs_lock:
        runs = list(_wandb_runs.values())
        _wandb_runs.clear()
    for run in runs:
        run.finish()


class SummaryWriter(Module):
    """Writes summaries every `write_every_n_steps` steps to event files and metrics.jsonl."""

    @config_class
    class Config(Module.Config):
        """Configures SummaryWriter."""

        write_every_n_steps: int = 1  # __call__ writes only at steps divisible by this.
        # Writes kept in memory before the files are flushed; None: flush every write. On a
        # URL a flush rewrites the files whole: set it there.
        max_queue: Optional[int] = None
        dir: Optional[str] = None  # Output directory; set by the trainer or the evaler.
        # Where summaries go, any of TRACKERS ("tensorboard", "jsonl", "wandb"); None:
        # DEFAULT_TRACKERS (TensorBoard event files and metrics.jsonl).
        trackers: Optional[Sequence[str]] = None
        wandb_project: Optional[str] = None  # The W&B project; None: "axlearn".
        wandb_entity: Optional[str] = None  # The W&B team or user; None: the account's.
        # The run's directory, where its W&B run keeps its id and (locally) its files; set
        # by the trainer to the trainer directory. None: dir.
        run_dir: Optional[str] = None

    def __init__(self, cfg: Config, *, parent: Optional[Module]):
        super().__init__(cfg, parent=parent)
        if not isinstance(cfg.write_every_n_steps, int) or cfg.write_every_n_steps < 1:
            raise ConfigError(
                f"{self.path()}.write_every_n_steps must be a positive int, "
                f"got {cfg.write_every_n_steps!r}"
            )
        if cfg.max_queue is not None and cfg.max_queue < 1:
            raise ConfigError(
                f"{self.path()}.max_queue must be None or a positive int, got {cfg.max_queue!r}"
            )
        trackers = DEFAULT_TRACKERS if cfg.trackers is None else cfg.trackers
        if isinstance(trackers, str) or not all(isinstance(t, str) for t in trackers):
            raise ConfigError(
                f"{self.path()}.trackers must be a list of names from {list(TRACKERS)}, got "
                f"{trackers!r}"
            )
        for name in trackers:
            if name not in TRACKERS:
                close = close_names(name, TRACKERS, n=1)
                raise ConfigError(
                    f"{self.path()}.trackers: unknown tracker {name!r}"
                    f"{f' (did you mean {close[0]!r}?)' if close else ''}; choose from "
                    f"{', '.join(TRACKERS)}"
                )
        if "wandb" in trackers and importlib.util.find_spec("wandb") is None:
            raise ConfigError(
                f"{self.path()}.trackers names wandb, but the wandb package is not installed "
                "(pip install 'axlearn[wandb]')"
            )
        self._trackers = tuple(trackers)
        self._event_file: Optional[_EventFile] = None
        self._jsonl: Optional[_JsonLines] = None
        self._wandb: Optional[_WandbRun] = None
        self._opened = False
        self._pending = 0  # Writes since the last flush.
        self._last_flush = time.time()

    def should_write(self, step: int) -> bool:
        return step % self._config.write_every_n_steps == 0

    def open(self) -> None:
        """Opens the output files, if they are not open yet; the first write opens them
        otherwise. Opening imports tensorboard's writer (~0.15 s): a trainer opens them
        before its first step, so that no step of the loop waits on it."""
        if self._opened:
            return
        cfg = self._config
        self._opened = True
        if jax.process_index() != 0:
            return
        if not cfg.dir:
            raise ConfigError(f"{self.path()}.dir is not set: set it to the summaries directory")
        file_system.makedirs(cfg.dir)
        if "tensorboard" in self._trackers:
            try:
                self._event_file = _EventFile(cfg.dir)
            except ImportError as e:
                logging.warning(
                    "%s: the tensorboard package is not installed (%s); writing no event "
                    "files in %s",
                    self.path(),
                    e,
                    cfg.dir,
                )
        if "jsonl" in self._trackers:
            self._jsonl = _JsonLines(file_system.join(cfg.dir, JSONL_FILE_NAME))
        if "wandb" in self._trackers:
            self._wandb = wandb_run(
                cfg.run_dir or cfg.dir, project=cfg.wandb_project, entity=cfg.wandb_entity
            )

    def drop_records_after(self, step: int) -> None:
        """Drops the records of metrics.jsonl past `step` (and a cut-off last line), before
        the writer opens it: a run resumed from a checkpoint at `step` writes the later
        steps again. Process 0 only, like every write."""
        cfg = self._config
        if self._opened:
            raise RuntimeError(f"{self.path()}: drop_records_after() after the files opened")
        if jax.process_index() != 0 or not cfg.dir:
            return
        path = file_system.join(cfg.dir, JSONL_FILE_NAME)
        dropped = drop_records_after(path, step)
        if dropped:
            logging.info("Dropped %d records past step %d from %s", dropped, step, path)

    def _to_writable(self, name: str, value: Any) -> Any:
        """A str or a NumPy array of numbers for one summary value."""
        if isinstance(value, WeightedScalar):
            value = value.mean
        if isinstance(value, str):
            return value
        value = host_value(value)
        array = np.asarray(value)
        if array.dtype.kind not in "biuf":
            raise TypeError(
                f"{self.path()}: summary '{name}' has a value of type {type(value).__name__} "
                f"(dtype {array.dtype}); expected a number, a numeric array, a WeightedScalar "
                "or a str"
            )
        return array

    def __call__(self, step: int, summaries: Mapping[str, Any]) -> None:
        """Writes `summaries` for `step` if `should_write(step)`."""
        if not self.should_write(step):
            return
        values = {
            name: self._to_writable(name, value)
            for name, value in flatten_summaries(summaries).items()
        }
        self.open()
        if jax.process_index() != 0:
            return
        if self._event_file is not None:
            self._event_file.write(step, values)
        record: dict[str, Any] = {"step": int(step)}
        for name, value in values.items():
            if isinstance(value, str):
                record[name] = value
            elif value.ndim == 0:
                record[name] = _python_scalar(value)
        if self._jsonl is not None:
            self._jsonl.append(record)
        if self._wandb is not None:
            prefix = os.path.basename(self._config.dir.rstrip("/"))
            scalars = {f"{prefix}/{k}": v for k, v in record.items() if k != "step"}
            self._wandb.log(step, scalars, config=self._run_config)
        self._pending += 1
        max_queue = self._config.max_queue
        if (
            max_queue is None
            or self._pending >= max_queue
            or time.time() - self._last_flush >= _FLUSH_SECS
        ):
            self.flush()

    def _run_config(self) -> dict[str, str]:
        """The root module's config (the trainer's, for a trainer's writers) as its golden
        text's `key: value` lines, for a tracker to record with the run."""
        # pylint: disable-next=import-outside-toplevel
        from axlearn.common.golden_text import flat_lines

        root: Module = self
        while root.parent is not None:
            root = root.parent
        return flat_lines(root.config.debug_string())

    def flush(self, *, durable: bool = False) -> None:
        """Writes every pending summary to storage; `durable` also fsyncs local files, so
        they survive a power loss as a checkpoint does (the trainer flushes so at every save)."""
        if self._event_file is not None:
            try:
                self._event_file.flush(durable=durable)
            except OSError as e:
                raise SummaryWriteError(
                    f"Writing summaries to {self._config.dir} failed: {e.strerror or e}"
                ) from e
        if self._jsonl is not None:
            self._jsonl.flush(durable=durable)
        self._pending = 0
        self._last_flush = time.time()

    def close(self) -> None:
        """Flushes and closes the files; a later write opens new ones."""
        if self._event_file is not None:
            self._event_file.close()
        if self._jsonl is not None:
            self._jsonl.close()
        self._event_file, self._jsonl, self._opened = None, None, False
