r"""Checks the model's GPU kernels against XLA, for correctness and speed.

The layers use two Pallas (Triton) kernels on GPU (`axlearn.common.kernels`): the
gated MLP's backward (`gated_product_backward`, SwiGLU's two input cotangents in one
pass) and RMSNorm's (`rms_norm_backward`, the residual's and the norm's input gradient
and the scale's gradient, for one or two consumers of the normalized input). Run this on
new hardware, or after a jax or Triton upgrade, to see whether they still compile, still
agree with a float64 reference as closely as XLA does, and still beat XLA; `--sweep`
also times other block shapes and warp counts, to retune their defaults for a new card:

    PYTHONPATH=. python tools/kernel_check.py [--tokens=16384 --hidden=2048 --mlp_hidden=8192] \
        [--sweep] [--json_out=kernels.json]

The defaults are gpt_1b's shapes (16,384 tokens a step, model dim 2048, MLP hidden
8192); give another config's to check it. One line per case: GPU ms per call (kernel
time in a profiler trace of 20 calls, so no dispatch overhead), the bandwidth the op's
minimal traffic implies (each input read once, each output written once) and the
largest error against a float64 NumPy reference, in units of the reference's largest
magnitude. The kernel should be at least as accurate as XLA and faster; a case that
fails (a block shape that does not compile) prints its error.

Alone, XLA may fuse an expression differently than inside a train step, where
`tools/op_profile.py` shows the step's kernels.
"""

import functools
from collections.abc import Callable, Sequence
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

from axlearn.bench import gpu_time_ms, write_json
from axlearn.common import layers
from axlearn.common.command_flags import parse_command_flags
from axlearn.common.kernels.gated_product import gated_product_backward
from axlearn.common.kernels.rms_norm import rms_norm_backward

_EPS = 1e-5  # RMSNorm's epsilon in the GPT configs.


def _max_err(got: Sequence[Any], want: Sequence[np.ndarray]) -> float:
    """Largest |got - want| over all outputs, in units of the largest |want|."""
    unit = max(float(np.max(np.abs(w))) for w in want)
    errors = (np.max(np.abs(np.asarray(g, np.float64) - w)) for g, w in zip(got, want))
    return float(max(errors)) / unit


def _time_cases(
    cases: dict[str, Callable], inputs: Sequence[Any], want: Sequence[np.ndarray], min_bytes: int
) -> dict[str, dict[str, Any]]:
    """Runs, checks and times each case on `inputs`; prints and returns one entry each."""
    results = {}
    for name, fn in cases.items():
        try:
            err = _max_err(fn(*inputs), want)
            ms, _ = gpu_time_ms(fn, *inputs, calls=20)
        except Exception as e:  # pylint: disable=broad-except
            results[name] = {"error": f"{type(e).__name__}: {e}"[:500]}
            print(f"{name:60s} failed: {(str(e).splitlines() or [type(e).__name__])[0][:100]}")
            continue
        tb_per_s = min_bytes / ms / 1e9 if ms > 0 else None
        results[name] = dict(ms=ms, tb_per_s=tb_per_s, max_rel_err=err)
        rate = f"{tb_per_s:5.2f} TB/s" if tb_per_s else "   - TB/s"
        print(f"{name:60s} {ms:7.4f} ms ({rate})  max err {err:.2g}", flush=True)
    return results


# ----- The gated MLP's backward (SwiGLU) -----


def swiglu_cotangents_reference(a, b, dh) -> tuple[np.ndarray, np.ndarray]:
    """(da, db) of h = silu(a) * b for the cotangent dh, in float64."""
    a, b, dh = (np.asarray(t, np.float64) for t in (a, b, dh))
    sigmoid = 1 / (1 + np.exp(-a))
    d_silu = sigmoid * (1 + a * (1 - sigmoid))
    return dh * b * d_silu, dh * a * sigmoid


def check_gated_product(tokens: int, hidden: int, *, sweep: bool) -> dict[str, Any]:
    """XLA's and the kernel's SwiGLU backward on [tokens, hidden] bf16 inputs."""
    rng = np.random.default_rng(0)
    a, b, dh = (jnp.asarray(rng.normal(size=(tokens, hidden)), jnp.bfloat16) for _ in range(3))
    swiglu = functools.partial(
        layers.gated_product_cotangents,
        layers.get_activation_fn("nn.silu"),
        layers.get_activation_fn("linear"),
    )
    cases = {
        "gated_product xla": jax.jit(swiglu),
        "gated_product kernel": jax.jit(
            lambda *t: gated_product_backward(swiglu, *t)
        ),
    }
    if sweep:
        for block in ((2, 4096), (8, 1024), (32, 256)):
            for warps in (4, 8):
                cases[f"gated_product kernel block={block} warps={warps}"] = jax.jit(
                    lambda *t, bl=block, w=warps: gated_product_backward(
                        swiglu, *t, block=bl, num_warps=w
                    )
                )
    want = swiglu_cotangents_reference(a, b, dh)
    min_bytes = 5 * a.nbytes  # Read a, b and dh; write da and db.
    return _time_cases(cases, (a, b, dh), want, min_bytes=min_bytes)


