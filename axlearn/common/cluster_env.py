"""Where a process stands in a multi-process run: from flags or from the cluster's environment.

A run of several processes (one per GPU, or one per host) joins through
`jax.distributed.initialize(coordinator_address, num_processes, process_id,
local_device_ids)`. `process_placement` finds those values, in this order:

- flags: `--distributed_coordinator`, `--num_processes`, `--process_id` (all three) and
  optionally `--local_device_ids`;
- SLURM, inside `srun`: SLURM_PROCID, SLURM_NTASKS and the first host of
  SLURM_STEP_NODELIST; the port from JAX_COORDINATOR_PORT, else one derived from
  SLURM_JOB_ID (every task of a job derives the same). Where a node runs several tasks
  that each see all its GPUs, task SLURM_LOCALID takes GPU SLURM_LOCALID; where SLURM
  binds one GPU to each task (CUDA_VISIBLE_DEVICES lists one), the task takes that one.
- a Kubernetes indexed Job: JOB_COMPLETION_INDEX (set by Kubernetes), with
  AXLEARN_NUM_PROCESSES (the Job's completions) and JAX_COORDINATOR_ADDRESS (pod 0's
  host name through a headless service, and a port) set in the pod's environment.

A run of one process needs none of this. docs/cluster.md shows both cluster set-ups.
This module reads only the environment; it does not import jax.
"""

import dataclasses
import os
import re
from collections.abc import Mapping, Sequence
from typing import Optional

from axlearn.common.config import ConfigError

# The environment variables this module reads besides the schedulers' own.
NUM_PROCESSES_ENV = "AXLEARN_NUM_PROCESSES"
COORDINATOR_ADDRESS_ENV = "JAX_COORDINATOR_ADDRESS"  # jax.distributed's own name.
COORDINATOR_PORT_ENV = "JAX_COORDINATOR_PORT"  # jax.distributed's own name.

# SLURM coordinator ports: SLURM_JOB_ID picks one of these, so that two jobs sharing a
# first node do not collide.
SLURM_PORT_BASE = 61000
SLURM_PORT_RANGE = 4000

# The sources `process_placement` may be told to use (--cluster_env).
CLUSTER_ENVS = ("auto", "slurm", "kubernetes", "none")


@dataclasses.dataclass(frozen=True)
class ProcessPlacement:
    """This process's place in a multi-process run: jax.distributed.initialize's arguments."""

    coordinator_address: str  # host:port of process 0's coordination service.
    num_processes: int
    process_id: int
    # The local devices (GPU indices as this process sees them) it uses; None: all of them.
    local_device_ids: Optional[tuple[int, ...]]
    source: str  # Where the values came from: 'flags', 'SLURM' or 'Kubernetes indexed Job'.


def _int(value: str, name: str) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{name} must be an integer, got {value!r}") from None


def _checked(placement: ProcessPlacement) -> ProcessPlacement:
    """`placement`, or a ConfigError naming where its impossible values came from."""
    where = placement.source
    if placement.num_processes < 1:
        raise ConfigError(
            f"{where}: the number of processes must be >= 1, got {placement.num_processes}"
        )
    if not 0 <= placement.process_id < placement.num_processes:
        raise ConfigError(
            f"{where}: process id {placement.process_id} is not in [0, {placement.num_processes})"
        )
    if not re.fullmatch(r".+:[0-9]+", placement.coordinator_address):
        raise ConfigError(
            f"{where}: the coordinator address must be host:port, got "
            f"{placement.coordinator_address!r}"
        )
    return placement


def parse_device_ids(text: Optional[str]) -> Optional[tuple[int, ...]]:
    """'0,1' -> (0, 1); None or '' -> None."""
    if not text:
        return None
    return tuple(_int(part.strip(), "--local_device_ids") for part in text.split(","))


def from_flags(
    coordinator_address: Optional[str],
    num_processes: Optional[int],
    process_id: Optional[int],
    local_device_ids: Optional[Sequence[int]] = None,
) -> Optional[ProcessPlacement]:
    """The placement the flags give; None where none of the three is set."""
    values = (
        ("--distributed_coordinator", coordinator_address),
        ("--num_processes", num_processes),
        ("--process_id", process_id),
    )
    if all(value is None for _, value in values):
        if local_device_ids is not None:
            raise ConfigError("--local_device_ids needs a multi-process run (--num_processes ...)")
        return None
    missing = [name for name, value in values if value is None]
    if missing:
        raise ConfigError(f"A multi-process run needs {', '.join(missing)} too")
    return _checked(
        ProcessPlacement(
            coordinator_address=coordinator_address,
            num_processes=num_processes,
            process_id=process_id,
            local_device_ids=None if local_device_ids is None else tuple(local_device_ids),
            source="flags",
        )
    )


def first_slurm_host(node_list: str) -> str:
    """The first host of a SLURM host list: 'gpu[003-005,9],cpu1' -> 'gpu003'."""
    depth, end = 0, len(node_list)
    for i, ch in enumerate(node_list):
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            end = i
            break
    first = node_list[:end]
    if "[" not in first:
        return first
    prefix, rest = first.split("[", 1)
    ranges, suffix = rest.split("]", 1)
    return prefix + ranges.split(",")[0].split("-")[0] + suffix


