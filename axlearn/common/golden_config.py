"""Golden config files: generate, check and summarise.

For every named trainer config (`experiments/<module>.py`, `named_trainer_configs()`)
`golden_configs/<module>/` holds:
- `<config>.txt`: the flat config (`cfg.debug_string()`), one `key: value` line per field;
- `<config>_init.txt`: each parameter's initializer (with the shape and fan axes it
  scales by), in AXLearn's format and order, so an AXLearn `_init` golden of the same
  model compares line for line;
- `<config>_regularizer.txt`: each parameter's effective weight-decay scale (AXLearn's
  format too).
All three come from configs and parameter specs; no parameter is allocated, so even the
largest config dumps in well under a second. See docs/golden_configs.md.

    python -m axlearn.common.golden_config             # check; prints unified diffs
    python -m axlearn.common.golden_config --update    # regenerate (or AXLEARN_UPDATE_GOLDEN=1)
    python -m axlearn.common.golden_config --summarize_diff [--base=main]   # review aid
"""

import collections
import difflib
import os
import subprocess
import sys
from collections.abc import Iterable, Sequence
from typing import Any, Optional

from absl import flags

from axlearn.common.command_flags import parse_command_flags
from axlearn.common.config import ConfigBase, ConfigError
from axlearn.common.golden_text import flat_lines, init_lines, regularizer_lines

_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GOLDEN_DIR = os.path.join(_REPO_ROOT, "golden_configs")
UPDATE_ENV = "AXLEARN_UPDATE_GOLDEN"
REGENERATE_COMMAND = (
    f"python -m axlearn.common.golden_config --update  (or {UPDATE_ENV}=1 pytest "
    "tests/test_golden_configs.py)"
)


def config_text(cfg: ConfigBase) -> str:
    return cfg.debug_string()


def _model(cfg: ConfigBase):
    # Instantiating a model builds its module tree only; parameters are never created.
    return cfg.model.clone(name="model").instantiate(parent=None)


def init_text(cfg: ConfigBase) -> str:
    """One line per parameter, in the order the model creates them (not sorted), as
    AXLearn writes them (`golden_text.init_lines`): `path: constant(1.0)`, or
    `path: normal(0, 1.0 / fan_in), shape=(8, 32), axes=FanAxes(...)` for a weight."""
    return "\n".join(init_lines(_model(cfg)))


def regularizer_text(cfg: ConfigBase) -> str:
    """A header, then `path: weight-decay scale` per parameter."""
    # pylint: disable-next=import-outside-toplevel
    from axlearn.common.learner import weight_decay_scales

    specs = _model(cfg).create_parameter_specs_recursively()
    return "\n".join(regularizer_lines(weight_decay_scales(cfg.learner, specs)))


def golden_file_names(config_name: str) -> list[str]:
    """The config, init and regularizer file names of a config."""
    return [f"{config_name}.txt", f"{config_name}_init.txt", f"{config_name}_regularizer.txt"]


def golden_texts(cfg: ConfigBase, config_name: str) -> dict[str, str]:
    """File name -> text for one config."""
    texts = (config_text(cfg), init_text(cfg), regularizer_text(cfg))
    return dict(zip(golden_file_names(config_name), texts))


def all_named_configs() -> Iterable[tuple[str, str, Any]]:
    """(module, config name, builder) for every experiment config."""
    from axlearn.common import experiment_registry  # pylint: disable=import-outside-toplevel

    for module in experiment_registry.experiment_modules():
        for name, (mod, builder) in sorted(experiment_registry.named_configs(module).items()):
            yield mod, name, builder


def read_text(path: str) -> str:
    # newline="": compare bytes as written, with no newline translation.
    with open(path, encoding="utf-8", newline="") as f:
        return f.read()


