"""Settings for the whole suite, so that it means the same on a GPU as on the CPU.

The tests compare float32 results with NumPy and a resumed or rewritten run's losses with
the original's, bit for bit. On the CPU both hold as written. On a GPU, XLA would by
default multiply float32 matrices in TF32 (about 3 decimal digits) and sum some gradients
with atomic adds in whatever order the threads arrive; the two settings below turn that
off for the tests. Scripts that the tests start in fresh processes run on the CPU
(`fresh_python`), where neither setting changes anything.
"""

import os

# XLA reads its flags once, when the first backend starts: before any test imports jax.
_DETERMINISTIC = "--xla_gpu_deterministic_ops=true"
if "--xla_gpu_deterministic_ops" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_DETERMINISTIC}".strip()

import jax  # noqa: E402  (after XLA_FLAGS)

jax.config.update("jax_default_matmul_precision", "highest")
