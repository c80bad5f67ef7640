"""Process set-up before JAX starts: backend, XLA flag presets and multi-process init.

A multi-process run (one process per GPU, or per host) joins through jax.distributed with
the placement `cluster_env.process_placement` finds: from the flags, or from SLURM's or a
Kubernetes indexed Job's environment (docs/cluster.md); then `peer_watch` stops it within
a minute, with one line, should another process of the run be gone.
"""

import logging
import os
from collections.abc import Sequence
from typing import Optional

from absl import flags

from axlearn.common import cluster_env, compilation_cache, peer_watch, run_lock

log = logging.getLogger(__name__)

# XLA flags per platform. They are prepended to XLA_FLAGS, so anything the user sets
# there wins; try a change with
# `python -m axlearn.bench ... --compare_xla_flags= --compare_xla_flags=<flags>`.
XLA_FLAG_PRESETS: dict[str, Sequence[str]] = {
    "gpu": (
        # Overlap collectives (FSDP's all-gathers and reduce-scatters) with compute.
        "--xla_gpu_enable_latency_hiding_scheduler=true",
        # Combine the small collectives of many layers into few large ones (128 MiB),
        # which matters most with FSDP over several GPUs.
        "--xla_gpu_all_gather_combine_threshold_bytes=134217728",
        "--xla_gpu_reduce_scatter_combine_threshold_bytes=134217728",
        "--xla_gpu_all_reduce_combine_threshold_bytes=134217728",
        # Every matmul on cuBLAS, none as an autotuned Triton GEMM: cuBLAS is faster for
        # the models here.
        "--xla_gpu_enable_triton_gemm=false",
    ),
    "cpu": (),
    "tpu": (),
}


def _define_cluster_env(name: str, default: str, help_text: str, flag_values) -> None:
    flags.DEFINE_enum(name, default, cluster_env.CLUSTER_ENVS, help_text, flag_values=flag_values)


# (define function, name, default, help): the flags every launcher shares.
FLAGS_TABLE = (
    (flags.DEFINE_string, "jax_backend", None, "cpu, gpu or tpu; None: JAX's default."),
    (
        flags.DEFINE_string,
        "xla_flags_preset",
        "auto",
        "auto: the preset for the backend; none: no preset.",
    ),
    (
        flags.DEFINE_string,
        "distributed_coordinator",
        None,
        "host:port of process 0, for multi-process runs.",
    ),
    (flags.DEFINE_integer, "num_processes", None, "Number of processes of a multi-process run."),
    (flags.DEFINE_integer, "process_id", None, "This process's index in a multi-process run."),
    (
        flags.DEFINE_bool,
        "distributed_auto",
        False,
        "Call jax.distributed.initialize() with no arguments (cluster auto-detection: SLURM, "
        "TPU, ...).",
    ),
    (
        flags.DEFINE_string,
        "local_device_ids",
        None,
        "With --num_processes: the local GPUs this process uses, e.g. 2 or 0,1 (one process "
        "per GPU on one host); unset: all it sees.",
    ),
    (
        _define_cluster_env,
        "cluster_env",
        "auto",
        "Where a process without --num_processes finds its place in a multi-process run: "
        "auto (SLURM, then a Kubernetes indexed Job), slurm, kubernetes or none "
        "(docs/cluster.md).",
    ),
    (
        flags.DEFINE_string,
        "jax_compilation_cache_dir",
        None,
        "Where compiled programs are kept for later starts to load: a local directory, "
        "gs://bucket/dir or s3://bucket/dir; none: no cache. Unset: $JAX_COMPILATION_CACHE_DIR, "
        "else $XDG_CACHE_HOME/axlearn/jax (~/.cache/axlearn/jax).",
    ),
    (
        flags.DEFINE_multi_string,
        "jax_config",
        [],
        "KEY=VALUE: sets the jax.config option KEY (e.g. jax_debug_nans=true, "
        "jax_persistent_cache_min_compile_time_secs=0), type-checked; repeatable.",
    ),
)


def define_flags(flag_values: flags.FlagValues = flags.FLAGS) -> None:
    """Flags shared by every launcher."""
    for define, name, default, help_text in FLAGS_TABLE:
        define(name, default, help_text, flag_values=flag_values)


