"""Times a config's optimizer update alone (params and state donated, as in the train
step) with and without the learner's norm summaries, and counts the parameter-sized
copies XLA adds (a norm fused into the update makes XLA copy instead of updating in place).

    PYTHONPATH=. python benchmarks/learner_update.py --config=gpt_1b --mesh_selector=gpu-h100-1
"""

import argparse
import re
import time

import jax
import jax.numpy as jnp
import numpy as np

from axlearn.bench import build_benchmark_config
from axlearn.common import launch, learner as learner_lib


def _without_norms(update):
    """The learner's update minus its norm summaries (the floor the norms are measured
    against)."""

    def wrapped(self, model_params, grads, learner_state, *, param_specs=None):
        new_params, state, summaries = update(
            self, model_params, grads, learner_state, param_specs=param_specs
        )
        for name in ("parameter_norm", "gradient_norm", "update_norm"):
            summaries.pop(name, None)
        return new_params, state, summaries

    return wrapped


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", required=True)
    parser.add_argument("--mesh_selector", default=None)
    parser.add_argument(
        "--modes",
        default="base,per_variable,no_norms",
        help="base: the learner as configured; per_variable: with "
        "enable_per_variable_summaries (adds parameter_norm and update_norm); no_norms: no "
        "norm summaries.",
    )
    parser.add_argument("--config_override", action="append", default=[])
    args = parser.parse_args()
    launch.setup()
    cfg = build_benchmark_config(
        args.config, mesh_selector=args.mesh_selector, overrides=args.config_override
    )
    original = learner_lib.Learner.update
    for mode in args.modes.split(","):
        cfg.learner.enable_per_variable_summaries = mode == "per_variable"
        learner_lib.Learner.update = _without_norms(original) if mode == "no_norms" else original
        trainer = cfg.instantiate(parent=None)
        specs = trainer.model_param_specs
        state = trainer.init_state(jax.random.PRNGKey(0))
        grads = jax.tree.map(lambda p: jnp.full_like(p, 1e-3), state.model)
        fn = jax.jit(
            lambda p, g, s: trainer.learner.update(p, g, s, param_specs=specs),
            donate_argnums=(0, 2),
        )
        with jax.set_mesh(trainer.mesh):
            compiled = fn.lower(state.model, grads, state.learner).compile()
            copies = len(re.findall(r"= f32\[[0-9,]+\]\{[^}]*\} copy\(", compiled.as_text()))
            params, opt = state.model, state.learner
            times = []
            for _ in range(12):
                start = time.perf_counter()
                params, opt, summaries = compiled(params, grads, opt)
                jax.block_until_ready(params)
                times.append(time.perf_counter() - start)
        print(f"{mode:16s} {1e3 * float(np.median(times[2:])):7.2f} ms  param-sized copies: {copies}",
              flush=True)
        del params, opt, grads, state


if __name__ == "__main__":
    main()
