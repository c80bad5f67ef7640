r"""Benchmarks named trainer configs and compares git revisions side by side.

    # One config, synthetic data, 20 timed steps after 5 warm-up steps (4 sequences a
    # step, one microbatch, in place of gpt_1b's configured 1,024 that one GPU would run
    # as 256 microbatches):
    python -m axlearn.bench --config=gpt_1b --steps=20 \
        --config_override=input.global_batch_size=4

    # The same on two revisions, in one invocation, with an HTML report:
    python -m axlearn.bench --config=gpt_1b \
        --config_override=input.global_batch_size=4 --compare=main,HEAD --html=/tmp/bench.html

    # ... each side twice, in the order main HEAD HEAD main, the table showing the means:
    python -m axlearn.bench --config=gpt_1b \
        --config_override=input.global_batch_size=4 --compare=main,HEAD --rounds=2

    # This tree under two XLA flag settings (added after the environment's XLA_FLAGS;
    # '' for none), e.g. to try a flag for a platform's preset:
    python -m axlearn.bench --config=gpt_1b \
        --config_override=input.global_batch_size=4 --compare_xla_flags= \
        --compare_xla_flags=--xla_gpu_enable_triton_gemm=true --rounds=2

    # Two named configs of this tree, e.g. a recipe variant against its base:
    python -m axlearn.bench --compare_configs=gpt_1b,gpt_1b_narrow_state \
        --config_override=input.global_batch_size=4 --rounds=2

    # One config with two sets of extra overrides (space-separated, quoted as in a shell;
    # '' for none), applied after the --config_override flags both sides share; here,
    # the cuDNN attention as configured against XLA's:
    python -m axlearn.bench --config=gpt_1b \
        --config_override=input.global_batch_size=4 --compare_overrides= \
        --compare_overrides=model.decoder.transformer.layer.self_attention.attention.attention_implementation=xla \
        --rounds=2

    # The same config on two data directories (FAKE, BUILTIN or token shards), e.g. real
    # shards against synthetic batches:
    python -m axlearn.bench --config=golf_baseline --compare_data_dirs=FAKE,/data/shards --rounds=2

    # The config's training input alone, on the CPU: tokens/s this process reads:
    python -m axlearn.bench --config=golf_baseline --data_dir=/data/shards --input_only

The mesh rule is the one for the devices at hand, as the launcher picks it (gpu-h100-1 on
one H100); `--mesh_selector` names another.

Every run prints the standard columns: Parameters (a DPO run's frozen reference copy in a
row of its own), Final loss, TFLOP/s/device, Tokens/s/device, Avg s/step, Memory %, MFU,
JAX version, device; on NVIDIA GPUs also the
mean SM clock and board power over the timed steps (see GpuSampler); and the tokens and
gradient-accumulation microbatches a step runs, so that two rows of a comparison are
known to measure the same step.
"""

import html
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Optional

from absl import flags

from axlearn.common.command_flags import parse_command_flags, usage_error
from axlearn.common.config import ConfigError

COLUMNS = (
    ("Parameters", "num_params", "{:,.0f}", +1),
    # A frozen reference copy's parameters (DPO), not in Parameters; shown where a run has one.
    ("Frozen DPO reference", "reference_params", "{:,.0f}", 0),
    ("Final loss", "final_loss", "{:.4f}", -1),
    ("TFLOP/s/device", "tflops_per_device", "{:.1f}", +1),
    ("Tokens/s/device", "tokens_per_s_per_device", "{:,.0f}", +1),
    ("Avg s/step", "avg_step_time_s", "{:.4f}", -1),
    ("Memory %", "memory_percent", "{:.1f}", -1),
    ("MFU", "mfu_percent", "{:.1f}%", +1),
    ("SM clock (MHz)", "sm_clock_mhz", "{:,.0f}", 0),
    ("GPU power (W)", "gpu_power_w", "{:.0f}", 0),
    ("Tokens/step", "tokens_per_step", "{:,.0f}", 0),
    ("Microbatches/step", "microbatches_per_step", "{:,.0f}", 0),
    ("JAX version", "jax_version", "{}", 0),
    ("Device", "device", "{}", 0),
)

# Columns left out of a table where no run has a value (not a dash on every row).
SHOWN_WHERE_GIVEN = frozenset({"reference_params"})

# The columns of an --input_only run.
INPUT_COLUMNS = (
    ("Input tokens/s/process", "input_tokens_per_s_per_process", "{:,.0f}", +1),
    ("Batches/s", "batches_per_s", "{:,.1f}", +1),
    ("Avg ms/batch", "avg_batch_ms", "{:.2f}", -1),
    ("Tokens/batch/process", "tokens_per_batch", "{:,.0f}", 0),
    ("Data", "data_dir", "{}", 0),
)


