"""Trains a named config twice from the same seed and data: with its optimizer's state as
configured (float32) and with the state kept in a lower precision between steps
(`optimizers.cast_optimizer_state` around the whole optimizer). Prints both runs'
training losses side by side at every step the summary writer logged (or their means over
`--window` steps), then each evaler's loss at every step it ran: what the rounding costs in
quality, next to what `axlearn.bench --compare_configs` measures in speed. The single-step
training loss of a small batch is noisy; the evalers' losses, over their whole input, are
the steadier measure.

    # CPU, ~90 s: gpt_test on the built-in corpus.
    PYTHONPATH=. python benchmarks/optimizer_state_check.py --config=gpt_test --trainer_dir=/tmp/osc

    # gpt_1b on one H100, on the built-in corpus (real text; the reference corpora need not
    # be at hand), 700 steps with a shorter warm-up, the validation split evaluated every 175
    # (docs/benchmarks.md, the twenty-first round). Alternate --cast_first across calls;
    # --state_dtype=float32 gives the control, two float32 runs that differ only by the
    # GPU's nondeterministic sums:
    PYTHONPATH=. python benchmarks/optimizer_state_check.py --config=gpt_1b \
        --mesh_selector=gpu-h100-1 --data_dir=BUILTIN --trainer_dir=/tmp/osc \
        --config_override=input.global_batch_size=4 --config_override=max_step=700 \
        --config_override=learner.optimizer.inner.update_schedule.warmup_steps=50 \
        --config_override=summary_writer.write_every_n_steps=1 \
        --config_override="evalers['openwebtext_2'].input.global_batch_size=4" \
        --config_override="evalers['openwebtext_2'].eval_policy.n=175" --window=100
"""

import argparse
import json
import os

import jax.numpy as jnp

from axlearn.bench import write_json
from axlearn.common import launch
from axlearn.common.config import config_for_function
from axlearn.common.launch_trainer import build_trainer_config
from axlearn.common.optimizers import cast_optimizer_state
from axlearn.common.summary_writer import JSONL_FILE_NAME


def _logged_losses(writer) -> dict[int, float]:
    """The loss at every step a summary writer logged, from its metrics.jsonl."""
    with open(os.path.join(writer.config.dir, JSONL_FILE_NAME), encoding="utf-8") as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f) if "loss" in r}


def _train(args: argparse.Namespace, run_dir: str, state_dtype) -> dict[str, dict[int, float]]:
    """Trains into `run_dir`; returns the logged losses by source: 'train' (the training
    loss of single steps), then each evaler's name (its loss over its whole input)."""
    if os.path.exists(run_dir) and os.listdir(run_dir):
        raise SystemExit(f"{run_dir} is not empty (the trainer would resume from it): remove it")
    cfg = build_trainer_config(
        config_name=args.config,
        mesh_selector=args.mesh_selector,
        data_dir=args.data_dir,
        config_overrides=args.config_override,
        trainer_dir=run_dir,
    )
    if state_dtype is not None:
        # Around the whole optimizer, whatever it is: its integer counters keep their dtype.
        cfg.learner.optimizer = config_for_function(cast_optimizer_state).set(
            inner=cfg.learner.optimizer, dtype=state_dtype
        )
    trainer = cfg.instantiate(parent=None)
    trainer.run()
    losses = {"train": _logged_losses(trainer.summary_writer)}
    for name in cfg.evalers:
        if "summary_writer" in trainer.children[name].children:
            losses[name] = _logged_losses(trainer.children[name].summary_writer)
    return losses


def _window_means(losses: dict[int, float], window: int) -> dict[int, float]:
    """The mean loss of the logged steps in each `window` steps, keyed by the window's last step."""
    sums: dict[int, list[float]] = {}
    for step, loss in losses.items():
        sums.setdefault(-(-step // window) * window, []).append(loss)
    return {end: sum(v) / len(v) for end, v in sums.items()}


def _print_side_by_side(title: str, curves: dict[str, dict[int, float]]) -> None:
    (base, base_losses), (other, other_losses) = curves.items()
    print(f"{title}\n{'step':>6} | {base:>22} | {other:>22} | diff")
    for step in sorted(set(base_losses) & set(other_losses)):
        a, b = base_losses[step], other_losses[step]
        print(f"{step:>6} | {a:>22.4f} | {b:>22.4f} | {b - a:+.4f}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", default="gpt_test")
    parser.add_argument("--mesh_selector", default=None)
    parser.add_argument("--data_dir", default=None, help="As the launcher's (FAKE, BUILTIN, a path).")
    parser.add_argument("--config_override", action="append", default=[])
    parser.add_argument("--trainer_dir", required=True, help="Each run trains in a subfolder.")
    parser.add_argument("--state_dtype", default="bfloat16")
    parser.add_argument(
        "--cast_first", action="store_true",
        help="Train the cast run first (alternate it across calls to cancel the order).",
    )
    parser.add_argument(
        "--window", type=int, default=0,
        help="Print the training loss as means over windows of this many steps (0: every "
        "logged step); log every step (summary_writer.write_every_n_steps=1) to average them all.",
    )
    parser.add_argument("--json_out", default=None)
    args = parser.parse_args()
    launch.setup()

    # --state_dtype=float32 wraps the second run in a cast that changes nothing: the two runs
    # then differ only by the GPU's nondeterministic sums, the control for the other dtypes.
    runs = {"as_configured": None, f"{args.state_dtype}_state": jnp.dtype(args.state_dtype)}
    trained = {}
    for name in reversed(runs) if args.cast_first else runs:
        trained[name] = _train(args, os.path.join(args.trainer_dir, name), runs[name])
    losses = {name: trained[name] for name in runs}  # Reported in one order, whichever ran first.
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
            name: {source: {str(k): v for k, v in curve.items()} for source, curve in by_source.items()}
            for name, by_source in losses.items()
        },
    )


if __name__ == "__main__":
    main()
