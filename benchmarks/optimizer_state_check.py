"""Trains a named config twice from the same seed and data: with its optimizer's state as
configured and with the state kept in another dtype between steps
(`optimizers.cast_optimizer_state` around the whole optimizer). Prints both runs'
training losses side by side at every step the summary writer logged (or their means over
`--window` steps), then each evaler's loss at every step it ran: what the rounding costs in
quality, next to what `axlearn.bench --compare_configs` measures in speed. The single-step
training loss of a small batch is noisy; the evalers' losses, over their whole input, are
the steadier measure.

One pair is not enough on a GPU, whose nondeterministic sums make two identical runs
differ by as much as the rounding does. `--json_out` records each run's config, seed,
overrides, setup (the device kind, the Python version and `--data_dir`: the built-in
corpus is the running Python's standard library, so another Python trains and validates
on other text) and how its optimizer state was kept (its dtype, and whether rounded
stochastically: `--rounding`); `--summarize` reads any number of those files, groups the
runs by that and by their `--recipe_override`s (a change of recipe other than the state's
dtype, such as Adastar without its update clipping), and prints each group's mean and
spread by step with the difference of the means and its standard error, and the same
difference matched by seed. It lists each group's setups first, and warns where a group
shares none with the reference. Even one setup differs from host to host: float32 state's
eight runs on one 4× H200 host ended 0.039 ± 0.015 above eight on another
(docs/benchmarks.md, the twenty-eighth round), as large as any dtype's difference. So
spread each group over several hosts (4-GPU calls) and compare groups, not hosts, or pair
the runs of two groups on one host; after each evaler's table, a group whose runs came
from several files (a file usually holds one call's, on one host) is listed by file.

    # CPU, ~3 minutes: gpt_test on the built-in corpus.
    PYTHONPATH=. python benchmarks/optimizer_state_check.py --config=gpt_test --trainer_dir=/tmp/osc

    # gpt_1b on one H100, on the built-in corpus (real text; the reference corpora need not
    # be at hand): 700 steps of a whole short schedule (warm-up 100, cosine to step 700), the
    # validation split evaluated every 100 steps (docs/benchmarks.md, the twenty-second
    # round). Vary --config_override=seed=N and alternate --cast_first across calls
    # (--cast_only trains the cast run alone, against float32 runs already on file);
    # --state_dtype=float32 gives a control pair that differs only by the GPU's sums:
    PYTHONPATH=. python benchmarks/optimizer_state_check.py --config=gpt_1b \
        --mesh_selector=gpu-h100-1 --data_dir=BUILTIN --trainer_dir=/tmp/osc \
        --config_override=seed=1 --config_override=input.global_batch_size=4 \
        --config_override=max_step=700 \
        --config_override=learner.optimizer.inner.update_schedule.warmup_steps=100 \
        --config_override=learner.optimizer.inner.update_schedule.max_step=700 \
        --config_override=summary_writer.write_every_n_steps=1 \
        --config_override="evalers['openwebtext_2'].input.global_batch_size=4" \
        --config_override="evalers['openwebtext_2'].eval_policy.n=100" \
        --window=100 --json_out=/tmp/q_seed1.json

    # A recipe of its own, beside float24 state runs of the same command:
    #   ... --state_dtype=float24 --cast_only \
    #   --recipe_override=learner.optimizer.inner.raw_update_clipping_threshold=None

    # A named variant that keeps its state in dtypes of its own, trained as configured (its
    # schedule one level deeper for each cast around Adastar):
    #   ... --config=gpt_1b_narrow_state --configured_only \
    #   --config_override=learner.optimizer.inner.inner.inner.update_schedule.max_step=700 ...

    # The runs of several such files, by state dtype and recipe (--reference=LABEL: the
    # group the others are compared with, e.g. float24; default float32):
    python benchmarks/optimizer_state_check.py --summarize /tmp/q_seed*.json --window=100
"""

import argparse
import json
import math
import os
import platform
import statistics
from collections.abc import Callable
from typing import Any, Optional

