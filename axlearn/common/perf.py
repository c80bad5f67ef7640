"""Performance accounting shared by the trainer log and the benchmark report.

The model counts its own training FLOPs per token (`CountsModelFlops`; for the causal LM
the DESIGN.md formula, `causal_lm.Model.model_flops_per_token`). Here:
TFLOP/s/device = FLOPs per step / step time / devices; MFU = that / peak. A model that
does not count its FLOPs gets step time, tokens/s and memory, but no TFLOP/s or MFU.
"""

import dataclasses
import math
from typing import Any, Optional, Protocol, runtime_checkable

import jax

# Peak dense bf16 TFLOP/s per device, by a substring of jax's device_kind (first match).
PEAK_TFLOPS_BY_DEVICE_KIND = (
    ("H200", 989.0),
    ("H100", 989.0),
    ("A100", 312.0),
    ("L4", 121.0),
    ("TPU v5p", 459.0),
    ("TPU v5 lite", 197.0),
    ("TPU v5e", 197.0),
    ("TPU v4", 275.0),
    ("TPU v6", 918.0),
)


def peak_tflops(device: Optional[jax.Device] = None) -> Optional[float]:
    """The device's peak dense bf16 TFLOP/s, or None where unknown (e.g. CPU)."""
    device = device or jax.devices()[0]
    kind = getattr(device, "device_kind", "")
    for name, tflops in PEAK_TFLOPS_BY_DEVICE_KIND:
        if name.lower() in kind.lower():
            return tflops
    return None


@runtime_checkable
class CountsModelFlops(Protocol):
    """A model that knows its training FLOPs (forward and backward) per token."""

    def model_flops_per_token(self, seq_len: int) -> Optional[float]:
        """FLOPs per token of a `seq_len`-token sequence; None where it cannot count."""


def model_flops_per_token(model: Any, seq_len: int) -> Optional[float]:
    """`model`'s own count (`CountsModelFlops`), or None for a model that has none."""
    if isinstance(model, CountsModelFlops):
        return model.model_flops_per_token(seq_len)
    return None


def tree_size(tree: Any) -> int:
    """The number of elements of a tree of arrays or of ParameterSpecs (anything with a
    `shape`): a model's parameter count from its specs, nothing allocated."""
    leaves = jax.tree.leaves(tree, is_leaf=lambda x: hasattr(x, "shape"))
    return sum(math.prod(leaf.shape) for leaf in leaves)


@dataclasses.dataclass
class StepAccounting:
    """Turns a step time into the standard columns."""

    num_params: int
    tokens_per_step: int
    flops_per_step: Optional[float]  # None: the model does not count its FLOPs.
    num_devices: int
    peak_tflops_per_device: Optional[float]

    @classmethod
    def for_trainer(cls, trainer) -> "StepAccounting":
        """The accounting of `trainer`'s steps: its input's [batch, seq_len] tokens, its
        model's parameters and FLOPs per token, its mesh's devices."""
        batch, seq_len = trainer.input.element_spec()["input_ids"].shape
        flops_per_token = model_flops_per_token(trainer.model, seq_len)
        tokens = batch * seq_len
        peak = trainer.config.peak_tflops_per_device or peak_tflops(trainer.mesh.devices.flat[0])
        return cls(
            num_params=tree_size(trainer.model_param_specs),
            tokens_per_step=tokens,
            flops_per_step=None if flops_per_token is None else flops_per_token * tokens,
            num_devices=trainer.mesh.devices.size,
            peak_tflops_per_device=peak,
        )

    def metrics(self, step_time_s: float) -> dict[str, Any]:
        """tokens/s/device, TFLOP/s/device and MFU (where FLOPs and peak are known), step
        time and peak memory."""
        out = {
            "perf/step_time_s": step_time_s,
            "perf/tokens_per_s_per_device": self.tokens_per_step / step_time_s / self.num_devices,
        }
        if self.flops_per_step is not None:
            tflops = self.flops_per_step / step_time_s / self.num_devices / 1e12
            out["perf/tflops_per_device"] = tflops
            if self.peak_tflops_per_device:
                out["perf/mfu"] = tflops / self.peak_tflops_per_device
        memory = device_memory()
        if memory is not None:
            out["perf/peak_memory_gib"] = memory[0] / 2**30
            if memory[1]:
                out["perf/memory_fraction"] = memory[0] / memory[1]
        return out


def device_memory(device: Optional[jax.Device] = None) -> Optional[tuple[int, int]]:
    """(peak bytes in use, bytes limit) of a local device, where the backend reports them.

    CPU devices report nothing; their memory is the host's, so the process's peak
    resident set size stands in (limit 0: unknown).
    """
    device = device or jax.local_devices()[0]
    try:
        stats = device.memory_stats()
    except Exception:  # pylint: disable=broad-except
        stats = None
    if stats and "peak_bytes_in_use" in stats:
        return int(stats["peak_bytes_in_use"]), int(stats.get("bytes_limit", 0))
    if device.platform == "cpu":
        return _host_peak_rss_bytes(), 0
    return None


def _host_peak_rss_bytes() -> int:
    import resource  # pylint: disable=import-outside-toplevel

    # ru_maxrss is in KiB on Linux.
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


# The evaluation metrics the trainer's console line shows (the evaler writes them all).
EVAL_HEADLINE_METRICS = ("loss", "perplexity", "bits_per_byte", "accuracy")


def format_metrics(metrics: dict[str, Any]) -> str:
    """'key=value ...' sorted by key, floats to 4 significant digits."""
    return " ".join(
        f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in sorted(metrics.items())
    )


def progress_line(step: int, max_step: int, summaries: dict[str, Any]) -> str:
    """One console line a person can follow."""

    def get(name, fmt, default="-"):
        value = summaries.get(name)
        return format(value, fmt) if isinstance(value, (int, float)) else default

    parts = [
        f"step {step:>{len(str(max_step))}}/{max_step}",
        f"loss {get('loss', '.4f')}",
        f"lr {get('learner/learning_rate', '.3e')}",
        f"gnorm {get('learner/gradient_norm', '.3f')}",
        f"{get('perf/step_time_s', '.3f')} s/step",
        f"{get('perf/tokens_per_s_per_device', ',.0f')} tok/s/dev",
        f"{get('perf/tflops_per_device', '.3g')} TFLOP/s/dev",
    ]
    if "perf/mfu" in summaries:
        parts.append(f"MFU {summaries['perf/mfu']:.1%}")
    if "perf/peak_memory_gib" in summaries:
        parts.append(f"mem {summaries['perf/peak_memory_gib']:.1f} GiB")
    return " | ".join(parts)