def write_text(path: str, text: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8", newline="") as f:
        f.write(text)


def unified_diff(expected: str, actual: str, path: str) -> str:
    """A readable diff of golden (`expected`) against generated (`actual`) text."""
    diff = "\n".join(
        difflib.unified_diff(
            expected.splitlines(),
            actual.splitlines(),
            f"{path} (checked in)",
            f"{path} (generated)",
            lineterm="",
        )
    )
    if not diff:  # Same lines: the texts differ in line endings or a final newline.
        diff = f"{path}: same lines, different line endings or final newline"
    return diff


def check_or_update(
    module: str, config_name: str, cfg: ConfigBase, *, update: bool, golden_dir: str = GOLDEN_DIR
) -> list[str]:
    """Writes (update) or compares the files of one config; returns the problems found."""
    problems = []
    for filename, text in golden_texts(cfg, config_name).items():
        path = os.path.join(golden_dir, module, filename)
        shown = os.path.relpath(path, os.path.dirname(golden_dir))
        if update:
            write_text(path, text)
        elif not os.path.exists(path):
            problems.append(f"{shown} is missing; regenerate with {REGENERATE_COMMAND}")
        elif read_text(path) != text:
            problems.append(unified_diff(read_text(path), text, shown))
    return problems


def stale_files(expected: Iterable[str], golden_dir: str = GOLDEN_DIR) -> list[str]:
    """Golden files (`<module>/<file>.txt` under `golden_dir`) of no current config."""
    expected = set(expected)
    found = []
    if os.path.isdir(golden_dir):
        for module in sorted(os.listdir(golden_dir)):
            directory = os.path.join(golden_dir, module)
            if os.path.isdir(directory):
                names = sorted(os.listdir(directory))
                found += [f"{module}/{name}" for name in names if name.endswith(".txt")]
    return [rel for rel in found if rel not in expected]


# ----- the review aid -----

_SUFFIXES = (("_init.txt", "init"), ("_regularizer.txt", "regularizer"), (".txt", "config"))


def _kind_and_config(rel_path: str) -> tuple[str, str]:
    """('config' | 'init' | 'regularizer', '<module>/<config>') of a golden file path."""
    module, name = os.path.split(rel_path)
    for suffix, kind in _SUFFIXES:
        if name.endswith(suffix):
            return kind, f"{os.path.basename(module)}/{name[: -len(suffix)]}"
    return "other", rel_path


def _git(args: Sequence[str], cwd: str) -> str:
    result = subprocess.run(["git", *args], capture_output=True, text=True, check=True, cwd=cwd)
    return result.stdout


def _git_show(rev: str, path: str, cwd: str) -> Optional[str]:
    result = subprocess.run(
        ["git", "show", f"{rev}:{path}"], capture_output=True, text=True, check=False, cwd=cwd
    )
    return result.stdout if result.returncode == 0 else None


def summarize_golden_diff(base: str = "HEAD", golden_dir: str = GOLDEN_DIR) -> str:
    """Groups every changed golden line across configs by (file kind, key, old -> new).

    One line per group, e.g. `[config] learner.optimizer.peak_lr: 12 configs, 0.01 -> 0.02
    (gpt/gpt_1b, ...)`, so that the intent of a change touching hundreds of golden files
    reads in a screen. Added and removed golden files are listed, not diffed. Compares the
    working tree (uncommitted and untracked files included) with git revision `base`.
    """
    root = _git(["rev-parse", "--show-toplevel"], cwd=golden_dir).strip()
    rel_dir = os.path.relpath(os.path.realpath(golden_dir), os.path.realpath(root))
    changed = _git(["diff", "--name-only", base, "--", rel_dir], cwd=root).split()
    untracked = _git(
        ["ls-files", "--others", "--exclude-standard", "--", rel_dir], cwd=root
    ).split()
    groups: dict[tuple[str, str, str, str], list[str]] = collections.defaultdict(list)
    added, removed = [], []
    for rel in sorted(set(changed) | set(untracked)):
        kind, config = _kind_and_config(rel)
        old_text = _git_show(base, rel, cwd=root)
        new_path = os.path.join(root, rel)
        if old_text is None:
            added.append(rel)
            continue
        if not os.path.exists(new_path):
            removed.append(rel)
            continue
        with open(new_path, encoding="utf-8") as f:
            new = flat_lines(f.read())
        old = flat_lines(old_text)
        for key in sorted(set(old) | set(new)):
            if old.get(key) != new.get(key):
                change = (kind, key, old.get(key, "(absent)"), new.get(key, "(absent)"))
                groups[change].append(config)
    if not (groups or added or removed):
        return f"No golden changes against {base}."
    lines = [
        f"Golden changes against {base}: {len(groups)} distinct edits, "
        f"{len(added)} files added, {len(removed)} removed"
    ]
    # Widest changes first: they carry the intent; one-off edits follow.
    ordered = sorted(groups.items(), key=lambda kv: (kv[0][0], -len(set(kv[1])), kv[0][1]))
    for (kind, key, old, new), configs in ordered:
        configs = sorted(set(configs))
        shown = ", ".join(configs[:4]) + (", ..." if len(configs) > 4 else "")
        noun = "config" if len(configs) == 1 else "configs"
        lines.append(f"[{kind}] {key}: {len(configs)} {noun}, {old} -> {new}  ({shown})")
    lines += [f"[added] {rel}" for rel in added]
    lines += [f"[removed] {rel}" for rel in removed]
    return "\n".join(lines)


def define_flags(flag_values: flags.FlagValues) -> None:
    """The command's flags, on `flag_values`."""
    flags.DEFINE_bool("update", False, "Regenerate the golden files.", flag_values=flag_values)
    flags.DEFINE_bool(
        "summarize_diff", False, "Summarise golden changes by key.", flag_values=flag_values
    )
    flags.DEFINE_string("base", "HEAD", "Git revision to compare with.", flag_values=flag_values)
    flags.DEFINE_multi_string(
        "config", None, "Only these config names.", flag_values=flag_values
    )


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Checks (or with --update, writes) the golden files; returns the exit status."""
    args, _ = parse_command_flags(
        define_flags, argv, program="axlearn.common.golden_config", doc=__doc__
    )
    if args.summarize_diff:
        print(summarize_golden_diff(args.base))
        return 0
    update = args.update or os.environ.get(UPDATE_ENV) == "1"
    if args.config:
        from axlearn.common import experiment_registry  # pylint: disable=import-outside-toplevel

        for name in args.config:  # A name that no config has is an error, not "all match".
            try:
                experiment_registry.lookup_named_config(name)
            except ConfigError as e:
                print(f"golden_config: {e}", file=sys.stderr)
                return 2
    problems, expected = [], []
    for module, name, builder in all_named_configs():
        expected += [f"{module}/{filename}" for filename in golden_file_names(name)]
        if args.config and name not in args.config:
            continue
        problems.extend(check_or_update(module, name, builder(), update=update))
    if not args.config:
        for rel in stale_files(expected):
            if update:
                os.remove(os.path.join(GOLDEN_DIR, rel))
                print(f"Removed {rel}: no config generates it.")
            else:
                problems.append(f"golden_configs/{rel}: no config makes it (--update removes it)")
    for problem in problems:
        print(problem)
    if problems:
        print(f"\n{len(problems)} golden file problem(s); regenerate with {REGENERATE_COMMAND}")
        print("and review the diff (python -m axlearn.common.golden_config --summarize_diff).")
        return 1
    print("Golden files " + ("written." if update else "match."))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