def build_benchmark_config(
    config: str,
    *,
    module: Optional[str] = None,
    mesh_selector: Optional[str] = None,
    devices: Optional[Sequence[Any]] = None,
    data_dir: str = "FAKE",
    overrides: Sequence[str] = (),
) -> Any:
    """The named trainer config as benchmarks run it: no trainer directory (so no
    checkpoints or summaries) and no evalers; only the step is measured. `mesh_selector`
    and `devices` as `launch_trainer.build_trainer_config` reads them."""
    from axlearn.common.launch_trainer import build_trainer_config  # pylint: disable=import-outside-toplevel

    cfg = build_trainer_config(
        config_name=config,
        module=module,
        mesh_selector=mesh_selector,
        devices=devices,
        data_dir=data_dir,
        config_overrides=list(overrides),
    )
    cfg.dir = None
    cfg.evalers = {}
    return cfg


def time_steps(
    step: Callable[[], Any], steps: int, *, clock: Callable[[], float] = time.perf_counter
) -> tuple[list[float], list[Any]]:
    """Runs `steps` calls of `step` (each dispatches one train step and returns its loss
    without waiting) as the training loop does: the next step is dispatched before the
    host waits for the current one, so the device always has a step queued and never
    waits for the host.

    Returns each step's seconds by `clock`, from the previous step's completion to its own
    (the first from the start, so it includes the first dispatch), and the steps' losses.
    Waiting on each step in turn is what makes these per-step times: dispatching every
    step first and reading the completions afterwards would mostly time the dispatch
    loop, which the runtime blocks once a few steps are in flight.
    """
    import jax  # pylint: disable=import-outside-toplevel

    start = clock()
    done, losses = [], []
    current = step()
    for i in range(steps):
        following = step() if i + 1 < steps else None
        jax.block_until_ready(current)
        done.append(clock())
        losses.append(current)
        current = following
    return [b - a for a, b in zip([start] + done[:-1], done)], losses


def run_benchmark(
    *,
    config: str,
    module: Optional[str],
    mesh_selector: Optional[str],
    data_dir: str,
    overrides: Sequence[str],
    steps: int,
    warmup_steps: int,
    profile_dir: Optional[str] = None,
    xla_dump_dir: Optional[str] = None,
    xla_flags_preset: str = "auto",
    modify: Optional[Callable[[Any], Any]] = None,
) -> dict[str, Any]:
    """Trains `warmup_steps + steps` steps in this process; returns the measured columns.

    `modify`: applied to the trainer config after overrides (benchmark variants).
    """
    trainer = _benchmark_trainer(
        config, module=module, mesh_selector=mesh_selector, data_dir=data_dir,
        overrides=overrides, xla_dump_dir=xla_dump_dir, xla_flags_preset=xla_flags_preset,
        modify=modify,
    )
    import jax  # pylint: disable=import-outside-toplevel

    from axlearn.common import perf  # pylint: disable=import-outside-toplevel

    accounting = perf.StepAccounting.for_trainer(trainer)
    # Rows of the batch: a pair batch's pairs (each side's rows), not its sequences.
    batch_rows = jax.tree.leaves(trainer.input.element_spec())[0].shape[0]
    microbatches = trainer.num_microbatches(batch_rows)  # From per_device_microbatch_size.
    step, host_batches = _train_step_fn(trainer)
    try:
        losses, step_times, gpu_samples = _measure_steps(
            step, steps=steps, warmup_steps=warmup_steps, profile_dir=profile_dir
        )
    finally:
        host_batches.close()
    return _benchmark_row(config, accounting, microbatches, losses, step_times, gpu_samples)


def _benchmark_trainer(
    config: str,
    *,
    module: Optional[str],
    mesh_selector: Optional[str],
    data_dir: str,
    overrides: Sequence[str],
    xla_dump_dir: Optional[str],
    xla_flags_preset: str,
    modify: Optional[Callable[[Any], Any]],
) -> Any:
    """run_benchmark's trainer: the name checked before JAX looks for devices, XLA set
    up (`launch.setup`, `xla_dump_dir`), the config built as the launcher does (the
    selector checked against the devices, or named from them: gpu-h100-1, cpu), then
    `modify`."""
    # pylint: disable-next=import-outside-toplevel
    from axlearn.common.experiment_registry import lookup_named_config

    # A wrong name fails before JAX looks for devices.
    lookup_named_config(config, module=module)
    if xla_dump_dir:
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={xla_dump_dir}".strip()
    from axlearn.common import launch  # pylint: disable=import-outside-toplevel

    launch.setup(xla_flags_preset=xla_flags_preset)
    import jax  # pylint: disable=import-outside-toplevel

    cfg = build_benchmark_config(
        config, module=module, mesh_selector=mesh_selector, devices=jax.devices(),
        data_dir=data_dir, overrides=overrides,
    )
    if modify is not None:
        cfg = modify(cfg)
    return cfg.instantiate(parent=None)