import jax
import jax.numpy as jnp

from axlearn.bench import write_json
from axlearn.common import launch
from axlearn.common.base_layer import flatten_with_paths
from axlearn.common.config import config_for_function
from axlearn.common.launch_trainer import build_trainer_config
from axlearn.common.optimizers import (
    ROUNDING_MODES,
    StochasticRoundingState,
    cast_optimizer_state,
    is_state_tensor,
)
from axlearn.common.split_float import FLOAT24, is_float24
from axlearn.common.summary_writer import JSONL_FILE_NAME


def _logged_losses(writer) -> dict[int, float]:
    """The loss at every step a summary writer logged, from its metrics.jsonl (none if it
    wrote no file: an evaler whose policy never fired in the run)."""
    path = os.path.join(writer.config.dir, JSONL_FILE_NAME)
    if not os.path.exists(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f) if "loss" in r}


def _state_label(optimizer_state: Any) -> str:
    """How the optimizer keeps its state tensors: their dtype ('float32', 'bfloat16',
    'float24' for `split_float.Float24`), or where they differ each dtype with the state
    fields that hold it ('bfloat16 update_ema, float32 gradient_square_ema'), then
    ', stochastic rounding' where `cast_optimizer_state` rounds them so. Scalars (counters,
    schedules' steps) do not count."""
    fields_by_dtype: dict[str, set[str]] = {}
    for path, leaf in flatten_with_paths(optimizer_state, is_leaf=is_float24):
        if is_float24(leaf):
            dtype = FLOAT24
        elif is_state_tensor(leaf.shape, leaf.dtype):
            dtype = jnp.dtype(leaf.dtype).name
        else:
            continue
        # The state field: the first name on the path that is not a wrapper's.
        names = [p for p in path.split("/") if not p.isdigit() and p != "inner_state"]
        fields_by_dtype.setdefault(dtype, set()).add(names[0])
    if len(fields_by_dtype) == 1:
        label = next(iter(fields_by_dtype))
    else:
        label = ", ".join(
            f"{dtype} {'+'.join(sorted(fields))}" for dtype, fields in sorted(fields_by_dtype.items())
        )
    stochastic = any(
        isinstance(node, StochasticRoundingState)
        for node in jax.tree.leaves(
            optimizer_state, is_leaf=lambda n: isinstance(n, StochasticRoundingState)
        )
    )
    return label + (", stochastic rounding" if stochastic else "")


def _train(args: argparse.Namespace, run_dir: str, state_dtype) -> dict[str, Any]:
    """Trains into `run_dir`, its optimizer state cast to `state_dtype` (None: as configured);
    returns the run's record: its config, overrides and seed, how its optimizer state was
    kept (`_state_label`), its recipe overrides (`--recipe_override`, applied after
    `--config_override`; recorded apart, since they name the recipe, not the run's setup),
    and the logged losses by source: 'train' (the training loss of single steps), then each
    evaler's name (its loss over its whole input)."""
    if os.path.exists(run_dir) and os.listdir(run_dir):
        raise SystemExit(f"{run_dir} is not empty (the trainer would resume from it): remove it")
    cfg = build_trainer_config(
        config_name=args.config,
        mesh_selector=args.mesh_selector,
        data_dir=args.data_dir,
        config_overrides=args.config_override + args.recipe_override,
        trainer_dir=run_dir,
    )
    if state_dtype is not None:
        # Around the whole optimizer, whatever it is: its integer counters keep their dtype.
        cfg.learner.optimizer = config_for_function(cast_optimizer_state).set(
            inner=cfg.learner.optimizer,
            dtype=state_dtype,
            rounding=args.rounding,
            state_paths=args.state_paths,
        )
    trainer = cfg.instantiate(parent=None)
    trainer.run()
    losses = {"train": _logged_losses(trainer.summary_writer)}
    for name in cfg.evalers:
        if "summary_writer" in trainer.children[name].children:
            logged = _logged_losses(trainer.children[name].summary_writer)
            if logged:
                losses[name] = logged
    return {
        "config": args.config,
        "config_overrides": args.config_override,
        "seed": cfg.seed or 0,
        "state": _state_label(trainer.trainer_state.learner["optimizer"]),
        "recipe_overrides": args.recipe_override,
        "setup": _setup(args.data_dir),
        "losses": losses,
    }


