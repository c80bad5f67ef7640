"""A run's record of its config: the resolved config in golden text (`config.txt` in the
trainer directory), compared on every start with the last start's, so that a restart
cannot silently change the run (only RESTARTABLE_KEYS and the fields that follow max_step
may change without --allow_config_change).
"""

import logging
import re
from collections.abc import Callable

from axlearn.common import file_system
from axlearn.common.config import ConfigError
from axlearn.common.golden_text import flat_lines

log = logging.getLogger(__name__)

CONFIG_RECORD = "config.txt"  # The resolved config in golden text, in the trainer directory.
# Keys that may change between restarts of one run: its length, the cadences of logs,
# summaries, evals, checkpoints and traces, and the directory itself (should it move).
# Fields that follow max_step may change with it (`_follows_max_step`).
RESTARTABLE_KEYS = re.compile(
    r"max_step|dir|log_every_n_steps|start_trace_steps(\[\d+\])?|start_trace_num_steps"
    r"|(.+\.)?write_every_n_steps"
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


def config_changes(old_text: str, new_text: str) -> list[tuple[str, str, str, bool]]:
    """(key, old value, new value, whether it may change between restarts) for each key
    that differs between two golden texts; '(absent)' for a key only one has."""
    old, new = flat_lines(old_text), flat_lines(new_text)
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


def check_trainer_dir(trainer_dir: str) -> None:
    """Raises ConfigError for a --trainer_dir URL that no storage driver accepts."""
    try:
        file_system.kvstore_spec(trainer_dir)
    except ValueError as e:
        raise ConfigError(f"--trainer_dir={trainer_dir}: {e}") from e


def record_config(
    trainer_dir: str,
    text: str,
    *,
    allow_change: bool,
    write: bool,
    all_have_read: Callable[[], None] = lambda: None,
) -> None:
    """Compares `text` with the config recorded by the run's last start, if any, and
    records it (`write`: process 0 only).

    Changed keys are logged; a change outside RESTARTABLE_KEYS and the fields that follow
    max_step is an error listing those keys, unless `allow_change`. `all_have_read` returns
    once every process has compared (a barrier), so that all compare with the same record.
    """
    path = file_system.join(trainer_dir, CONFIG_RECORD)
    if file_system.isfile(path):
        changes = config_changes(file_system.read_text(path), text)
        if changes:
            log.info(
                "%s: %d key(s) changed since the run's last start: %s",
                path, len(changes), "; ".join(f"{k}: {a} -> {b}" for k, a, b, _ in changes),
            )
        refused = [f"{k}: {a} -> {b}" for k, a, b, allowed in changes if not allowed]
        if refused and not allow_change:
            raise ConfigError(
                f"{path}: the config changed since the run's last start in {len(refused)} "
                f"key(s) that may not change between restarts: {'; '.join(refused)}. Resume "
                "anyway with --allow_config_change, or start a new run in another --trainer_dir"
            )
    all_have_read()
    if write:
        file_system.makedirs(trainer_dir)
        file_system.write_text(path, text)  # Readers see the old record or the whole new one.
