"""Trains a named config twice from the same seed and data: with its optimizer's state as
configured (float32) and with the state kept in a lower precision between steps
(`optimizers.cast_optimizer_state` around the whole optimizer). Prints both runs'
training losses side by side at every step the summary writer logged: what the rounding
costs in quality, next to what `axlearn.bench --compare_configs` measures in speed.

    # CPU, ~90 s: gpt_test on the built-in corpus.
    PYTHONPATH=. python benchmarks/optimizer_state_check.py --config=gpt_test --trainer_dir=/tmp/osc

    # gpt_1b on one H100, on the built-in corpus (real text; the reference corpora need not
    # be at hand), 300 steps with a shorter warm-up; add --state_dtype=float32 for the
    # control, two float32 runs that differ only by the GPU's nondeterministic sums:
    PYTHONPATH=. python benchmarks/optimizer_state_check.py --config=gpt_1b \
        --mesh_selector=gpu-h100-1 --data_dir=BUILTIN --trainer_dir=/tmp/osc \
        --config_override=input.global_batch_size=4 --config_override=max_step=300 \
        --config_override=learner.optimizer.inner.update_schedule.warmup_steps=50 \
        --config_override=summary_writer.write_every_n_steps=25 \
        --config_override="evalers['openwebtext_2'].input.global_batch_size=4"
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


def _train(args: argparse.Namespace, run_dir: str, state_dtype) -> dict[int, float]:
    """Trains into `run_dir`; returns the training loss of every step the writer logged."""
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
    path = os.path.join(trainer.summary_writer.config.dir, JSONL_FILE_NAME)
    with open(path, encoding="utf-8") as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f) if "loss" in r}


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
    parser.add_argument("--json_out", default=None)
    args = parser.parse_args()
    launch.setup()

    # --state_dtype=float32 wraps the second run in a cast that changes nothing: the two runs
    # then differ only by the GPU's nondeterministic sums, the control for the other dtypes.
    losses = {}
    for name, dtype in (("as_configured", None), (f"{args.state_dtype}_state", args.state_dtype)):
        losses[name] = _train(args, os.path.join(args.trainer_dir, name), dtype and jnp.dtype(dtype))
    (base, base_losses), (other, other_losses) = losses.items()
    print(f"{'step':>6} | {'loss, ' + base:>22} | {'loss, ' + other:>22} | diff")
    for step in sorted(set(base_losses) & set(other_losses)):
        a, b = base_losses[step], other_losses[step]
        print(f"{step:>6} | {a:>22.4f} | {b:>22.4f} | {b - a:+.4f}")
    write_json(args.json_out, {name: {str(k): v for k, v in l.items()} for name, l in losses.items()})


if __name__ == "__main__":
    main()
