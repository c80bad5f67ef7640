"""Performance accounting shared by the trainer log and the benchmark report.

The model counts its own training FLOPs per token (`CountsModelFlops`; for the causal LM
the DESIGN.md formula, `causal_lm.Model.model_flops_per_token`). Here:
TFLOP/s/device = FLOPs per step / step time / devices; MFU = that / peak. A model that
does not count its FLOPs gets step time, tokens/s and memory, but no TFLOP/s or MFU.

The step time is `StepTimer`'s: the mean over the steps since the last report, without the
time the host spent compiling or the loop spent evaluating and saving. The console line
(`progress_line`) adds the time left at that rate and shows the loss as the mean over the
same window (`WindowMean`); `compile_notice` says when the first step compiles.

A start is accounted for once, at its first trained step (`StartTimes`): the phases the
trainer waited through from the process's start (`process_start_time`), in one log line.
"""

import contextlib
import dataclasses
import math
import os
import threading
import time
from collections.abc import Callable, Iterator
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


@runtime_checkable
class HoldsFrozenReference(Protocol):
    """A model that holds, beside the model it trains, a frozen copy of it that only
    scores (`dpo.DPOModel`'s reference='frozen_copy'): the copy's parameters are not the
    model's own count."""

    def reference_specs(self) -> Optional[Any]:
        """The frozen copy's parameter specs; None where the model holds none."""


def reference_param_count(model: Any) -> int:
    """The parameters of `model`'s frozen reference copy (`HoldsFrozenReference`), else 0."""
    if isinstance(model, HoldsFrozenReference):
        specs = model.reference_specs()
        return 0 if specs is None else tree_size(specs)
    return 0


def tree_size(tree: Any) -> int:
    """The number of elements of a tree of arrays or of ParameterSpecs (anything with a
    `shape`): a model's parameter count from its specs, nothing allocated."""
    leaves = jax.tree.leaves(tree, is_leaf=lambda x: hasattr(x, "shape"))
    return sum(math.prod(leaf.shape) for leaf in leaves)


def input_rows_shape(element_spec: dict[str, Any]) -> tuple[int, int]:
    """(rows, tokens a row) of a batch: of its 'input_ids', or, for preference pairs
    ('chosen_input_ids' and 'rejected_input_ids', one row each side), both sides' rows."""
    if "input_ids" in element_spec:
        return tuple(element_spec["input_ids"].shape)
    sides = [spec.shape for key, spec in sorted(element_spec.items()) if key.endswith("_input_ids")]
    if not sides:
        raise KeyError(f"The batch has no input_ids; it has {sorted(element_spec)}")
    return sum(shape[0] for shape in sides), sides[0][1]


@dataclasses.dataclass
class StepAccounting:
    """Turns a step time into the standard columns."""

    num_params: int  # The trained model's (DPO: the policy's), a frozen reference apart.
    tokens_per_step: int
    flops_per_step: Optional[float]  # None: the model does not count its FLOPs.
    num_devices: int
    peak_tflops_per_device: Optional[float]
    reference_params: int = 0  # Of a frozen reference copy (`HoldsFrozenReference`).

    @classmethod
    def for_trainer(cls, trainer) -> "StepAccounting":
        """The accounting of `trainer`'s steps: its input's [batch, seq_len] tokens, its
        model's parameters and FLOPs per token (less 2 a token for each matmul parameter the
        learner freezes: a frozen DPO reference's forward counts 2 a token), its mesh's
        devices. `num_params` leaves out a frozen reference copy: `reference_params`."""
        batch, seq_len = input_rows_shape(trainer.input.element_spec())
        flops_per_token = model_flops_per_token(trainer.model, seq_len)
        frozen = getattr(trainer, "frozen_matmul_parameter_count", None)
        if flops_per_token is not None and frozen is not None:
            # A frozen weight's product has no weight gradient: 4 FLOPs a token, not 6.
            flops_per_token -= 2.0 * frozen()
        tokens = batch * seq_len
        peak = trainer.config.peak_tflops_per_device or peak_tflops(trainer.mesh.devices.flat[0])
        reference = reference_param_count(trainer.model)
        return cls(
            num_params=tree_size(trainer.model_param_specs) - reference,
            tokens_per_step=tokens,
            flops_per_step=None if flops_per_token is None else flops_per_token * tokens,
            num_devices=trainer.mesh.devices.size,
            peak_tflops_per_device=peak,
            reference_params=reference,
        )

    def params_text(self) -> str:
        """'N parameters', and where a frozen reference copy exists, its count beside:
        '1,073,741,824 parameters (+1,073,741,824 in the frozen DPO reference)'."""
        text = f"{self.num_params:,} parameters"
        if self.reference_params:
            text += f" (+{self.reference_params:,} in the frozen DPO reference)"
        return text

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