def _train_step_fn(trainer: Any) -> tuple[Callable[[], Any], Any]:
    """(a function that dispatches one train step and returns its loss, the host batch
    iterator to close), from the trainer's initial state. As in training
    (SpmdTrainer.run): host batches are made in a thread, put on the devices in this one,
    and the steps are dispatched ahead."""
    import jax  # pylint: disable=import-outside-toplevel

    from axlearn.common.input_prefetch import prefetch_in_thread  # pylint: disable=import-outside-toplevel

    trainer._state = trainer.init_state(jax.random.PRNGKey(0))  # pylint: disable=protected-access
    host_batches = prefetch_in_thread(  # pylint: disable=protected-access
        (batch for _, batch in trainer._host_batches()), size=2
    )

    def step() -> Any:
        return trainer.train_step(trainer.global_batch(next(host_batches)))["loss"]

    return step, host_batches


def _measure_steps(
    step: Callable[[], Any], *, steps: int, warmup_steps: int, profile_dir: Optional[str]
) -> tuple[list[float], list[float], dict[str, Any]]:
    """(every step's loss, the timed steps' seconds, the GPU's clock and power over them)
    of `warmup_steps` untimed steps, then `steps` timed ones (`time_steps`), traced into
    `profile_dir` if given (its summary printed)."""
    import jax  # pylint: disable=import-outside-toplevel

    losses = []
    for _ in range(warmup_steps):
        losses.append(float(step()))
    if profile_dir:
        jax.profiler.start_trace(profile_dir)
    sampler = GpuSampler() if jax.default_backend() == "gpu" else None
    if sampler is not None:
        sampler.start()
    try:
        step_times, timed_losses = time_steps(step, steps)
    finally:
        gpu_samples = sampler.stop() if sampler is not None else {}
    losses += [float(loss) for loss in timed_losses]
    if profile_dir:
        jax.profiler.stop_trace()
        print(summarize_trace(profile_dir, steps=steps))
    return losses, step_times, gpu_samples


def _benchmark_row(
    config: str,
    accounting: Any,
    microbatches: int,
    losses: list[float],
    step_times: list[float],
    gpu_samples: dict[str, Any],
) -> dict[str, Any]:
    """run_benchmark's measured columns."""
    import jax  # pylint: disable=import-outside-toplevel

    from axlearn.common import perf  # pylint: disable=import-outside-toplevel

    # The mean over the timed steps: the first includes the dispatch lead-in.
    avg = sum(step_times) / len(step_times)
    metrics = accounting.metrics(avg)
    memory = perf.device_memory()
    device = jax.devices()[0]
    return {
        "config": config,
        "num_params": accounting.num_params,
        "reference_params": accounting.reference_params or None,
        "final_loss": losses[-1],
        "losses": losses,
        "step_times": step_times,
        "avg_step_time_s": avg,
        "tflops_per_device": metrics.get("perf/tflops_per_device", float("nan")),
        "tokens_per_s_per_device": metrics["perf/tokens_per_s_per_device"],
        "mfu_percent": 100 * metrics["perf/mfu"] if "perf/mfu" in metrics else float("nan"),
        "memory_percent": 100 * memory[0] / memory[1] if memory and memory[1] else float("nan"),
        "peak_memory_gib": memory[0] / 2**30 if memory else float("nan"),
        "sm_clock_mhz": gpu_samples.get("sm_clock_mhz"),
        "gpu_power_w": gpu_samples.get("gpu_power_w"),
        "tokens_per_step": accounting.tokens_per_step,
        "microbatches_per_step": microbatches,
        "jax_version": jax.__version__,
        "device": f"{jax.device_count()}x {device.device_kind}",
    }


def run_input_benchmark(
    *,
    config: str,
    module: Optional[str],
    data_dir: str,
    overrides: Sequence[str],
    steps: int,
    warmup_steps: int,
) -> dict[str, Any]:
    """Reads `warmup_steps + steps` batches of the config's training input on the CPU, as
    the trainer's input thread does (this process's rows, host arrays); returns the rate of
    the timed ones. The rate to compare with is the trainer's tokens/s divided by the
    number of processes: below it, the input sets the pace."""
    os.environ["JAX_PLATFORMS"] = "cpu"  # The input runs on the host; leave accelerators be.
    cfg = build_benchmark_config(config, module=module, mesh_selector="none", data_dir=data_dir, overrides=overrides)
    source = cfg.input.clone(is_training=True).set(name="input").instantiate(parent=None)
    batches = iter(source.dataset())
    tokens = 0
    for _ in range(warmup_steps):  # First reads: page cache, the first epoch's order.
        next(batches)
    start = time.perf_counter()
    for _ in range(steps):
        batch = next(batches)
        tokens += sum(x.size for key, x in batch.items() if key.endswith("input_ids"))
    elapsed = time.perf_counter() - start
    close = getattr(batches, "close", None)
    if close is not None:
        close()
    return {
        "config": config,
        "input_only": True,
        "data_dir": data_dir,
        "input_tokens_per_s_per_process": tokens / elapsed,
        "batches_per_s": steps / elapsed,
        "avg_batch_ms": 1000 * elapsed / steps,
        "tokens_per_batch": tokens / steps,
    }


