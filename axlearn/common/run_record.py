"""A run's record of its config: the resolved config in golden text (`config.txt` in the
trainer directory), compared on every start with the last start's, so that a restart
cannot silently change the run (only RESTARTABLE_KEYS and the fields that follow max_step
may change without --allow_config_change). Until the run has a checkpoint nothing carries
over from a start to the next, so the record of a start that failed (a bad value, data
that does not fit the model) is replaced by the next start's, whatever changed.
"""

import errno
import logging
import os
import re
import tempfile
from collections.abc import Callable, Sequence
from typing import Optional, Union

from axlearn.common import file_system
from axlearn.common.config import ConfigError
from axlearn.common.golden_text import flat_lines
from axlearn.common.run_dir import RunDir

log = logging.getLogger(__name__)

# Changed keys an error names before it counts the rest.
MAX_LISTED_CHANGES = 10
# The line of a recorded config naming the trainer's class: any recorded config has it.
_ROOT_KLASS = re.compile(r"klass: '[\w.]+'")
# Keys that may change between restarts of one run: its length, the cadences of logs,
# summaries, evals, checkpoints and traces, where summaries go (trackers, W&B's project),
# and the directory itself (should it move).
# Fields that follow max_step may change with it (`_follows_max_step`).
RESTARTABLE_KEYS = re.compile(
    r"max_step|dir|log_every_n_steps|start_trace_steps(\[\d+\])?|start_trace_num_steps"
    r"|(.+\.)?write_every_n_steps|(.+\.)?summary_writer\.(trackers(\[\d+\])?|wandb_\w+)"
    r"|evalers\[.+\]\.eval_policy\.(n|min_step)"
    r"|checkpointer\.save_policy\.(n|min_step)|checkpointer\.keep_(last_n|every_n_steps)"
)


def _follows_max_step(key: str, old: dict[str, str], new: dict[str, str]) -> bool:
    """Whether `key` held the trainer's max_step in both configs, or is the warmup of a
    schedule whose max_step did and changed (`follow_max_step` may shorten it)."""
    if key.endswith(".warmup_steps"):
        schedule_key = key.removesuffix(".warmup_steps") + ".max_step"
        changed = old.get(schedule_key) != new.get(schedule_key)
        return changed and _follows_max_step(schedule_key, old, new)
    return key.endswith(".max_step") and all(
        d.get(key) is not None and d.get(key) == d.get("max_step") for d in (old, new)
    )


def config_changes(
    old_text: Union[str, dict[str, str]], new_text: Union[str, dict[str, str]]
) -> list[tuple[str, str, str, bool]]:
    """(key, old value, new value, whether it may change between restarts) for each key
    that differs between two golden texts (or their `flat_lines`); '(absent)' for a key
    only one has."""
    old, new = (t if isinstance(t, dict) else flat_lines(t) for t in (old_text, new_text))
    return [
        (
            key,
            old.get(key, "(absent)"),
            new.get(key, "(absent)"),
            bool(RESTARTABLE_KEYS.fullmatch(key)) or _follows_max_step(key, old, new),
        )
        for key in sorted(set(old) | set(new))
        if old.get(key) != new.get(key)
    ]


class TrainerDirNotWritableError(ConfigError):
    """The trainer directory cannot be made, or this process may not write in it."""


def _file_above(path: str) -> Optional[str]:
    """The nearest existing ancestor of `path` that is a file, not a directory; None."""
    parent = os.path.dirname(os.path.abspath(path))
    while parent and parent != os.path.dirname(parent):
        if os.path.exists(parent):
            return None if os.path.isdir(parent) else parent
        parent = os.path.dirname(parent)
    return None


def _write_problem(path: str) -> Optional[OSError]:
    """The error of writing a file in the directory `path` (read-only file system,
    permission denied, disk full), or None where a file can be written there."""
    try:
        fd, probe = tempfile.mkstemp(prefix=".axlearn-write-probe-", dir=path)
        os.close(fd)
        os.remove(probe)
    except OSError as e:
        return e
    return None