def _tasks_per_node(value: str) -> list[int]:
    """SLURM's tasks-per-node list: '4(x2),3' -> [4, 4, 3]."""
    counts = []
    for part in value.split(","):
        match = re.fullmatch(r"([0-9]+)(?:\(x([0-9]+)\))?", part.strip())
        if not match:
            raise ConfigError(f"SLURM_STEP_TASKS_PER_NODE: cannot read {value!r}")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def _slurm_local_device_ids(environ: Mapping[str, str]) -> Optional[tuple[int, ...]]:
    """(SLURM_LOCALID,) where this node runs several tasks that each see all its GPUs."""
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and len([d for d in visible.split(",") if d.strip()]) == 1:
        return None  # SLURM bound one GPU to this task: it is the task's device 0.
    per_node = environ.get("SLURM_STEP_TASKS_PER_NODE") or environ.get("SLURM_TASKS_PER_NODE")
    if not per_node or "SLURM_LOCALID" not in environ:
        return None
    counts = _tasks_per_node(per_node)
    node = _int(environ.get("SLURM_NODEID", "0"), "SLURM_NODEID")
    if counts[min(node, len(counts) - 1)] <= 1:
        return None
    return (_int(environ["SLURM_LOCALID"], "SLURM_LOCALID"),)


def from_slurm(environ: Mapping[str, str]) -> Optional[ProcessPlacement]:
    """The placement of a task that `srun` started; None outside `srun` or for one task."""
    if "SLURM_PROCID" not in environ or "SLURM_STEP_NODELIST" not in environ:
        return None
    num_processes = _int(environ.get("SLURM_NTASKS", ""), "SLURM_NTASKS")
    if num_processes == 1:
        return None
    address = environ.get(COORDINATOR_ADDRESS_ENV)
    if not address:
        port = environ.get(COORDINATOR_PORT_ENV)
        if port is None:
            job_id = _int(environ.get("SLURM_JOB_ID", ""), "SLURM_JOB_ID")
            port = str(SLURM_PORT_BASE + job_id % SLURM_PORT_RANGE)
        address = f"{first_slurm_host(environ['SLURM_STEP_NODELIST'])}:{port}"
    return _checked(
        ProcessPlacement(
            coordinator_address=address,
            num_processes=num_processes,
            process_id=_int(environ["SLURM_PROCID"], "SLURM_PROCID"),
            local_device_ids=_slurm_local_device_ids(environ),
            source="SLURM",
        )
    )


def from_kubernetes(environ: Mapping[str, str]) -> Optional[ProcessPlacement]:
    """The placement of a pod of an indexed Job; None outside one or for one process."""
    if "JOB_COMPLETION_INDEX" not in environ:
        return None
    where = "Kubernetes indexed Job"
    if NUM_PROCESSES_ENV not in environ:
        raise ConfigError(
            f"{where}: JOB_COMPLETION_INDEX is set but {NUM_PROCESSES_ENV} is not; set it to "
            "the Job's completions in the pod's env (docs/cluster.md)"
        )
    num_processes = _int(environ[NUM_PROCESSES_ENV], NUM_PROCESSES_ENV)
    if num_processes == 1:
        return None
    address = environ.get(COORDINATOR_ADDRESS_ENV)
    if not address:
        raise ConfigError(
            f"{where}: {COORDINATOR_ADDRESS_ENV} is not set; set it to pod 0's host name "
            "and a port, e.g. <job>-0.<headless service>:1234 (docs/cluster.md)"
        )
    return _checked(
        ProcessPlacement(
            coordinator_address=address,
            num_processes=num_processes,
            process_id=_int(environ["JOB_COMPLETION_INDEX"], "JOB_COMPLETION_INDEX"),
            local_device_ids=None,  # A pod sees the GPUs it was given, and uses them all.
            source=where,
        )
    )


def process_placement(
    *,
    coordinator_address: Optional[str] = None,
    num_processes: Optional[int] = None,
    process_id: Optional[int] = None,
    local_device_ids: Optional[Sequence[int]] = None,
    cluster_env: str = "auto",
    environ: Optional[Mapping[str, str]] = None,
) -> Optional[ProcessPlacement]:
    """This process's placement: from the flags if any is set, else from the environment
    `cluster_env` names ('auto': SLURM, then a Kubernetes indexed Job; 'none': neither).
    None: a run of one process."""
    if cluster_env not in CLUSTER_ENVS:
        raise ConfigError(f"--cluster_env must be one of {CLUSTER_ENVS}, got {cluster_env!r}")
    placement = from_flags(coordinator_address, num_processes, process_id, local_device_ids)
    if placement is not None:
        return placement
    environ = os.environ if environ is None else environ
    readers = dict(slurm=(from_slurm,), kubernetes=(from_kubernetes,), none=())
    readers["auto"] = (from_slurm, from_kubernetes)
    for reader in readers[cluster_env]:
        placement = reader(environ)
        if placement is not None:
            return placement
    return None
