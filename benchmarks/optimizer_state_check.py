"""Trains a named config twice from the same seed and data: with its optimizer's state as
configured (float32) and with the state kept in a lower precision between steps
(`optimizers.cast_optimizer_state`). Prints the last logged summaries of both runs side
by side: what the rounding costs in quality, next to what `axlearn.bench
--compare_configs` measures in speed.

    PYTHONPATH=. python benchmarks/optimizer_state_check.py --config=gpt_test --trainer_dir=/tmp/osc
"""

import argparse
import os

import jax.numpy as jnp

from axlearn.bench import write_json
from axlearn.common.config import config_for_function
from axlearn.common.launch_trainer import build_trainer_config
from axlearn.common.optimizers import cast_optimizer_state


def _train(config: str, trainer_dir: str, state_dtype) -> dict:
    cfg = build_trainer_config(config_name=config, trainer_dir=trainer_dir)
    if state_dtype is not None:
        # Around the whole optimizer, whatever it is: its integer counters keep their dtype.
        cfg.learner.optimizer = config_for_function(cast_optimizer_state).set(
            inner=cfg.learner.optimizer, dtype=state_dtype
        )
    return cfg.instantiate(parent=None).run()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", default="gpt_test")
    parser.add_argument("--trainer_dir", required=True, help="Each run trains in a subfolder.")
    parser.add_argument("--state_dtype", default="bfloat16")
    parser.add_argument("--json_out", default=None)
    args = parser.parse_args()

    dtypes = {"float32 (as configured)": None, args.state_dtype: jnp.dtype(args.state_dtype)}
    results = {}
    for name, dtype in dtypes.items():
        run_dir = os.path.join(args.trainer_dir, "float32" if dtype is None else args.state_dtype)
        results[name] = {k: float(v) for k, v in _train(args.config, run_dir, dtype).items()}
    names = list(results)
    keys = sorted(set(results[names[0]]) & set(results[names[1]]))
    width = max(len(k) for k in ["summary", *keys])
    print(f"{'summary':<{width}} | {names[0]:>24} | {names[1]:>24} | diff")
    for key in keys:
        a, b = results[names[0]][key], results[names[1]][key]
        print(f"{key:<{width}} | {a:>24.5f} | {b:>24.5f} | {b - a:+.5f}")
    write_json(args.json_out, results)


if __name__ == "__main__":
    main()
