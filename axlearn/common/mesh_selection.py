"""The mesh rule for the devices at hand. `mesh_rule_for` is the one reading of
`--mesh_selector` (`none` included): from the flag and the devices to the rule of a
config's `mesh_rules` to apply. Its steps: the instance type that names a run's devices
(`instance_type`: `gpu-h100-8`, `tpu-v5p-1024`, `cpu`), the check of a selector against
them (`selector_contradiction`), and the first rule whose regex fully matches it
(`select_mesh_rule`).
"""

import logging
import re
from collections.abc import Sequence
from typing import Any, NamedTuple, Optional

from axlearn.common.config import ConfigError

log = logging.getLogger(__name__)

NO_MESH_RULE = "none"  # --mesh_selector=none: the config's own mesh_shape, no rule.

# A GPU's chip in its JAX device kind: 'H100' in 'NVIDIA H100 80GB HBM3', 'A100' in
# 'NVIDIA A100-SXM4-80GB', 'MI300X' in 'AMD Instinct MI300X'.
_GPU_CHIP = re.compile(r"[A-Za-z]{1,2}[0-9]{1,4}[A-Za-z]?")
# TPU device kinds ('TPU v5 lite') -> their family in instance types ('tpu-v5litepod-256').
_TPU_FAMILIES = {"v5 lite": "v5litepod", "v5": "v5p", "v6 lite": "v6e"}
# TPU v4 and v5p instance sizes count TensorCores; their two cores per chip form one JAX
# device (megacore). Other sizes count devices.
_TENSORCORES_PER_DEVICE = {"v4": 2, "v5p": 2}


def _gpu_chip(device_kind: str) -> str:
    tokens = re.split(r"[\s_-]+", device_kind.strip())
    for token in tokens:
        if _GPU_CHIP.fullmatch(token):
            return token.lower()
    # No chip-like token (e.g. 'NVIDIA GeForce RTX 4090'): the kind without its vendor.
    rest = [t.lower() for t in tokens if t.lower() not in ("nvidia", "amd", "")]
    return "".join(rest) or "unknown"


def _tpu_family(device_kind: str) -> str:
    version = device_kind.lower().strip().removeprefix("tpu").strip()
    return _TPU_FAMILIES.get(version, version.replace(" ", ""))


def instance_type(platform: str, device_kind: str, count: int) -> str:
    """The instance type that names a run's devices, for matching mesh rules: (platform,
    device kind of the first device, number of devices over all processes) ->
    'gpu-h100-8', 'gpu-a100-8', 'tpu-v5p-1024' (TensorCores, as the fleets count them), or
    'cpu' for CPUs of any count."""
    platform = platform.lower()
    if platform == "cpu":
        return "cpu"
    if platform == "tpu":
        family = _tpu_family(device_kind)
        return f"tpu-{family}-{count * _TENSORCORES_PER_DEVICE.get(family, 1)}"
    if platform in ("gpu", "cuda", "rocm"):
        return f"gpu-{_gpu_chip(device_kind)}-{count}"
    return f"{platform}-{count}"


def selector_contradiction(
    selector: str, platform: str, device_kind: str, count: int
) -> Optional[str]:
    """Why `selector` cannot name these devices (another platform, another device count),
    or None. Names that do not start with cpu, gpu or tpu are the user's own: not checked."""
    detected = instance_type(platform, device_kind, count)
    parts = selector.split("-")
    if parts[0] not in ("cpu", "gpu", "tpu"):
        return None
    if parts[0] != detected.split("-")[0]:
        return f"it names {parts[0]} devices"
    if len(parts) > 1 and parts[-1].isdigit():
        family = "-".join(parts[1:-1])
        devices = int(parts[-1])
        if parts[0] == "tpu":
            devices //= _TENSORCORES_PER_DEVICE.get(family, 1)
        if devices != count:
            return f"it names {devices} devices"
    return None


class MeshRule(NamedTuple):
    """The mesh rule a run applies: the selector that chose it, the pattern it matched, and
    the rule's value (a mesh shape, or a config modifier)."""

    selector: str
    pattern: str
    rule: Any


def mesh_rule_for(
    flag_value: Optional[str],
    mesh_rules: Optional[Sequence[tuple[str, Any]]],
    *,
    devices: Optional[Sequence[Any]] = None,
    config_name: str = "the config",
) -> Optional[MeshRule]:
    """The one reading of `--mesh_selector`: the rule of `mesh_rules` to apply, or None
    for none (`NO_MESH_RULE`: the config's own mesh_shape).

    With `devices` (JAX's, over all processes): a selector is checked against them (one
    that names other devices is a ConfigError) and, unset, named from them
    (`instance_type`). Without (printing another host's config, tests): the selector is
    taken as given, and unset means no rule. The first rule whose regex matches all of the
    selector applies (`select_mesh_rule`); none matching is a ConfigError.
    """
    selector = flag_value or None
    if devices is not None:
        device, count = devices[0], len(devices)
        detected = instance_type(device.platform, device.device_kind, count)
        described = f"{count} {device.device_kind} device{'s' if count > 1 else ''} ({detected})"
        if selector is None:
            log.info("Mesh selector %s, named from this run's devices: %s", detected, described)
            selector = detected
        elif selector != NO_MESH_RULE:
            reason = selector_contradiction(selector, device.platform, device.device_kind, count)
            if reason:
                raise ConfigError(
                    f"--mesh_selector={selector} contradicts this run's devices, {described}: "
                    f"{reason}; leave the flag out to use {detected}"
                )
    if selector == NO_MESH_RULE:
        on = "" if devices is None else f" on {described}"
        log.info("--mesh_selector=none: no mesh rule; the config's own mesh_shape%s", on)
        return None
    if selector is None:
        return None
    pattern, rule = select_mesh_rule(mesh_rules, selector, config_name=config_name)
    what = type(rule).__qualname__.split(".")[0] if hasattr(rule, "klass") else f"mesh {rule}"
    log.info(
        "Mesh selector %s: %s's rule %r, %s (see --print_config)",
        selector, config_name, pattern, what,
    )
    return MeshRule(selector, pattern, rule)


def select_mesh_rule(
    mesh_rules: Optional[Sequence[tuple[str, Any]]],
    mesh_selector: str,
    *,
    config_name: str = "the config",
) -> tuple[str, Any]:
    """(pattern, value) of the first rule whose regex matches all of `mesh_selector`
    (`re.fullmatch`). None matching is an error naming `config_name` and the patterns."""
    for pattern, value in mesh_rules or ():
        if re.fullmatch(pattern, mesh_selector):
            return pattern, value
    patterns = [p for p, _ in mesh_rules or ()]
    raise ConfigError(
        f"--mesh_selector={mesh_selector} matches none of {config_name}'s mesh_rules: "
        f"{patterns}; pass one they match, or --mesh_selector={NO_MESH_RULE} for the "
        "config's own mesh_shape"
    )