# ----- RMSNorm's backward -----


def rms_norm_dx_reference(x, scale, dys, dresidual) -> np.ndarray:
    """In float64, the gradient of x through (x, RMSNorm(x), RMSNorm(x), ...) for the
    cotangent `dresidual` of x and one dy of `dys` for each RMSNorm(x)."""
    x, scale, dresidual = (np.asarray(t, np.float64) for t in (x, scale, dresidual))
    dy = sum(np.asarray(t, np.float64) for t in dys)
    r = 1.0 / np.sqrt(np.mean(x * x, axis=1, keepdims=True) + _EPS)
    g = dy * scale
    return dresidual + r * g - x * r**3 * np.mean(g * x, axis=1, keepdims=True)


def _xla_rms_norm_backward(consumers: int) -> Callable:
    """What autodiff gives a layer without the kernel: the VJP of (x, norm(x), ...)."""

    def forward(x, scale):
        # forward_dtype None: normalized in the input dtype, as the GPT configs do.
        # pylint: disable-next=protected-access
        return layers._residual_and_rms_norm(x, scale, _EPS, None, consumers)

    def backward(x, scale, dys, dres):
        _, vjp = jax.vjp(forward, x, scale)
        return vjp((dres, *dys))

    return jax.jit(backward)


def check_rms_norm(tokens: int, hidden: int, *, sweep: bool) -> dict[str, Any]:
    """XLA's and the kernel's RMSNorm backward on [tokens, hidden] bf16 inputs, for one
    consumer of the normalized x (attention's QKV projection) and two (the gated MLP's
    input projections). Only dx is compared: dscale is a sum over all tokens."""
    rng = np.random.default_rng(0)
    normal = lambda: jnp.asarray(rng.normal(size=(tokens, hidden)), jnp.bfloat16)  # noqa: E731
    x, dres, dy0, dy1 = normal(), normal(), normal(), normal()
    scale = jnp.asarray(1 + 0.1 * rng.normal(size=(hidden,)), jnp.bfloat16)
    results = {}
    for consumers in (1, 2):
        dys = [dy0, dy1][:consumers]
        cases = {
            f"rms_norm {consumers} dy: xla": _xla_rms_norm_backward(consumers),
            f"rms_norm {consumers} dy: kernel": jax.jit(
                lambda *t: rms_norm_backward(*t, eps=_EPS)
            ),
        }
        if sweep:
            for held in (2048, 4096, 8192):  # Elements a program holds at once.
                for walked in (65536, 131072, 262144):  # Elements a program walks through.
                    for warps in (4, 8):
                        rows = max(1, held // hidden)
                        per_program = max(rows, walked // hidden)
                        cases[
                            f"rms_norm {consumers} dy: kernel rows={rows} "
                            f"per_program={per_program} warps={warps}"
                        ] = jax.jit(
                            lambda *t, b=rows, p=per_program, w=warps: (
                                rms_norm_backward(
                                    *t, eps=_EPS, block_rows=b, rows_per_program=p, num_warps=w
                                )
                            )
                        )
        want = [rms_norm_dx_reference(x, scale, dys, dres)]
        dx_only = {name: (lambda *t, fn=fn: fn(*t)[:1]) for name, fn in cases.items()}
        min_bytes = (3 + consumers) * x.nbytes  # Read x, dres and each dy; write dx.
        results.update(_time_cases(dx_only, (x, scale, dys, dres), want, min_bytes=min_bytes))
    return results


def define_flags(flag_values: flags.FlagValues) -> None:
    """The check's flags."""
    fv = dict(flag_values=flag_values)
    flags.DEFINE_integer("tokens", 16384, "Tokens (rows) of a step.", **fv)
    flags.DEFINE_integer("hidden", 2048, "Model dim (the normalized rows' width).", **fv)
    flags.DEFINE_integer("mlp_hidden", 8192, "The gated MLP's hidden dim.", **fv)
    flags.DEFINE_bool("sweep", False, "Also time other block shapes.", **fv)
    flags.DEFINE_string("json_out", None, "Write every entry as JSON.", **fv)


def main(argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
    """The command line `argv` (None: sys.argv's) run; returns every entry."""
    args, _ = parse_command_flags(
        define_flags, argv, program="tools/kernel_check.py",
        doc=f"usage: kernel_check.py [flags]\n\n{__doc__}",
    )
    results = {"jax_version": jax.__version__, "device": jax.devices()[0].device_kind}
    results.update(check_gated_product(args.tokens, args.mlp_hidden, sweep=args.sweep))
    results.update(check_rms_norm(args.tokens, args.hidden, sweep=args.sweep))
    write_json(args.json_out, results)
    return results


if __name__ == "__main__":
    main()