def apply_xla_flag_preset(backend: Optional[str], preset: str = "auto") -> None:
    """Prepends the backend's preset to XLA_FLAGS (before the backend starts)."""
    if preset == "none" or backend is None:
        return
    flags_for_backend = XLA_FLAG_PRESETS.get(backend, ())
    user = os.environ.get("XLA_FLAGS", "")
    user_names = {f.split("=")[0] for f in user.split()}
    extra = [f for f in flags_for_backend if f.split("=")[0] not in user_names]
    if extra:
        os.environ["XLA_FLAGS"] = " ".join([*extra, user]).strip()


def setup(
    *,
    jax_backend: Optional[str] = None,
    xla_flags_preset: str = "auto",
    distributed_coordinator: Optional[str] = None,
    num_processes: Optional[int] = None,
    process_id: Optional[int] = None,
    distributed_auto: bool = False,
    local_device_ids: Optional[Sequence[int]] = None,
    cluster_env_name: str = "auto",
    compilation_cache_dir: Optional[str] = None,
    jax_configs: Sequence[str] = (),
    use_compilation_cache: bool = False,
) -> None:
    """Chooses the backend, applies XLA flags, places the compilation cache and sets the
    `jax_configs` (KEY=VALUE) with `use_compilation_cache` (`compilation_cache.configure`),
    and joins a multi-process run if the flags or the cluster's environment say so
    (`cluster_env.process_placement`)."""
    if distributed_auto:
        placement = None
    else:
        placement = cluster_env.process_placement(
            coordinator_address=distributed_coordinator,
            num_processes=num_processes,
            process_id=process_id,
            local_device_ids=local_device_ids,
            cluster_env=cluster_env_name,
        )
    backend = jax_backend or _guess_backend()
    apply_xla_flag_preset(backend, xla_flags_preset)
    import jax  # pylint: disable=import-outside-toplevel

    if jax_backend:
        jax.config.update("jax_platforms", jax_backend)
    if use_compilation_cache:
        compilation_cache.configure(compilation_cache_dir, jax_configs)
    elif jax_configs:
        compilation_cache.apply_jax_configs(compilation_cache.parse_jax_configs(jax_configs))
    if placement is None and not distributed_auto:
        return
    if jax_backend == "cpu" or backend == "cpu":
        # Cross-process collectives on CPU go through gloo.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if distributed_auto:
        jax.distributed.initialize()
        source = "jax.distributed's detection"
    else:
        device_ids = placement.local_device_ids
        jax.distributed.initialize(
            coordinator_address=placement.coordinator_address,
            num_processes=placement.num_processes,
            process_id=placement.process_id,
            local_device_ids=None if device_ids is None else list(device_ids),
        )
        source = f"{placement.source}, coordinator {placement.coordinator_address}"
    log.info(
        "Process %d of %d joined (%s), %d local devices",
        jax.process_index(),
        jax.process_count(),
        source,
        jax.local_device_count(),
    )
    # A process that is gone stops the others within a minute, with one line.
    peer_watch.start_watch(on_exit=run_lock.release_all)


def setup_from_flags(flag_values: flags.FlagValues = flags.FLAGS) -> None:
    setup(
        jax_backend=flag_values.jax_backend,
        xla_flags_preset=flag_values.xla_flags_preset,
        distributed_coordinator=flag_values.distributed_coordinator,
        num_processes=flag_values.num_processes,
        process_id=flag_values.process_id,
        distributed_auto=flag_values.distributed_auto,
        local_device_ids=cluster_env.parse_device_ids(flag_values.local_device_ids),
        cluster_env_name=flag_values.cluster_env,
        compilation_cache_dir=flag_values.jax_compilation_cache_dir,
        jax_configs=flag_values.jax_config,
        use_compilation_cache=True,
    )


def _guess_backend() -> Optional[str]:
    """The backend JAX will pick, guessed without starting it (XLA flags must come first)."""
    platforms = os.environ.get("JAX_PLATFORMS", "")
    if platforms:
        return platforms.split(",")[0]
    if os.path.exists("/dev/nvidia0") or os.path.exists("/dev/nvidiactl"):
        return "gpu"
    if tpu_present():
        return "tpu"
    return "cpu"


def tpu_present() -> bool:
    """Whether this host has TPU device files, checked without starting JAX."""
    return os.path.exists("/dev/accel0") or os.path.exists("/dev/vfio/0")