# ----- step time -----

# jax.monitoring's duration events that make up compilation: tracing to a jaxpr, lowering
# to MLIR, and XLA's compile (or its load from the persistent compilation cache).
COMPILE_EVENTS = frozenset(
    (
        "/jax/core/compile/jaxpr_trace_duration",
        "/jax/core/compile/jaxpr_to_mlir_module_duration",
        "/jax/core/compile/backend_compile_duration",
    )
)
_compile_seconds_by_thread: dict[int, float] = {}
_compile_listener_lock = threading.Lock()
_compile_listener_registered = False


def _record_compile_time(event: str, duration_secs: float, **kwargs) -> None:
    del kwargs
    if event in COMPILE_EVENTS:
        # jax reports an event in the thread that compiled; each thread keeps its own sum.
        thread = threading.get_ident()
        total = _compile_seconds_by_thread.get(thread, 0.0)
        _compile_seconds_by_thread[thread] = total + duration_secs


def compile_seconds() -> float:
    """Seconds the calling thread has spent compiling jax functions (`COMPILE_EVENTS`)
    since the first call of this function in the process."""
    global _compile_listener_registered  # pylint: disable=global-statement
    with _compile_listener_lock:
        if not _compile_listener_registered:
            jax.monitoring.register_event_duration_secs_listener(_record_compile_time)
            _compile_listener_registered = True
    return _compile_seconds_by_thread.get(threading.get_ident(), 0.0)


class StepTimer:
    """The mean time of the steps of a window (from one report to the next), leaving out
    compilation and the time the window is paused (evaluation, saving).

    Steps are dispatched asynchronously, so a window must end where the host has waited for
    its last step (the loop reads the step's loss). A step whose dispatch compiles (the
    first one, or one after a recompilation) is left out whole: its compilation, and its
    run, which is the first of the new program and pays one-time costs (loading kernels,
    allocating buffers); so is the first run of a program compiled ahead of it
    (`step(new_program=True)`). The timer then calls `wait` (which returns once the dispatched
    steps have run) and the window goes on from there. Compilation outside the steps (a
    function first called at a report) is left out too. The timer starts paused; the first
    step starts it, so that start-up (reading the first batch) is not step time.
    `clock` and `compile_clock` (seconds; see `compile_seconds`) are injectable for tests.
    """

    def __init__(
        self,
        *,
        wait: Callable[[], Any],
        clock: Callable[[], float] = time.perf_counter,
        compile_clock: Callable[[], float] = compile_seconds,
    ):
        self._wait = wait
        self._clock = clock
        self._compile_clock = compile_clock
        self._steps = 0
        self._counted_s = 0.0  # Time of the window before its running segment.
        # (clock, compile_clock) where the running segment began; None: paused.
        self._since: Optional[tuple[float, float]] = None

    def _now(self) -> tuple[float, float]:
        return self._clock(), self._compile_clock()

    def _running_s(self) -> float:
        """Time since the running segment began, less what was spent compiling."""
        if self._since is None:
            return 0.0
        now, compiling = self._now()
        return (now - self._since[0]) - (compiling - self._since[1])

    @contextlib.contextmanager
    def step(self, *, new_program: bool = False) -> Iterator[None]:
        """Wraps the dispatch of one step; the window runs from here if it was paused.
        `new_program`: the step is the first run of a program compiled beforehand (left
        out like one that compiles)."""
        if self._since is None:
            self._since = self._now()
        before = self._running_s()
        compiled_before = self._compile_clock()
        yield
        if new_program or self._compile_clock() > compiled_before:
            # The window stops before this step and goes on once it has run.
            self._counted_s += before
            self._wait()
            self._since = self._now()
        else:
            self._steps += 1

    def pause(self) -> None:
        """Stops counting time until the next step, once the dispatched steps have run."""
        if self._since is not None:
            self._wait()
            self._counted_s += self._running_s()
            self._since = None

    def restart(self) -> None:
        """Begins a new window, running or paused as the timer is."""
        if self._since is not None:
            self._since = self._now()
        self._steps = 0
        self._counted_s = 0.0

    @property
    def steps(self) -> int:
        """The steps the window counts so far."""
        return self._steps

    def mean_step_s(self) -> Optional[float]:
        """The window's mean step time; None for a window without steps or time."""
        total = self._counted_s + self._running_s()
        if self._steps == 0 or total <= 0:
            return None
        return total / self._steps