def check_trainer_dir(trainer_dir: str) -> None:
    """Raises ConfigError for a --trainer_dir URL that no storage driver accepts or a local
    path that names a file, TrainerDirNotWritableError for a local directory that cannot be
    created (made here: under a file, on a read-only file system, without permission) or
    written in."""
    try:
        file_system.kvstore_spec(trainer_dir)
    except ValueError as e:
        raise ConfigError(f"--trainer_dir={trainer_dir}: {e}") from e
    if not file_system.is_local(trainer_dir):
        return
    path = file_system.local_path(trainer_dir)
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(f"--trainer_dir={trainer_dir} is a file, not a directory")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        above = _file_above(path) if e.errno in (errno.ENOTDIR, errno.EEXIST) else None
        reason = f"{above} is a file, not a directory" if above else (e.strerror or str(e))
        raise TrainerDirNotWritableError(
            f"--trainer_dir={trainer_dir}: cannot create the directory: {reason}"
        ) from e
    problem = _write_problem(path)
    if problem is not None:
        raise TrainerDirNotWritableError(
            f"--trainer_dir={trainer_dir}: cannot write the run's files: the directory is not "
            f"writable ({problem.strerror or problem})"
        ) from problem


def has_checkpoint(run: RunDir) -> bool:
    """Whether the trainer directory holds a committed checkpoint (a step's index)."""
    # pylint: disable-next=import-outside-toplevel
    from axlearn.common.checkpointer import INDEX_FILE

    # Not joined whole: `join` percent-encodes a URL's parts, the glob's '*' included.
    pattern = f"{run.checkpoints.rstrip('/')}/step_*/{INDEX_FILE}"
    return bool(file_system.glob(pattern))


def read_record(path: str) -> dict[str, str]:
    """The `key: value` lines of the recorded config at `path`; ConfigError naming the
    first line that is not one (or the missing trainer `klass` line, or the first byte
    that is not UTF-8) for a file that is no config."""
    data = file_system.read_bytes(path)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"{path} cannot be parsed: byte {e.start} is not UTF-8 text; it is no config "
            "launch_trainer recorded"
        ) from None
    lines = text.splitlines()
    for lineno, line in enumerate(lines, 1):
        if ": " not in line:
            raise ConfigError(
                f"{path} cannot be parsed: line {lineno} is not 'key: value' "
                f"({line[:60]!r}); it is no config launch_trainer recorded"
            )
    if not any(_ROOT_KLASS.fullmatch(line) for line in lines):
        raise ConfigError(
            f"{path} cannot be parsed: it has no 'klass:' line; it is no config "
            "launch_trainer recorded"
        )
    return flat_lines(text)


def _listed(changes: Sequence[str]) -> str:
    shown = "; ".join(changes[:MAX_LISTED_CHANGES])
    more = len(changes) - MAX_LISTED_CHANGES
    return shown + (f"; and {more} more" if more > 0 else "")


def record_config(
    run: RunDir,
    text: str,
    *,
    allow_change: bool,
    write: bool,
    all_have_read: Callable[[], None] = lambda: None,
) -> None:
    """Compares `text` with the config recorded by the run's last start, if any, and
    records it (`write`: process 0 only).

    Changed keys are logged; once the run has a checkpoint (`has_checkpoint`), a change
    outside RESTARTABLE_KEYS and the fields that follow max_step is an error listing
    those keys, unless `allow_change`, as is a record that cannot be parsed. Before the
    first checkpoint the record is replaced whatever changed: no start before trained
    anything this one resumes. `all_have_read` returns once every process has compared (a
    barrier), so that all compare with the same record.
    """
    path = run.config_record
    if file_system.isfile(path):
        resumes = has_checkpoint(run)
        try:
            old = read_record(path)
        except ConfigError:
            if resumes:
                raise
            log.info("%s cannot be parsed and no checkpoint exists: replaced", path)
            old = None
        changes = [] if old is None else config_changes(old, text)
        if changes:
            log.info(
                "%s: %d key(s) changed since the run's last start: %s",
                path, len(changes), _listed([f"{k}: {a} -> {b}" for k, a, b, _ in changes]),
            )
        refused = [f"{k}: {a} -> {b}" for k, a, b, allowed in changes if not allowed]
        if refused and not resumes:
            log.info(
                "%s: the run has no checkpoint yet, so its config is replaced (%d key(s) "
                "that may not change once it has one)", path, len(refused),
            )
        elif refused and not allow_change:
            raise ConfigError(
                f"{path}: the config changed since the run's last start in "
                f"{len(refused)} key(s) that may not change between restarts: "
                f"{_listed(refused)}. Resume anyway with --allow_config_change, or start a "
                "new run in another --trainer_dir"
            )
    all_have_read()
    if write:
        file_system.makedirs(run.root)
        file_system.write_text(path, text)  # Readers see the old record or the whole new one.