def _setup(data_dir: Optional[str]) -> dict[str, Optional[str]]:
    """What besides the recipe sets a run's losses: the device kind (its kernels' sums), and
    the data. The built-in corpus is the running Python's standard library, so its text,
    and with it every loss, changes with the Python version."""
    return {
        "device": jax.devices()[0].device_kind,
        "python": platform.python_version(),
        "data_dir": data_dir,
    }


_NOT_RECORDED = "not recorded"  # The setup label of records written before setups were.


def _setup_label(run: dict[str, Any]) -> str:
    """A run's setup in words, or `_NOT_RECORDED`."""
    setup = run.get("setup")
    if setup is None:
        return _NOT_RECORDED
    data = setup["data_dir"] or "as configured"
    return f"{setup['device']}, Python {setup['python']}, data {data}"


def _window_means(losses: dict[int, float], window: int) -> dict[int, float]:
    """The mean loss of the logged steps in each `window` steps, keyed by the window's last step."""
    sums: dict[int, list[float]] = {}
    for step, loss in losses.items():
        sums.setdefault(-(-step // window) * window, []).append(loss)
    return {end: sum(v) / len(v) for end, v in sums.items()}


def _print_side_by_side(title: str, curves: dict[str, dict[int, float]]) -> None:
    """One column a run (one or two), and with two the second's difference from the first."""
    names, losses = list(curves), list(curves.values())
    diff = " | diff" if len(curves) == 2 else ""
    print(f"{title}\n{'step':>6} | " + " | ".join(f"{n:>22}" for n in names) + diff)
    for step in sorted(set.intersection(*map(set, losses))):
        values = [curve[step] for curve in losses]
        line = f"{step:>6} | " + " | ".join(f"{v:>22.4f}" for v in values)
        print(line + (f" | {values[1] - values[0]:+.4f}" if diff else ""))


def _mean_and_sd(values: list[float]) -> tuple[float, float]:
    """The mean of `values` and their sample standard deviation (NaN for one value)."""
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else math.nan


def summarize(
    runs: list[dict[str, Any]], source: str, window: int = 0, reference: Optional[str] = None
) -> list[dict[str, Any]]:
    """The runs' losses of `source` (their means over `window` steps, if given) grouped by
    recipe (`_group_label`: how their optimizer state was kept, and their recipe overrides),
    at every step that all runs logged: a row a step with each group's n, mean and sample
    standard deviation, and each other group's mean minus the reference group's
    (`reference`; None: float32, where present) two ways:

    - "diff", "se": the groups' means, with Welch's standard error sqrt(s1^2/n1 + s2^2/n2);
    - "paired_diff", "paired_se", "seeds": matched by seed, over the seeds both groups ran:
      the mean over those seeds of (the group's mean of the seed's runs minus the
      reference's), with that mean's standard error. The trainer's seed (`seed=N`) fixes
      the initial weights, so pairing takes their share out of the spread. The data's
      order has a seed of its own (`input.seed`, 0 unless overridden), so runs that
      override only the trainer's see the same batches in the same order.
    """
    groups: dict[str, list[tuple[int, dict[int, float]]]] = {}
    for run in runs:
        curve = {int(step): loss for step, loss in run["losses"][source].items()}
        groups.setdefault(_group_label(run), []).append(
            (run["seed"], _window_means(curve, window) if window else curve)
        )
    reference = _reference(set(groups), reference)
    steps = sorted(
        set.intersection(*(set(curve) for runs_ in groups.values() for _, curve in runs_))
    )
    rows = []
    for step in steps:
        by_seed = {
            label: _losses_by_seed([(seed, curve[step]) for seed, curve in runs_])
            for label, runs_ in groups.items()
        }
        stats = {}
        for label, runs_ in groups.items():
            mean, sd = _mean_and_sd([curve[step] for _, curve in runs_])
            stats[label] = {"n": len(runs_), "mean": mean, "sd": sd}
        ref = stats[reference]
        diffs = {}
        for label, s in stats.items():
            if label == reference:
                continue
            seeds = sorted(set(by_seed[label]) & set(by_seed[reference]))
            paired = [by_seed[label][seed] - by_seed[reference][seed] for seed in seeds]
            paired_diff, paired_sd = _mean_and_sd(paired) if paired else (math.nan, math.nan)
            diffs[label] = {
                "diff": s["mean"] - ref["mean"],
                "se": math.sqrt(s["sd"] ** 2 / s["n"] + ref["sd"] ** 2 / ref["n"]),
                "paired_diff": paired_diff,
                "paired_se": paired_sd / math.sqrt(len(seeds)) if seeds else math.nan,
                "seeds": len(seeds),
            }
        rows.append({"step": step, "reference": reference, "groups": stats, "diffs": diffs})
    return rows


def _group_label(run: dict[str, Any]) -> str:
    """The recipe a run belongs to: how its optimizer state was kept, then its recipe
    overrides, if any ('float24, learner.optimizer.inner.raw_update_clipping_threshold=None').
    Records written before recipe overrides were have none."""
    return ", ".join([run["state"]] + run.get("recipe_overrides", []))


def _reference(labels: set[str], reference: Optional[str] = None) -> str:
    """The group the others are compared with: `reference` if given, else float32 state
    where present, else the first label in sorted order."""
    if reference is not None:
        if reference not in labels:
            raise SystemExit(
                f"--reference={reference!r} names no group; the groups: {sorted(labels)}"
            )
        return reference
    return "float32" if "float32" in labels else sorted(labels)[0]


def _losses_by_seed(seeded_losses: list[tuple[int, float]]) -> dict[int, float]:
    """The mean loss of each seed's runs."""
    by_seed: dict[int, list[float]] = {}
    for seed, loss in seeded_losses:
        by_seed.setdefault(seed, []).append(loss)
    return {seed: statistics.fmean(losses) for seed, losses in by_seed.items()}


def _load_runs(paths: list[str]) -> list[dict[str, Any]]:
    """Every run recorded in the --json_out files at `paths`, each with its file's name
    under "file"."""
    runs = []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            for name, run in json.load(f).items():
                if "state" not in run or "losses" not in run:
                    raise SystemExit(f"{path}: run {name!r} has no 'state' and 'losses'")
                runs.append(dict(run, file=os.path.basename(path)))
    return runs


def _difference(diff: float, se: float) -> str:
    """'diff ± se' to 4 decimals, or in scientific notation where the standard error is under
    their last place (seed-matched runs on the CPU can agree to 1e-6)."""
    if se < 5e-5:
        return f"{diff:+.1e} ± {se:.1e}"
    return f"{diff:+.4f} ± {se:.4f}"


def _print_summary(
    runs: list[dict[str, Any]], window: int, reference: Optional[str] = None
) -> None:
    """Prints `summarize` for each evaler, and for the training loss's `window` means if given
    (its single steps are too noisy to compare across runs), after the runs' setups."""
    reference = _reference({_group_label(run) for run in runs}, reference)
    _print_setups(runs, reference)
    for source in runs[0]["losses"]:
        if source == "train" and not window:
            continue
        rows = summarize(runs, source, window if source == "train" else 0, reference)
        if not rows:
            continue
        if source == "train":
            title = f"Training loss, means over {window} steps"
        else:
            title = f"Evaler '{source}' loss"
        reference = rows[0]["reference"]
        others = [label for label in rows[0]["groups"] if label != reference]
        print(
            f"{title}: mean ± standard deviation of the runs; difference ± its standard error, "
            "of the groups' means and matched by seed"
        )
        header = " | ".join(
            f"{d} (n={rows[0]['groups'][d]['n']})".center(15) for d in [reference] + others
        )
        differences = [f"{d} - {reference}" for d in others]
        differences += [
            f"{d} - {reference}, by seed ({rows[0]['diffs'][d]['seeds']} seeds)" for d in others
        ]
        print(f"{'step':>6} | {header} | " + " | ".join(differences))
        for row in rows:
            cells = [
                f"{row['groups'][d]['mean']:.4f} ± {row['groups'][d]['sd']:.4f}"
                for d in [reference] + others
            ]
            cells += [_difference(row["diffs"][d]["diff"], row["diffs"][d]["se"]) for d in others]
            cells += [
                _difference(row["diffs"][d]["paired_diff"], row["diffs"][d]["paired_se"])
                for d in others
            ]
            print(f"{row['step']:>6} | " + " | ".join(cells))
        if source != "train":
            _print_by_file(runs, source, rows[-1]["step"])


def _runs_by_group(
    runs: list[dict[str, Any]], key: Callable[[dict[str, Any]], str]
) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """The runs by group (`_group_label`), then by `key(run)`, in the order first seen."""
    by_group: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for run in runs:
        by_group.setdefault(_group_label(run), {}).setdefault(key(run), []).append(run)
    return by_group


def _print_by_file(runs: list[dict[str, Any]], source: str, step: int) -> None:
    """Each group's loss of `source` at `step` by the file its runs came from, for the groups
    whose runs came from several: a file usually holds one call's runs, on one host, and
    hosts of one setup can differ by as much as the dtypes (the module's docstring)."""
    lines = []
    for label, files in _runs_by_group(runs, lambda run: run.get("file", "?")).items():
        if len(files) > 1:
            cells = []
            for name, runs_ in files.items():
                losses = [run["losses"][source][str(step)] for run in runs_]
                mean, sd = _mean_and_sd(losses)
                spread = f" ± {sd:.4f}" if len(losses) > 1 else ""
                cells.append(f"{name} {mean:.4f}{spread} (n={len(losses)})")
            lines.append(f"  {label}: " + "; ".join(cells))
    if lines:
        print(
            f"Evaler '{source}' loss at step {step} by file (one call's runs; on a GPU, "
            "usually one host's):"
        )
        print("\n".join(lines))


def _print_setups(runs: list[dict[str, Any]], reference: str) -> None:
    """Each group's runs by setup (`_setup`); a warning for a group that shares no recorded
    setup with the reference, whose differences then include the setups' own."""
    by_group = _runs_by_group(runs, _setup_label)
    print("Setups (device, Python, data):")
    for label, setups in by_group.items():
        print(f"  {label}: " + "; ".join(f"{len(r)} x {setup}" for setup, r in setups.items()))
    ref_recorded = set(by_group[reference]) - {_NOT_RECORDED}
    for label, setups in by_group.items():
        recorded = set(setups) - {_NOT_RECORDED}
        if label != reference and recorded and ref_recorded and not recorded & ref_recorded:
            print(
                f"WARNING: {label} and {reference} ran on different setups: their differences "
                "include the setups' own (another device kind, or another Python, whose "
                "standard library is the built-in corpus)."
            )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", default="gpt_test")
    parser.add_argument("--mesh_selector", default=None)
    parser.add_argument("--data_dir", default=None, help="As the launcher's (FAKE, BUILTIN, a path).")
    parser.add_argument("--config_override", action="append", default=[])
    parser.add_argument(
        "--recipe_override", action="append", default=[],
        help="A config override that makes a recipe of its own (e.g. "
        "learner.optimizer.inner.raw_update_clipping_threshold=None): applied after the "
        "--config_overrides and recorded apart, so --summarize groups its runs apart from "
        "runs of the same state dtype without it. Use --state_dtype=float32 --cast_only for "
        "a run of float32 state.",
    )
    parser.add_argument("--trainer_dir", default=None, help="Each run trains in a subfolder.")
    parser.add_argument(
        "--state_dtype", default="bfloat16",
        help="A floating-point dtype's name, or 'float24' (split_float.Float24).",
    )
    parser.add_argument("--rounding", choices=ROUNDING_MODES, default="nearest")
    parser.add_argument(
        "--state_paths", default=None,
        help="Cast only the state tensors whose path this regex matches (e.g. update_ema; "
        "cast_optimizer_state's state_paths); default: all.",
    )
    parser.add_argument(
        "--cast_first", action="store_true",
        help="Train the cast run first (alternate it across calls to cancel the order).",
    )
    parser.add_argument(
        "--cast_only", action="store_true",
        help="Train the cast run alone, in half the time; --summarize compares it with the "
        "float32 runs of other files (the reference need not be retrained beside every run).",
    )
    parser.add_argument(
        "--configured_only", action="store_true",
        help="Train the configured run alone: a named variant whose own config keeps its "
        "state in other dtypes, e.g. --config=gpt_1b_narrow_state.",
    )
    parser.add_argument(
        "--window", type=int, default=0,
        help="Print the training loss as means over windows of this many steps (0: every "
        "logged step); log every step (summary_writer.write_every_n_steps=1) to average them all.",
    )
    parser.add_argument("--json_out", default=None)
    parser.add_argument(
        "--reference", default=None,
        help="With --summarize: the group the others are compared with, by its label as "
        "the table prints it (default: float32, where present).",
    )
    parser.add_argument(
        "--summarize", nargs="+", metavar="JSON", default=None,
        help="Train nothing: group the runs of these --json_out files by how their optimizer "
        "state was kept and their recipe overrides, and print each group's mean loss by step, "
        "and the differences.",
    )
    args = parser.parse_args()
    if args.summarize:
        _print_summary(_load_runs(args.summarize), args.window, args.reference)
        return
    if not args.trainer_dir:
        parser.error("--trainer_dir is required to train")
    if args.rounding == "stochastic" and args.state_dtype != "bfloat16":
        parser.error("--rounding=stochastic rounds to bfloat16 only: give --state_dtype=bfloat16")
    if (args.cast_only or args.configured_only) and args.cast_first:
        parser.error(
            "--cast_only and --configured_only train one run: --cast_first has nothing to order"
        )
    if args.cast_only and args.configured_only:
        parser.error("give --cast_only or --configured_only, not both")
    launch.setup()

    # --state_dtype=float32 wraps the second run in a cast that changes nothing: the two runs
    # then differ only by the GPU's nondeterministic sums, the control for the other dtypes.
    stochastic = "stochastic_" if args.rounding == "stochastic" else ""
    cast_name = f"{args.state_dtype}_{stochastic}state"
    cast_dtype = FLOAT24 if args.state_dtype == FLOAT24 else jnp.dtype(args.state_dtype)
    runs = {"as_configured": None, cast_name: cast_dtype}
    if args.cast_only:
        del runs["as_configured"]
    if args.configured_only:
        del runs[cast_name]
    trained = {}
    for name in reversed(runs) if args.cast_first else runs:
        trained[name] = _train(args, os.path.join(args.trainer_dir, name), runs[name])
    losses = {name: trained[name]["losses"] for name in runs}  # In one order, whichever ran first.
    train = {name: by_source["train"] for name, by_source in losses.items()}
    if args.window:
        _print_side_by_side(
            f"Training loss, mean of the logged steps in each {args.window}",
            {name: _window_means(curve, args.window) for name, curve in train.items()},
        )
    else:
        _print_side_by_side("Training loss of single steps", train)
    for source in next(iter(losses.values())):
        if source != "train":
            _print_side_by_side(
                f"Evaler '{source}' loss", {name: by_source[source] for name, by_source in losses.items()}
            )
    write_json(
        args.json_out,
        {
            name: dict(
                trained[name],
                losses={
                    source: {str(k): v for k, v in curve.items()}
                    for source, curve in trained[name]["losses"].items()
                },
            )
            for name in runs
        },
    )


if __name__ == "__main__":
    main()