@contextlib.contextmanager
def compile_notice(
    what: str,
    log: Callable[[str], None],
    *,
    compile_clock: Callable[[], float] = compile_seconds,
    note: Optional[Callable[[], str]] = None,
) -> Iterator[None]:
    """Says that `what` compiles before it runs (a first call's dispatch can take minutes,
    in which nothing else is printed), and once dispatched, how long compiling took
    (`compile_clock`: see `compile_seconds`), with `note()` in parentheses where given
    (e.g. whether the program came from the compilation cache)."""
    log(f"Compiling {what}...")
    before = compile_clock()
    yield
    seconds = compile_clock() - before
    took = f"{seconds:.1f}s" if seconds < 60 else format_duration(seconds)
    log(f"Compiled {what} in {took}" + (f" ({note()})" if note is not None else ""))


# ----- start-up -----


def process_start_time() -> Optional[float]:
    """When this process started, in `time.time()` seconds (to 10 ms, from Linux's /proc);
    None where that is not known."""
    try:
        with open("/proc/self/stat", "rb") as f:
            stat = f.read()
        with open("/proc/uptime", "rb") as f:
            uptime = float(f.read().split()[0])
        # Field 22, the start in clock ticks after boot; fields 3.. follow the name's ')'.
        ticks = int(stat[stat.rindex(b")") + 2 :].split()[19])
        return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


class StartTimes:
    """The phases of a start up to its first trained step, in the order its thread waited
    through them: each phase ends where `phase` is called (or lasts `seconds`) and the next
    begins there. Work done meanwhile in other threads shows in a phase's note.
    `line()` is the trainer's one log line of them."""

    def __init__(self, *, since: Optional[float] = None, clock: Callable[[], float] = time.time):
        """`since`: the clock's reading where the start began (None: now)."""
        self._clock = clock
        self._begin = clock() if since is None else since
        self._end = self._begin
        self._phases: list[tuple[str, float, Optional[str]]] = []

    @classmethod
    def from_process_start(cls, first_phase: str) -> "StartTimes":
        """Times from the process's start, which ends `first_phase` now; where the process's
        start is not known, from now (without that phase)."""
        since = process_start_time()
        times = cls(since=since)
        if since is not None:
            times.phase(first_phase)
        return times

    def phase(self, name: str, note: Optional[str] = None, *, seconds: Optional[float] = None):
        """Ends the phase `name`: now, or `seconds` after the last phase ended."""
        end = self._clock() if seconds is None else self._end + seconds
        self._phases.append((name, end - self._end, note))
        self._end = end

    @property
    def phases(self) -> list[tuple[str, float, Optional[str]]]:
        """[(name, seconds, note or None)] so far."""
        return list(self._phases)

    def line(self) -> str:
        """'Started in 11.2 s: process to trainer 3.1 s, state (restore) 2.0 s, ...'."""
        parts = [
            f"{name} {seconds:.1f} s" + (f" ({note})" if note else "")
            for name, seconds, note in self._phases
        ]
        return f"Started in {self._end - self._begin:.1f} s: " + ", ".join(parts)


