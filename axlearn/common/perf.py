"""Performance accounting shared by the trainer log and the benchmark report.

Per token, model FLOPs = 6 x (matmul parameters, including the LM head, excluding the
embedding lookup) + 6 x layers x seq_len x d_model (causal attention: QK^T and AV, half
the matrix). TFLOP/s/device = FLOPs per step / step time / devices; MFU = that / peak.
"""

import dataclasses
import math
from typing import Any, Optional

import jax

from axlearn.common.base_layer import flatten_with_paths, is_parameter_spec

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


def parameter_counts(param_specs: Any) -> tuple[int, int]:
    """(all parameters, matmul parameters) from a tree of ParameterSpecs.

    Matmul parameters are weights of rank >= 2, except the token-embedding table when the
    model has a separate LM head (a lookup does no FLOPs; a tied table is the LM head).
    """
    leaves = flatten_with_paths(param_specs, is_leaf=is_parameter_spec)
    has_lm_head = any("lm_head" in path for path, _ in leaves)
    total = matmul = 0
    for path, spec in leaves:
        size = math.prod(spec.shape)
        total += size
        is_embedding = path.endswith("token_emb/weight")
        if len(spec.shape) >= 2 and not (is_embedding and has_lm_head):
            matmul += size
    return total, matmul


def model_flops_per_token(*, matmul_params: int, num_layers: int, seq_len: int, d_model: int) -> float:
    return 6.0 * matmul_params + 6.0 * num_layers * seq_len * d_model


@dataclasses.dataclass
class StepAccounting:
    """Turns a step time into the standard columns."""

    num_params: int
    matmul_params: int
    tokens_per_step: int
    flops_per_step: float
    num_devices: int
    peak_tflops_per_device: Optional[float]

    @classmethod
    def for_trainer(cls, trainer) -> "StepAccounting":
        cfg = trainer.config
        total, matmul = parameter_counts(trainer.model_param_specs)
        spec = trainer.input.element_spec()["input_ids"]
        batch, seq_len = spec.shape
        decoder = cfg.model.decoder
        flops = model_flops_per_token(
            matmul_params=matmul,
            num_layers=decoder.transformer.num_layers,
            seq_len=seq_len,
            d_model=decoder.dim,
        )
        num_devices = trainer.mesh.devices.size
        peak = cfg.peak_tflops_per_device or peak_tflops(trainer.mesh.devices.flat[0])
        return cls(
            num_params=total,
            matmul_params=matmul,
            tokens_per_step=batch * seq_len,
            flops_per_step=flops * batch * seq_len,
            num_devices=num_devices,
            peak_tflops_per_device=peak,
        )

    def metrics(self, step_time_s: float) -> dict[str, Any]:
        """tokens/s/device, TFLOP/s/device, MFU, step time and peak memory."""
        tflops = self.flops_per_step / step_time_s / self.num_devices / 1e12
        out = {
            "perf/step_time_s": step_time_s,
            "perf/tokens_per_s_per_device": self.tokens_per_step / step_time_s / self.num_devices,
            "perf/tflops_per_device": tflops,
        }
        if self.peak_tflops_per_device:
            out["perf/mfu"] = tflops / self.peak_tflops_per_device
        memory = device_memory()
        if memory is not None:
            out["perf/peak_memory_gib"] = memory[0] / 2**30
            out["perf/memory_fraction"] = memory[0] / memory[1] if memory[1] else float("nan")
        return out


def device_memory(device: Optional[jax.Device] = None) -> Optional[tuple[int, int]]:
    """(peak bytes in use, bytes limit) of a local device, where the backend reports them."""
    device = device or jax.local_devices()[0]
    try:
        stats = device.memory_stats()
    except Exception:  # pylint: disable=broad-except
        return None
    if not stats or "peak_bytes_in_use" not in stats:
        return None
    return int(stats["peak_bytes_in_use"]), int(stats.get("bytes_limit", 0))


def format_metrics(metrics: dict[str, Any]) -> str:
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
        f"{get('perf/tflops_per_device', '.1f')} TFLOP/s/dev",
    ]
    if "perf/mfu" in summaries:
        parts.append(f"MFU {summaries['perf/mfu']:.1%}")
    if "perf/peak_memory_gib" in summaries:
        parts.append(f"mem {summaries['perf/peak_memory_gib']:.1f} GiB")
    return " | ".join(parts)