def parse_gpu_samples(text: str) -> list[tuple[float, float]]:
    """(SM clock in MHz, board power in W) for each line of `nvidia-smi
    --query-gpu=clocks.sm,power.draw --format=csv,noheader,nounits`; lines it cannot read
    (a '[N/A]' reading, a line cut off when the sampler stopped) are skipped."""
    samples = []
    for line in text.splitlines():
        fields = [f.strip() for f in line.split(",")]
        try:
            clock, power = float(fields[0]), float(fields[1])
        except (ValueError, IndexError):
            continue
        samples.append((clock, power))
    return samples


class GpuSampler:
    """Samples the SM clock and board power of the visible NVIDIA GPUs with nvidia-smi
    between `start()` and `stop()`.

    A card at its power limit lowers its clock under a long run of matrix multiplies, and
    how far differs from card to card, so the same code runs at different speeds on two
    cards of one kind. The mean clock tells such a difference from one made by the code.
    Without nvidia-smi nothing is sampled.
    """

    def __init__(self, interval_ms: int = 200):
        self._interval_ms = interval_ms
        self._process: Optional[subprocess.Popen] = None
        self._output = None

    def start(self) -> None:
        command = ["nvidia-smi", "--query-gpu=clocks.sm,power.draw",
                   "--format=csv,noheader,nounits", f"--loop-ms={self._interval_ms}"]
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
        if visible:
            command.append(f"--id={visible}")
        self._output = tempfile.TemporaryFile(mode="w+")
        try:
            self._process = subprocess.Popen(command, stdout=self._output, stderr=subprocess.DEVNULL)
        except OSError:  # No nvidia-smi on this machine.
            self._process = None

    def stop(self) -> dict[str, float]:
        """{'sm_clock_mhz', 'gpu_power_w'}: means over all samples of all visible GPUs;
        empty if nothing was sampled."""
        if self._process is None or self._output is None:
            return {}
        self._process.terminate()
        self._process.wait()
        self._output.seek(0)
        samples = parse_gpu_samples(self._output.read())
        self._output.close()
        self._process = self._output = None
        if not samples:
            return {}
        return {
            "sm_clock_mhz": sum(c for c, _ in samples) / len(samples),
            "gpu_power_w": sum(p for _, p in samples) / len(samples),
        }


class KernelEvent(NamedTuple):
    """One kernel run on a GPU stream of a profiler trace."""

    start_ns: int
    name: str  # The kernel's name (a fusion's kernel is named after its HLO instruction).
    ms: float
    # The HLO instruction that launched it, as the trace records it: a library call's
    # custom-call (cuBLAS, cuDNN) too, except inside a CUDA graph, where every kernel is
    # recorded under the graph's thunk ('command_buffer_N').
    hlo_op: str


def gpu_kernel_events(profile_dir: str) -> list[KernelEvent]:
    """Every kernel on the GPU streams of the trace under `profile_dir`, in order of start
    (empty if there is none)."""
    import glob  # pylint: disable=import-outside-toplevel

    import jax  # pylint: disable=import-outside-toplevel

    files = sorted(glob.glob(os.path.join(profile_dir, "**", "*.xplane.pb"), recursive=True))
    events = []
    for plane in jax.profiler.ProfileData.from_file(files[-1]).planes if files else ():
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            # Kernels run on the stream lines; the 'XLA Ops'/'XLA Modules' lines repeat them.
            if "stream" not in line.name.lower():
                continue
            for e in line.events:
                hlo_op = next((str(v) for k, v in e.stats if k == "hlo_op"), "")
                events.append(KernelEvent(e.start_ns, e.name, e.duration_ns / 1e6, hlo_op))
    return sorted(events)


def gpu_kernel_times(profile_dir: str) -> dict[str, tuple[float, int]]:
    """Kernel name -> (total ms, launches) on the GPU streams of the trace under
    `profile_dir` (empty if there is none)."""
    totals: dict[str, tuple[float, int]] = {}
    for event in gpu_kernel_events(profile_dir):
        total, count = totals.get(event.name, (0.0, 0))
        totals[event.name] = (total + event.ms, count + 1)
    return totals


def write_json(path: Optional[str], results: Any) -> None:
    """Writes a measurement script's results to `path` as indented JSON (its --json_out);
    nothing when `path` is None."""
    if path:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=1)


def gpu_time_ms(fn: Callable, *args, calls: int = 10) -> tuple[float, dict[str, float]]:
    """GPU kernel time of one call of `fn(*args)` from a profiler trace of `calls` calls
    (so no dispatch overhead), and that time by kernel name. Calls once first to compile."""
    import jax  # pylint: disable=import-outside-toplevel

    jax.block_until_ready(fn(*args))
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            for _ in range(calls):
                jax.block_until_ready(fn(*args))
        per_kernel = {name: ms / calls for name, (ms, _) in gpu_kernel_times(trace_dir).items()}
    return sum(per_kernel.values()), per_kernel