class WindowMean:
    """The mean of the values added since it was last taken: the console's loss over the
    steps since its last line, which shows the trend one noisy step hides."""

    def __init__(self):
        self._sum = 0.0
        self._count = 0

    def add(self, value: float) -> None:
        self._sum += value
        self._count += 1

    def take(self) -> Optional[tuple[float, int]]:
        """(the mean, how many values) since the last take, or None for none; starts over."""
        if not self._count:
            return None
        result = (self._sum / self._count, self._count)
        self._sum, self._count = 0.0, 0
        return result


def eta_seconds(step: int, max_step: int, step_time_s: Optional[float]) -> Optional[float]:
    """Seconds until `max_step` at `step_time_s` a step; None where the step time is unknown."""
    if step_time_s is None:
        return None
    return max(max_step - step, 0) * step_time_s


def format_duration(seconds: float) -> str:
    """A duration in its two largest units, rounded to the smaller: '42s', '5m07s',
    '1h02m', '3d04h'."""
    s = max(math.floor(seconds + 0.5), 0)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    minutes = math.floor(s / 60 + 0.5)
    if minutes < 24 * 60:
        return f"{minutes // 60}h{minutes % 60:02d}m"
    hours = math.floor(minutes / 60 + 0.5)
    return f"{hours // 24}d{hours % 24:02d}h"


# ----- the console -----

# The evaluation metrics the trainer's console line shows (the evaler writes them all).
EVAL_HEADLINE_METRICS = ("loss", "perplexity", "bits_per_byte", "accuracy")


def format_metrics(metrics: dict[str, Any]) -> str:
    """'key=value ...' sorted by key, floats to 4 significant digits."""
    return " ".join(
        f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in sorted(metrics.items())
    )


def progress_line(
    step: int,
    max_step: int,
    summaries: dict[str, Any],
    *,
    mean_loss: Optional[tuple[float, int]] = None,
) -> str:
    """One console line a person can follow. The loss is `mean_loss` (the mean of the
    window's steps and their count; `WindowMean.take`) where given, else the step's. The
    time left ('eta') is the steps left at the reported step time: training only, as the
    step time leaves evaluation and saving out."""

    def get(name, fmt, default="-"):
        value = summaries.get(name)
        return format(value, fmt) if isinstance(value, (int, float)) else default

    step_time = summaries.get("perf/step_time_s")
    eta = eta_seconds(step, max_step, step_time if isinstance(step_time, (int, float)) else None)
    parts = [
        f"step {step:>{len(str(max_step))}}/{max_step}",
        _loss_column(summaries, mean_loss),
        f"lr {get('learner/learning_rate', '.3e')}",
        f"gnorm {get('learner/gradient_norm', '.3f')}",
        f"{get('perf/step_time_s', '.3f')} s/step",
        f"eta {'-' if eta is None else format_duration(eta)}",
        f"{get('perf/tokens_per_s_per_device', ',.0f')} tok/s/dev",
        f"{get('perf/tflops_per_device', '.3g')} TFLOP/s/dev",
    ]
    if "perf/mfu" in summaries:
        parts.append(f"MFU {summaries['perf/mfu']:.1%}")
    if "perf/peak_memory_gib" in summaries:
        parts.append(f"mem {summaries['perf/peak_memory_gib']:.1f} GiB")
    return " | ".join(parts)


def _loss_column(summaries: dict[str, Any], mean_loss: Optional[tuple[float, int]]) -> str:
    """'loss 2.3456', or over a window of several steps 'loss 2.3456 (mean of 25)'."""
    if mean_loss is not None and mean_loss[1] > 1:
        return f"loss {mean_loss[0]:.4f} (mean of {mean_loss[1]})"
    if mean_loss is not None:
        return f"loss {mean_loss[0]:.4f}"
    loss = summaries.get("loss")
    return f"loss {loss:.4f}" if isinstance(loss, (int, float)) else "loss -"
