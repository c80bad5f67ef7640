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
import re
import subprocess
import sys
from collections.abc import Callable, Iterable, Sequence
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


# A mesh rule's golden lines: `mesh_rules[i][0]` is its pattern, `mesh_rules[i][1]...` what
# it applies.
_MESH_RULE_LINE = re.compile(r"mesh_rules\[(\d+)\](.*)")


def _split_mesh_rules(flat: dict[str, str]) -> tuple[dict[str, str], list[tuple[str, dict]]]:
    """(the lines that are no mesh rule's, [(pattern, {key suffix: value})] per rule)."""
    rest, rules = {}, collections.defaultdict(dict)
    for key, value in flat.items():
        match = _MESH_RULE_LINE.fullmatch(key)
        if match:
            rules[int(match.group(1))][match.group(2)] = value
        else:
            rest[key] = value
    return rest, [(rules[i].get("[0]", f"#{i}"), rules[i]) for i in sorted(rules)]


def align_mesh_rules(
    old: dict[str, str], new: dict[str, str]
) -> tuple[dict[str, str], dict[str, str], list[tuple[str, str, str]]]:
    """Two configs' flat lines with their mesh rules matched by pattern rather than by
    index, so that a rule inserted in the list is one edit, not a shift of every later
    rule's lines: returns (old, new) with each matched rule's lines keyed by its pattern
    (`mesh_rules['gpu-...'][1]...`), and (key, old, new) per rule only one side has."""
    old_rest, old_rules = _split_mesh_rules(old)
    new_rest, new_rules = _split_mesh_rules(new)
    matcher = difflib.SequenceMatcher(
        None, [p for p, _ in old_rules], [p for p, _ in new_rules], autojunk=False
    )
    edits = []
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal" or (tag == "replace" and i2 - i1 == j2 - j1):
            # The same rules, or as many rules in place whose patterns changed.
            for (pattern, old_lines), (_, new_lines) in zip(
                old_rules[i1:i2], new_rules[j1:j2]
            ):
                old_rest.update({f"mesh_rules[{pattern}]{k}": v for k, v in old_lines.items()})
                new_rest.update({f"mesh_rules[{pattern}]{k}": v for k, v in new_lines.items()})
            continue
        edits += [("mesh_rules", f"rule {pattern}", "(absent)") for pattern, _ in old_rules[i1:i2]]
        edits += [("mesh_rules", "(absent)", f"rule {pattern}") for pattern, _ in new_rules[j1:j2]]
    return old_rest, new_rest, edits


def _line_changes(old_text: str, new_text: str) -> list[tuple[str, str, str]]:
    """(key, old value, new value) per changed line of two golden texts, mesh rules
    matched by pattern (`align_mesh_rules`); '(absent)' for a side without the key."""
    old, new, edits = align_mesh_rules(flat_lines(old_text), flat_lines(new_text))
    changes = [
        (key, old.get(key, "(absent)"), new.get(key, "(absent)"))
        for key in sorted(set(old) | set(new))
        if old.get(key) != new.get(key)
    ]
    return changes + edits


def _summary(
    header: str,
    changed: Iterable[tuple[str, str, str]],
    added: Sequence[str],
    removed: Sequence[str],
) -> list[str]:
    """The review lines of changed files, as (golden path, old text, new text): one line
    per (file kind, key, old -> new), widest first, then the added and removed files."""
    groups: dict[tuple[str, str, str, str], list[str]] = collections.defaultdict(list)
    for rel, old_text, new_text in changed:
        kind, config = _kind_and_config(rel)
        for key, old, new in _line_changes(old_text, new_text):
            groups[(kind, key, old, new)].append(config)
    lines = [
        f"{header}: {len(groups)} distinct edits, {len(added)} files added, "
        f"{len(removed)} removed"
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
    return lines


def generated_golden_texts() -> dict[str, str]:
    """`<module>/<file>` -> text of every golden file the named configs make now: what
    --update writes."""
    texts = {}
    for module, name, builder in all_named_configs():
        for filename, text in golden_texts(builder(), name).items():
            texts[f"{module}/{filename}"] = text
    return texts


def _pending_changes(
    golden_dir: str, generated: dict[str, str]
) -> tuple[list[tuple[str, str, str]], list[str], list[str]]:
    """(changed, added, removed) golden files between `golden_dir` and `generated`."""
    shown_dir = os.path.basename(os.path.normpath(golden_dir))
    changed, added = [], []
    for rel, text in sorted(generated.items()):
        path = os.path.join(golden_dir, rel)
        if not os.path.exists(path):
            added.append(f"{shown_dir}/{rel}")
        elif read_text(path) != text:
            changed.append((f"{shown_dir}/{rel}", read_text(path), text))
    removed = [f"{shown_dir}/{rel}" for rel in stale_files(generated, golden_dir)]
    return changed, added, removed


def summarize_golden_diff(
    base: str = "HEAD",
    golden_dir: str = GOLDEN_DIR,
    generate: Optional[Callable[[], dict[str, str]]] = generated_golden_texts,
) -> str:
    """Groups every changed golden line across configs by (file kind, key, old -> new).

    One line per group, e.g. `[config] learner.optimizer.peak_lr: 12 configs, 0.01 -> 0.02
    (gpt/gpt_1b, ...)`, so that the intent of a change touching hundreds of golden files
    reads in a screen; a mesh rule added to or removed from the rule list is one line
    (`align_mesh_rules`). Added and removed golden files are listed, not diffed. Compares
    the working tree (uncommitted and untracked files included) with git revision `base`.
    Where the golden files equal `base`, compares them with what the code generates now
    (`generate`, e.g. `generated_golden_texts`; None: not compared): the edits that the
    check reports and --update would write.
    """
    root = _git(["rev-parse", "--show-toplevel"], cwd=golden_dir).strip()
    rel_dir = os.path.relpath(os.path.realpath(golden_dir), os.path.realpath(root))
    changed_paths = _git(["diff", "--name-only", base, "--", rel_dir], cwd=root).split()
    untracked = _git(
        ["ls-files", "--others", "--exclude-standard", "--", rel_dir], cwd=root
    ).split()
    changed, added, removed = [], [], []
    for rel in sorted(set(changed_paths) | set(untracked)):
        old_text = _git_show(base, rel, cwd=root)
        new_path = os.path.join(root, rel)
        if old_text is None:
            added.append(rel)
        elif not os.path.exists(new_path):
            removed.append(rel)
        else:
            with open(new_path, encoding="utf-8") as f:
                changed.append((rel, old_text, f.read()))
    if changed or added or removed:
        return "\n".join(_summary(f"Golden changes against {base}", changed, added, removed))
    if generate is None:
        return f"No golden changes against {base}."
    pending = _pending_changes(golden_dir, generate())
    if not any(pending):
        return f"No golden changes against {base}; the code generates the same golden files."
    header = (
        f"No golden changes against {base}, but the code generates other golden text (the "
        "check fails; --update writes it)"
    )
    return "\n".join(_summary(header, *pending))


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
