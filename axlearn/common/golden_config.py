"""Golden config files: generate, check and summarise.

For every named trainer config `golden_configs/<module>/` holds:
- `<config>.txt`: the flat config (`cfg.debug_string()`),
- `<config>_init.txt`: each parameter's initializer, shape and fan axes,
- `<config>_regularizer.txt`: each parameter's effective weight-decay scale.
All three come from configs and parameter specs; no parameter is allocated.

    python -m axlearn.common.golden_config             # check; prints unified diffs
    python -m axlearn.common.golden_config --update    # regenerate every file
    python -m axlearn.common.golden_config --summarize_diff [--base=main]
"""

import collections
import difflib
import os
import subprocess
import sys
from collections.abc import Iterable, Sequence
from typing import Any, Optional

from axlearn.common.config import ConfigBase

GOLDEN_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "golden_configs")
UPDATE_ENV = "AXLEARN_UPDATE_GOLDEN"


def config_text(cfg: ConfigBase) -> str:
    return cfg.debug_string()


def _model(cfg: ConfigBase):
    return cfg.model.clone(name="model").instantiate(parent=None)


def init_text(cfg: ConfigBase) -> str:
    """One line per parameter: `path: initializer, shape=[...], axes=FanAxes(...)`."""
    return "\n".join(_model(cfg).describe_initializers())


def regularizer_text(cfg: ConfigBase) -> str:
    from axlearn.common.learner import regularizer_lines  # pylint: disable=import-outside-toplevel

    specs = _model(cfg).create_parameter_specs_recursively()
    return "\n".join(regularizer_lines(cfg.learner, specs))


def golden_texts(cfg: ConfigBase, config_name: str) -> dict[str, str]:
    """File name -> text for one config."""
    return {
        f"{config_name}.txt": config_text(cfg),
        f"{config_name}_init.txt": init_text(cfg),
        f"{config_name}_regularizer.txt": regularizer_text(cfg),
    }


def all_named_configs() -> Iterable[tuple[str, str, Any]]:
    """(module, config name, builder) for every experiment config."""
    from axlearn.common import launch_trainer  # pylint: disable=import-outside-toplevel

    for module in launch_trainer.experiment_modules():
        for name, (mod, builder) in sorted(launch_trainer.named_configs(module).items()):
            yield mod, name, builder


def unified_diff(expected: str, actual: str, path: str) -> str:
    return "\n".join(
        difflib.unified_diff(
            expected.splitlines(), actual.splitlines(), f"{path} (golden)", f"{path} (generated)", lineterm=""
        )
    )


def check_or_update(
    module: str, config_name: str, cfg: ConfigBase, *, update: bool, golden_dir: str = GOLDEN_DIR
) -> list[str]:
    """Writes (update) or compares the files of one config; returns the diffs found."""
    diffs = []
    directory = os.path.join(golden_dir, module)
    for filename, text in golden_texts(cfg, config_name).items():
        path = os.path.join(directory, filename)
        if update:
            os.makedirs(directory, exist_ok=True)
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)
            continue
        if not os.path.exists(path):
            diffs.append(f"{path} is missing; regenerate with `{UPDATE_ENV}=1` or --update")
            continue
        with open(path, encoding="utf-8") as f:
            expected = f.read()
        if expected != text:
            diffs.append(unified_diff(expected, text, os.path.relpath(path)))
    return diffs


# ----- the review aid -----


def _parse_lines(text: str) -> dict[str, str]:
    out = {}
    for line in text.splitlines():
        key, sep, value = line.partition(": ")
        if sep:
            out[key] = value
    return out


def _git_show(rev: str, path: str) -> Optional[str]:
    result = subprocess.run(["git", "show", f"{rev}:{path}"], capture_output=True, text=True, check=False)
    return result.stdout if result.returncode == 0 else None


def summarize_golden_diff(base: str = "HEAD", golden_dir: str = GOLDEN_DIR) -> str:
    """Groups every changed golden line across configs by (key, old -> new).

    E.g. `learner.optimizer.peak_lr: 12 configs, 0.01 -> 0.02`, so that the intent of a
    change that touches hundreds of golden files reads in a screen.
    """
    root = subprocess.run(
        ["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True, check=True
    ).stdout.strip()
    changed = subprocess.run(
        ["git", "diff", "--name-only", base, "--", os.path.relpath(golden_dir, root)],
        capture_output=True, text=True, check=True, cwd=root,
    ).stdout.split()
    untracked = subprocess.run(
        ["git", "ls-files", "--others", "--exclude-standard", "--", os.path.relpath(golden_dir, root)],
        capture_output=True, text=True, check=True, cwd=root,
    ).stdout.split()
    groups: dict[tuple[str, str, str, str], list[str]] = collections.defaultdict(list)
    for rel in sorted(set(changed) | set(untracked)):
        kind = "init" if rel.endswith("_init.txt") else "regularizer" if rel.endswith("_regularizer.txt") else "config"
        name = os.path.basename(rel)
        old = _parse_lines(_git_show(base, rel) or "")
        new_path = os.path.join(root, rel)
        new = _parse_lines(open(new_path, encoding="utf-8").read()) if os.path.exists(new_path) else {}
        for key in sorted(set(old) | set(new)):
            if old.get(key) != new.get(key):
                groups[(kind, key, old.get(key, "(absent)"), new.get(key, "(absent)"))].append(name)
    if not groups:
        return f"No golden changes against {base}."
    lines = [f"Golden changes against {base}: {len(groups)} distinct edits"]
    for (kind, key, old, new), files in sorted(groups.items(), key=lambda kv: (kv[0][0], -len(kv[1]), kv[0][1])):
        configs = sorted({f.rsplit(".", 1)[0] for f in files})
        shown = ", ".join(configs[:4]) + (", ..." if len(configs) > 4 else "")
        lines.append(f"[{kind}] {key}: {len(configs)} configs, {old} -> {new}  ({shown})")
    return "\n".join(lines)


def main(argv: Sequence[str]) -> int:
    import argparse  # pylint: disable=import-outside-toplevel

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--update", action="store_true", help="Regenerate every golden file.")
    parser.add_argument("--summarize_diff", action="store_true", help="Summarise golden changes by key.")
    parser.add_argument("--base", default="HEAD", help="Git revision to compare with (--summarize_diff).")
    parser.add_argument("--config", action="append", help="Only these config names.")
    args = parser.parse_args(argv)
    if args.summarize_diff:
        print(summarize_golden_diff(args.base))
        return 0
    update = args.update or os.environ.get(UPDATE_ENV) == "1"
    failures = []
    for module, name, builder in all_named_configs():
        if args.config and name not in args.config:
            continue
        failures.extend(check_or_update(module, name, builder(), update=update))
    for diff in failures:
        print(diff)
    if failures:
        print(f"\n{len(failures)} golden file(s) differ; regenerate with --update and review the diff.")
        return 1
    print("Golden files " + ("written." if update else "match."))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