def summarize_trace(profile_dir: str, *, steps: int, top: int = 25) -> str:
    """GPU kernel time per step by kernel name, from the trace under `profile_dir`."""
    totals = {name: ms for name, (ms, _) in gpu_kernel_times(profile_dir).items()}
    if not totals:
        return f"No GPU kernels in a trace under {profile_dir}"
    total = sum(totals.values())
    rows = sorted(totals.items(), key=lambda kv: -kv[1])[:top]
    lines = [f"GPU kernel time: {total / steps:.2f} ms/step over {steps} steps"]
    lines += [f"{ms / steps:9.3f} ms/step {100 * ms / total:5.1f}%  {name[:110]}" for name, ms in rows]
    return "\n".join(lines)


def format_table(
    results: dict[str, dict[str, Any]], columns: Optional[Sequence[tuple]] = None
) -> str:
    """Columns as rows, one column per run; with two runs, a Diff column (second - first).
    `columns`: (title, result key, format, better) rows (None: COLUMNS, or INPUT_COLUMNS
    for input-only runs); a peer's benchmark (tools/peft_bench.py) adds its own."""
    names = list(results)
    if columns is None:
        input_only = all(r.get("input_only") for r in results.values())
        columns = INPUT_COLUMNS if input_only else COLUMNS
    rows = [["Metric", *names]]
    with_diff = len(names) == 2
    if with_diff:
        rows[0].append(f"Diff ({names[1]} - {names[0]})")
    for title, key, fmt, better in columns:
        values = [results[n].get(key) for n in names]
        if key in SHOWN_WHERE_GIVEN and all(v is None for v in values):
            continue
        row = [title, *[_fmt(fmt, v) for v in values]]
        if with_diff:
            row.append(_diff(values[0], values[1], better))
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [" | ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)


def _fmt(fmt: str, value: Any) -> str:
    if value is None:
        return "-"
    try:
        return fmt.format(value)
    except (ValueError, TypeError):
        return str(value)


def _diff(a: Any, b: Any, better: int) -> str:
    numbers = all(isinstance(x, (int, float)) and x == x for x in (a, b))  # x == x: not NaN.
    if not numbers or better == 0 or not a:
        return ""
    delta = b - a
    relative = delta / abs(a)
    if abs(relative) < 0.01:
        mark = "~"
    else:
        mark = "improved" if delta * better > 0 else "REGRESSED"
    return f"{delta:+.4g} ({relative:+.1%}) {mark}"


def _svg_lines(series: dict[str, list[float]], title: str, width: int = 560, height: int = 240) -> str:
    """A small line chart as inline SVG (no plotting dependency)."""
    colors = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd")
    values = [v for s in series.values() for v in s if v == v]
    if not values:
        return ""
    lo, hi = min(values), max(values)
    hi = hi if hi > lo else lo + 1
    n = max(len(s) for s in series.values())
    pad = 40
    parts = [f'<svg width="{width}" height="{height}" xmlns="http://www.w3.org/2000/svg">',
             f'<text x="{pad}" y="16" font-size="13">{html.escape(title)}</text>',
             f'<text x="2" y="{pad}" font-size="10">{hi:.4g}</text>',
             f'<text x="2" y="{height - pad}" font-size="10">{lo:.4g}</text>']
    for i, (name, s) in enumerate(series.items()):
        pts = " ".join(
            f"{pad + (width - 2 * pad) * j / max(n - 1, 1):.1f},"
            f"{height - pad - (height - 2 * pad) * (v - lo) / (hi - lo):.1f}"
            for j, v in enumerate(s)
        )
        color = colors[i % len(colors)]
        parts.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.5" points="{pts}"/>')
        parts.append(f'<text x="{width - 150}" y="{20 + 14 * i}" font-size="11" fill="{color}">{html.escape(name)}</text>')
    parts.append("</svg>")
    return "".join(parts)


def write_html(results: dict[str, dict[str, Any]], path: str, title: str) -> None:
    table = format_table(results)
    losses = {n: r.get("losses", []) for n, r in results.items()}
    times = {n: r.get("step_times", []) for n, r in results.items()}
    page = (
        f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title></head>"
        f"<body style='font-family: sans-serif'><h2>{html.escape(title)}</h2>"
        f"<pre>{html.escape(table)}</pre>"
        f"{_svg_lines(losses, 'Loss per step (warm-up included)')}<br>"
        f"{_svg_lines(times, 'Seconds per timed step')}"
        "</body></html>"
    )
    with open(path, "w", encoding="utf-8") as f:
        f.write(page)


def run_in_rounds(
    sides: dict[str, Any], run: Callable[[Any], dict[str, Any]], *, rounds: int = 1
) -> dict[str, dict[str, Any]]:
    """Runs `run(side)` for every named side (a source tree, a set of XLA flags), `rounds`
    times, reversing the order every other round (A B, B A, A B, ...): the run that goes
    second in a call tends to be slower (a warmer card), so alternating keeps that from
    favouring one side.

    Returns per side its first run's result with each numeric column of the table replaced
    by the mean over its runs, and 'runs_tokens_per_s_per_device' listing every run's rate.
    """
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    names = list(sides)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    for i in range(rounds):
        for name in names if i % 2 == 0 else reversed(names):
            runs[name].append(run(sides[name]))
    results = {}
    for name in names:
        result = dict(runs[name][0])
        for _, key, _, _ in COLUMNS + INPUT_COLUMNS:
            values = [r.get(key) for r in runs[name]]
            if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
                result[key] = sum(values) / len(values)
        result["runs_tokens_per_s_per_device"] = [r.get("tokens_per_s_per_device") for r in runs[name]]
        results[name] = result
    return results


class _Side(NamedTuple):
    """One side of a comparison: this benchmark run from `tree` with `argv`, and
    `xla_flags` added to the environment's XLA_FLAGS."""

    tree: str
    argv: list[str]
    xla_flags: str = ""


def _export_revision(rev: str, repo: str, dest: str) -> None:
    """Writes the tree of `rev` into `dest` (git archive: no checkout of ours is touched)."""
    os.makedirs(dest, exist_ok=True)
    archive = subprocess.run(["git", "-C", repo, "archive", rev], capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", dest], input=archive.stdout, check=True)


def _run_in_tree(tree: str, argv: Sequence[str], *, xla_flags: str = "") -> dict[str, Any]:
    """Runs this benchmark from a source tree in a fresh process, with `xla_flags` added
    after the environment's XLA_FLAGS (where a flag is given twice, XLA takes the last)."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    env = dict(os.environ, PYTHONPATH=tree + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if xla_flags:
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {xla_flags}".strip()
    subprocess.run([sys.executable, "-m", "axlearn.bench", *argv, f"--json_out={out}"], cwd=tree, env=env, check=True)
    with open(out, encoding="utf-8") as f:
        return json.load(f)


PROGRAM = "axlearn.bench"
COMPARE_FLAGS = (
    "compare", "compare_dirs", "compare_xla_flags", "compare_configs", "compare_overrides",
    "compare_data_dirs",
)


def define_flags(flag_values: flags.FlagValues) -> None:
    """The benchmark's flags, on `flag_values`."""
    fv = dict(flag_values=flag_values)
    flags.DEFINE_string("config", None, "The named config to run.", **fv)
    flags.DEFINE_string(
        "module", None,
        "Experiment module under experiments/ (optional when the config name is unique).", **fv,
    )
    flags.DEFINE_string(
        "mesh_selector", None,
        "Instance type matched against the config's mesh_rules. Unset: named from the "
        "devices (gpu-h100-1, cpu, ...); none: no rule, the config's own mesh_shape.", **fv,
    )
    flags.DEFINE_string(
        "data_dir", "FAKE",
        "FAKE (synthetic), BUILTIN (the built-in byte corpus) or a data directory.", **fv,
    )
    flags.DEFINE_multi_string(
        "config_override", [], "path=value (a Python literal), applied in order.", **fv
    )
    flags.DEFINE_integer("steps", 20, "Timed steps.", **fv)
    flags.DEFINE_integer("warmup_steps", 5, "Steps run before the timed ones.", **fv)
    flags.DEFINE_string("profile_dir", None, "Save a profiler trace of the timed steps.", **fv)
    flags.DEFINE_string("xla_dump_dir", None, "Dump the compiled HLO (--xla_dump_to).", **fv)
    flags.DEFINE_string("xla_flags_preset", "auto", "auto or none (launch.XLA_FLAG_PRESETS).", **fv)
    flags.DEFINE_string("compare", None, "REV_A,REV_B: benchmark two git revisions.", **fv)
    flags.DEFINE_string("compare_dirs", None, "DIR_A,DIR_B: benchmark two source trees.", **fv)
    flags.DEFINE_multi_string(
        "compare_xla_flags", None,
        "Give twice: benchmark this tree under two XLA flag settings, each added after "
        "the environment's XLA_FLAGS ('' for none); the sides are named by their flags.", **fv,
    )
    flags.DEFINE_string(
        "compare_configs", None,
        "CONFIG_A,CONFIG_B: benchmark two named configs of this tree (in place of --config).",
        **fv,
    )
    flags.DEFINE_multi_string(
        "compare_overrides", None,
        "Give twice: benchmark --config with two sets of config overrides, each "
        "space-separated (shell quoting) and applied after the shared --config_override "
        "flags ('' for none); the sides are named by their overrides.", **fv,
    )
    flags.DEFINE_string(
        "compare_data_dirs", None,
        "DATA_A,DATA_B: benchmark --config on two data directories (in place of --data_dir).",
        **fv,
    )
    flags.DEFINE_bool(
        "input_only", False,
        "Measure the config's training input alone, on the CPU, in tokens/s per process.", **fv,
    )
    flags.DEFINE_string("html", None, "Write the comparison as an HTML page.", **fv)
    flags.DEFINE_integer(
        "rounds", 1,
        "With any --compare*: run each side this many times, in the order A B, then "
        "B A, ...; the table shows the means.", **fv,
    )
    flags.DEFINE_string("json_out", None, "Write the result as JSON to this file.", **fv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Runs the benchmark for `argv` (the arguments after the program name; None:
    sys.argv[1:]); returns the exit status. Wrong flags exit 2 (SystemExit)."""
    try:
        return _main(argv)
    except ConfigError as e:
        # A wrong name or config: the message says what to change; a traceback adds nothing.
        print(f"{PROGRAM}: {e}", file=sys.stderr)
        return 1


class _Plan(NamedTuple):
    """What the flags ask for, once checked: the config names, and the sides of a
    comparison of data directories or of override sets (empty where not comparing them)."""

    config_names: list[str]
    data_sides: list[str]
    override_sides: dict[str, list[str]]


def _check_flags(args: flags.FlagValues) -> _Plan:
    """The plan the flags make; a usage error (exit 2) for flags that do not make one."""
    comparing = [name for name in COMPARE_FLAGS if args[name].value is not None]
    if len(comparing) > 1:
        usage_error(
            PROGRAM,
            "give at most one of --compare, --compare_dirs, --compare_xla_flags, "
            "--compare_configs, --compare_overrides and --compare_data_dirs",
        )
    if (args.config is None) == (args.compare_configs is None):
        usage_error(PROGRAM, "give --config, or --compare_configs in its place")
    if args.input_only and (args.profile_dir or args.xla_dump_dir or args.compare_xla_flags):
        usage_error(
            PROGRAM,
            "--input_only runs no device step: no --profile_dir, --xla_dump_dir or "
            "--compare_xla_flags",
        )
    if comparing and (args.profile_dir or args.xla_dump_dir):
        usage_error(
            PROGRAM,
            "--profile_dir and --xla_dump_dir trace or dump one run: give them without "
            "a --compare* flag (run each side alone)",
        )
    config_names = args.compare_configs.split(",") if args.compare_configs else [args.config]
    if args.compare_configs is not None and (
        len(config_names) != 2 or len(set(config_names)) != 2 or not all(config_names)
    ):
        usage_error(
            PROGRAM,
            f"--compare_configs takes two different config names, got {args.compare_configs!r}",
        )
    for flag, sides in (
        ("--compare_xla_flags", args.compare_xla_flags),
        ("--compare_overrides", args.compare_overrides),
    ):
        if sides is not None and (len(sides) != 2 or len(set(sides)) != 2):
            usage_error(
                PROGRAM, f"{flag} must be given twice, with two different settings; got {sides}"
            )
    data_sides = args.compare_data_dirs.split(",") if args.compare_data_dirs else []
    if args.compare_data_dirs is not None and (
        len(data_sides) != 2 or len(set(data_sides)) != 2 or not all(data_sides)
    ):
        usage_error(
            PROGRAM,
            "--compare_data_dirs takes two different data directories, got "
            f"{args.compare_data_dirs!r}",
        )
    override_sides = {}
    for text in args.compare_overrides or []:
        try:
            overrides = shlex.split(text)
        except ValueError as e:
            usage_error(PROGRAM, f"--compare_overrides={text!r}: {e}")
        if any("=" not in o for o in overrides):
            usage_error(PROGRAM, f"--compare_overrides={text!r}: each override is PATH=VALUE")
        override_sides[text or "as configured"] = overrides
    return _Plan(config_names, data_sides, override_sides)


def _absolute_data_dir(data_dir: str) -> str:
    """The runs of a comparison start in their source tree: a local data directory given
    relative to here is passed on as an absolute path."""
    return os.path.abspath(data_dir) if os.path.isdir(data_dir) else data_dir


def _shared_run_args(args: flags.FlagValues) -> list[str]:
    """Every side's flags but the config and the data, which the sides of
    --compare_configs and --compare_data_dirs name for themselves."""
    run_args = [f"--steps={args.steps}", f"--warmup_steps={args.warmup_steps}"]
    run_args += ["--input_only"] if args.input_only else []
    run_args += [f"--module={args.module}"] if args.module else []
    run_args += [f"--mesh_selector={args.mesh_selector}"] if args.mesh_selector else []
    run_args += [f"--config_override={o}" for o in args.config_override]
    run_args += [f"--xla_flags_preset={args.xla_flags_preset}"]
    return run_args


def _build_this_tree_s_sides(args: flags.FlagValues, plan: _Plan, data_dir: str) -> None:
    """Builds the config of each side of this tree before any runs (building touches no
    device), so a bad name or override fails now, not after the other side's minutes on
    the card. One run builds its config at once; other trees' configs are theirs to build."""
    if args.compare_configs:
        sides_to_build = {name: (name, []) for name in plan.config_names}
    elif plan.override_sides:
        sides_to_build = {name: (args.config, o) for name, o in plan.override_sides.items()}
    elif args.compare_xla_flags:  # Both sides run the same config.
        sides_to_build = {args.config: (args.config, [])}
    elif plan.data_sides:
        sides_to_build = {d: (args.config, []) for d in plan.data_sides}
    else:
        sides_to_build = {}
    for side, (config, side_overrides) in sides_to_build.items():
        try:
            build_benchmark_config(
                config, module=args.module, mesh_selector=args.mesh_selector,
                data_dir=side if plan.data_sides else data_dir,
                overrides=[*args.config_override, *side_overrides],
            )
        except ValueError as e:  # ConfigError and the overrides' parse errors.
            usage_error(PROGRAM, f"side {side!r}: {e}")


def _comparison_sides(
    args: flags.FlagValues, plan: _Plan, data_dir: str, *, repo: str, tmp: Optional[str]
) -> dict[str, _Side]:
    """The named sides of the comparison the flags ask for ({} for a single run); the
    sides of --compare run from exports of their revisions under `tmp`."""
    run_args = _shared_run_args(args)

    def with_config(name: str, data: str = data_dir) -> list[str]:
        return [f"--config={name}", f"--data_dir={data}", *run_args]

    if args.compare_configs:
        return {name: _Side(repo, with_config(name)) for name in plan.config_names}
    if plan.override_sides:
        return {
            name: _Side(
                repo, with_config(args.config) + [f"--config_override={o}" for o in overrides]
            )
            for name, overrides in plan.override_sides.items()
        }
    if args.compare_xla_flags:
        return {
            xla_flags or "default": _Side(repo, with_config(args.config), xla_flags)
            for xla_flags in args.compare_xla_flags
        }
    if plan.data_sides:
        return {d: _Side(repo, with_config(args.config, d)) for d in plan.data_sides}
    if args.compare_dirs:
        return {
            os.path.basename(d.rstrip("/")) or d: _Side(d, with_config(args.config))
            for d in args.compare_dirs.split(",")
        }
    if args.compare:
        return {
            rev: _Side(os.path.join(tmp, rev.replace("/", "_")), with_config(args.config))
            for rev in args.compare.split(",")
        }
    return {}


def _run_in_this_process(args: flags.FlagValues) -> dict[str, dict[str, Any]]:
    """The single run the flags ask for (no comparison), keyed by its config."""
    if args.input_only:
        result = run_input_benchmark(
            config=args.config, module=args.module, data_dir=args.data_dir,
            overrides=args.config_override, steps=args.steps, warmup_steps=args.warmup_steps,
        )
    else:
        result = run_benchmark(
            config=args.config, module=args.module, mesh_selector=args.mesh_selector,
            data_dir=args.data_dir, overrides=args.config_override, steps=args.steps,
            warmup_steps=args.warmup_steps, profile_dir=args.profile_dir,
            xla_dump_dir=args.xla_dump_dir, xla_flags_preset=args.xla_flags_preset,
        )
    return {args.config: result}


def _report(args: flags.FlagValues, plan: _Plan, results: dict[str, dict[str, Any]]) -> None:
    """Writes --json_out (one run's result alone; a comparison's keyed by side), prints the
    table, and writes --html."""
    write_json(args.json_out, next(iter(results.values())) if len(results) == 1 else results)
    print(format_table(results))
    if args.html:
        title = f"axlearn benchmark: {' vs '.join(plan.config_names)}"
        if not args.compare_configs and len(results) == 2:
            title += f": {' vs '.join(results)}"
        write_html(results, args.html, title)
        print(f"Wrote {args.html}")


def _main(argv: Optional[Sequence[str]]) -> int:
    args, _ = parse_command_flags(define_flags, argv, program=PROGRAM, doc=__doc__)
    plan = _check_flags(args)
    data_dir = _absolute_data_dir(args.data_dir)
    plan = plan._replace(data_sides=[_absolute_data_dir(d) for d in plan.data_sides])
    _build_this_tree_s_sides(args, plan, data_dir)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    tmp = tempfile.mkdtemp(prefix="axlearn-bench-") if args.compare else None
    sides = _comparison_sides(args, plan, data_dir, repo=repo, tmp=tmp)
    try:
        if args.compare:
            for rev, side in sides.items():
                _export_revision(rev, repo, side.tree)
        if sides:  # Every comparison is named sides, run in rounds.
            results = run_in_rounds(
                sides,
                lambda side: _run_in_tree(side.tree, side.argv, xla_flags=side.xla_flags),
                rounds=args.rounds,
            )
        else:
            results = _run_in_this_process(args)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    _report(args, plan, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
