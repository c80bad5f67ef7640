r"""Splits a named config's train step into forward, backward and optimizer update time.

Run it to see which part of a step to work on (a slow optimizer update, say, or a
backward pass far above twice the forward), e.g. after changing the learner or on new
hardware:

    PYTHONPATH=. python tools/step_breakdown.py --config=gpt_1b --mesh_selector=gpu-h100-1 \
        --config_override=input.global_batch_size=4

It prints the milliseconds of: the forward pass (the loss); forward and backward (the
gradients); the optimizer update (`learner.update`); and the whole train step. Each
part is jitted on its own and timed as the median of 10 calls after a warm-up, so the
parts need not add up to the whole step, which XLA fuses and schedules as one program:
they say where to look, then `tools/op_profile.py` says which ops.
"""

import time
from collections.abc import Sequence
from typing import Optional

import jax
import numpy as np
from absl import flags

from axlearn.bench import build_benchmark_config
from axlearn.common import launch
from axlearn.common.command_flags import parse_command_flags


def timeit(fn, *args, iters: int = 10) -> float:
    """Median milliseconds of `iters` calls of `fn(*args)`, after one call to compile."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return float(np.median(times)) * 1e3


def define_flags(flag_values: flags.FlagValues) -> None:
    """The tool's flags."""
    fv = dict(flag_values=flag_values)
    flags.DEFINE_string("config", None, "The named trainer config.", **fv)
    flags.DEFINE_string("mesh_selector", None, "As for axlearn.bench.", **fv)
    flags.DEFINE_multi_string("config_override", [], "PATH=VALUE; may repeat.", **fv)
    flags.mark_flag_as_required("config", **fv)


def main(argv: Optional[Sequence[str]] = None) -> None:
    """The command line `argv` (None: sys.argv's) run."""
    args, _ = parse_command_flags(
        define_flags, argv, program="tools/step_breakdown.py",
        doc=f"usage: step_breakdown.py [flags]\n\n{__doc__}",
    )
    launch.setup()
    cfg = build_benchmark_config(
        args.config, mesh_selector=args.mesh_selector, overrides=args.config_override
    )
    trainer = cfg.instantiate(parent=None)
    state = trainer.init_state(jax.random.PRNGKey(0))
    batch = trainer.global_batch(next(trainer._host_batches())[1])  # pylint: disable=protected-access
    learner, specs = trainer.learner, trainer.model_param_specs
    key = jax.random.PRNGKey(1)

    with jax.set_mesh(trainer.mesh):
        forward = jax.jit(lambda p, b: trainer._loss_fn(p, b, key)[0])  # pylint: disable=protected-access
        grads_fn = jax.jit(
            lambda p, b: learner.compute_gradients(trainer._loss_fn, p, b, key)[2]  # pylint: disable=protected-access
        )
        update = jax.jit(lambda p, g, s: learner.update(p, g, s, param_specs=specs)[:2])
        grads = grads_fn(state.model, batch)
        parts = {
            "forward (loss)": timeit(forward, state.model, batch),
            "forward + backward": timeit(grads_fn, state.model, batch),
            "optimizer update (learner.update)": timeit(update, state.model, grads, state.learner),
        }
        step = trainer._compile_train_step()  # pylint: disable=protected-access
        state, _ = step(state, batch)

        def full(state):
            new_state, summaries = step(state, batch)
            return new_state, summaries["loss"]

        # The step donates its state: time it on a chain of states.
        state, loss = full(state)
        jax.block_until_ready(loss)
        times = []
        for _ in range(10):
            start = time.perf_counter()
            state, loss = full(state)
            jax.block_until_ready(loss)
            times.append(time.perf_counter() - start)
        parts["full train step"] = float(np.median(times)) * 1e3
    for name, ms in parts.items():
        print(f"{name:40s} {ms:8.2f} ms")


if __name__ == "__main__":
    main()
