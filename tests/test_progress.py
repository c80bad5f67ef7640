"""What a person watching a run sees: the step time of the progress line (perf.StepTimer),
the time left (perf.format_duration, perf.progress_line), and the progress bars of the long
waits (axlearn.common.progress: restoring a checkpoint, an evaluation pass).

Times come from fake clocks; no test asserts on wall-clock time.
"""

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from axlearn.common import perf, progress
from axlearn.common.checkpointer import Checkpointer, step_dir_name
from axlearn.common.evaler import SpmdEvaler
from tests.test_evaler import BigramModel, FakeInput, make_batches, make_params
from tests.trainer_script import tiny_model_config, tiny_trainer_config


class FakeClock:
    """Seconds that pass only when a test says so."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class FakeRun:
    """A training loop on fake clocks: each step's dispatch costs the host `dispatch_s`, the
    loop then waits `run_s` for it; a compile adds its seconds to both clocks."""

    def __init__(self, *, dispatch_s=0.25, run_s=0.75, first_run_s=5.0):
        self.clock, self.compiling = FakeClock(), FakeClock()
        self.first_run_s = first_run_s
        self.waits = 0
        self.timer = perf.StepTimer(wait=self._wait, clock=self.clock, compile_clock=self.compiling)
        self.dispatch_s, self.run_s = dispatch_s, run_s
        self._pending_first_run = False

    def _wait(self) -> None:
        self.waits += 1
        if self._pending_first_run:  # The new program's first run: one-time costs.
            self.clock.advance(self.first_run_s)
            self._pending_first_run = False

    def compile(self, seconds: float) -> None:
        self.clock.advance(seconds)
        self.compiling.advance(seconds)

    def step(self, *, compile_s: float = 0.0, new_program: bool = False) -> None:
        """`new_program`: the first run of a program compiled before (ahead of the step)."""
        with self.timer.step(new_program=new_program):
            if compile_s:
                self.compile(compile_s)
            if compile_s or new_program:
                self._pending_first_run = True  # Run when the timer waits.
            self.clock.advance(self.dispatch_s)
        if not (compile_s or new_program):
            self.clock.advance(self.run_s)  # The loop waits for the step's loss.


# ----- the step time -----


def test_the_first_window_leaves_out_the_step_that_compiles():
    run = FakeRun()
    run.clock.advance(7.0)  # Start-up before the first step (the first batch) is not counted.
    run.step(compile_s=60.0)
    for _ in range(4):
        run.step()
    assert run.timer.steps == 4
    assert run.timer.mean_step_s() == 1.0  # dispatch 0.25 + run 0.75; no compile, no first run.
    assert run.waits == 1  # Once, after the compiling step.


def test_the_first_window_leaves_out_the_first_run_of_a_step_compiled_ahead():
    run = FakeRun()
    run.compile(60.0)  # Ahead of the loop, in another thread: not this thread's clock...
    run.compiling.now = 0.0  # ...(compile clocks are per thread).
    run.step(new_program=True)
    for _ in range(4):
        run.step()
    assert run.timer.steps == 4
    assert run.timer.mean_step_s() == 1.0  # The program's first run is left out.
    assert run.waits == 1


def test_a_step_that_recompiles_mid_window_is_left_out():
    run = FakeRun()
    run.step(compile_s=60.0)
    run.timer.restart()
    run.step()
    run.step(compile_s=30.0)  # e.g. a batch of another shape.
    run.step()
    assert run.timer.steps == 2
    assert run.timer.mean_step_s() == 1.0


def test_compilation_between_steps_is_left_out():
    run = FakeRun()
    run.step()
    run.compile(12.0)  # A function first called where the loop reports.
    run.step()
    assert run.timer.mean_step_s() == 1.0


def test_a_pause_waits_for_the_steps_and_leaves_out_what_follows():
    run = FakeRun()
    run.step()
    run.timer.pause()
    assert run.waits == 1
    run.clock.advance(40.0)  # Evaluation and saving.
    run.step()
    run.step()
    assert run.timer.steps == 3
    assert run.timer.mean_step_s() == 1.0


def test_restart_begins_a_new_window():
    run = FakeRun(run_s=0.75)
    run.step()
    run.timer.restart()
    run.dispatch_s, run.run_s = 0.5, 1.5
    run.step()
    run.step()
    assert run.timer.steps == 2
    assert run.timer.mean_step_s() == 2.0


def test_a_window_without_a_counted_step_has_no_step_time():
    run = FakeRun()
    assert run.timer.mean_step_s() is None
    run.step(compile_s=60.0)
    assert run.timer.mean_step_s() is None


def test_compile_seconds_count_this_thread_s_compilation_only():
    before = perf.compile_seconds()
    jax.jit(lambda x: x * 3.0 + 1.0)(jnp.ones(7))  # A new function: traced and compiled.
    after = perf.compile_seconds()
    assert after > before
    thread = threading.Thread(target=lambda: jax.jit(lambda x: x - 5.0)(jnp.ones(3)))
    thread.start()
    thread.join()
    assert perf.compile_seconds() == after


@pytest.mark.slow
def test_the_trainer_reports_windows_without_the_compiling_step(monkeypatch):
    windows = []

    class RecordingTimer(perf.StepTimer):
        def mean_step_s(self):
            windows.append(self.steps)
            return super().mean_step_s()

    monkeypatch.setattr(perf, "StepTimer", RecordingTimer)
    one_layer = tiny_model_config(num_layers=1, dim=16, num_heads=2, num_kv_heads=1, hidden_dim=16)
    cfg = tiny_trainer_config(trainer_dir=None, max_step=4, model=one_layer)
    cfg.log_every_n_steps = 2
    result = cfg.instantiate(parent=None).run()
    # Step 1 compiled: the report at step 2 counts step 2 alone, the one at step 4 two steps.
    assert windows == [1, 2]
    assert result["perf/step_time_s"] > 0


# ----- the time left -----


@pytest.mark.parametrize(
    "seconds, text",
    [
        (0.0, "0s"),
        (-3.0, "0s"),
        (42.4, "42s"),
        (59.6, "1m00s"),
        (307.0, "5m07s"),
        (3599.4, "59m59s"),
        (3720.0, "1h02m"),
        (3750.0, "1h03m"),  # 62.5 minutes round up.
        (86_369.0, "23h59m"),
        (3 * 86_400 + 4 * 3600 + 20 * 60, "3d04h"),
    ],
)
def test_durations_show_their_two_largest_units(seconds, text):
    assert perf.format_duration(seconds) == text


def test_the_time_left_is_the_steps_left_at_the_step_time():
    assert perf.eta_seconds(7, 100, 0.25) == 93 * 0.25
    assert perf.eta_seconds(100, 100, 0.25) == 0.0
    assert perf.eta_seconds(7, 100, None) is None


def test_the_progress_line_shows_the_time_left_beside_the_step_time():
    summaries = {"loss": 2.5, "perf/step_time_s": 0.5}
    # 249,000 steps of 0.5 s: 34.6 hours.
    assert "| 0.500 s/step | eta 1d11h |" in perf.progress_line(1_000, 250_000, summaries)
    assert "| - s/step | eta - |" in perf.progress_line(3, 10, {"loss": 2.5})


# ----- progress bars -----


class RecordingBar:
    """Stands for tqdm: records its arguments and updates."""

    made: list["RecordingBar"] = []

    def __init__(self, **kwargs):
        self.kwargs = kwargs
        self.n = 0
        self.updates = 0
        self.closed = False
        RecordingBar.made.append(self)

    def update(self, n: int = 1) -> None:
        self.n += n
        self.updates += 1

    def __enter__(self) -> "RecordingBar":
        return self

    def __exit__(self, *exc_info) -> None:
        self.closed = True


@pytest.fixture(name="bars")
def fixture_bars(monkeypatch) -> list[RecordingBar]:
    monkeypatch.setattr(RecordingBar, "made", [])
    monkeypatch.setattr(progress, "tqdm", RecordingBar)
    return RecordingBar.made


def test_restoring_shows_a_bar_over_the_arrays_read(tmp_path, bars):
    state = {"w": jnp.arange(12.0).reshape(3, 4), "b": jnp.ones(5), "count": jnp.int32(3)}
    checkpointer = Checkpointer.default_config().set(name="ckpt", dir=str(tmp_path)).instantiate(
        parent=None
    )
    checkpointer.save(4, state)
    checkpointer.wait_until_finished()
    bars.clear()
    template = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state
    )
    step, restored, _ = checkpointer.restore(state=template)
    checkpointer.stop()
    assert step == 4
    np.testing.assert_array_equal(restored["w"], state["w"])
    # Each file is checked as it is read, so one bar counts the leaves.
    (reading,) = bars
    assert reading.kwargs["desc"] == f"Reading {step_dir_name(4)}"
    assert (reading.kwargs["total"], reading.n) == (3, 3)
    assert reading.closed


class CountedFakeInput(FakeInput):
    """FakeInput that knows the length of a pass, as TokenShardInput does."""

    @property
    def num_eval_batches(self) -> int:
        return self.config.num_batches


@pytest.mark.parametrize("input_cls, total", [(CountedFakeInput, 4), (FakeInput, None)])
def test_evaluation_shows_a_bar_over_the_batches_of_the_pass(bars, input_cls, total):
    model = BigramModel.default_config().set(name="model").instantiate(parent=None)
    cfg = SpmdEvaler.default_config().set(
        name="eval_set",
        input=input_cls.default_config(),
        eval_dtype=jnp.float32,
        per_device_microbatch_size=2,  # Each batch of 8 rows in 4 pieces.
    )
    specs = model.create_parameter_specs_recursively()
    evaler = cfg.instantiate(parent=None, model=model, model_param_partition_specs=specs)
    params = jax.tree.map(jnp.asarray, make_params())
    assert evaler.eval_step(5, prng_key=jax.random.PRNGKey(0), model_params=params)
    (bar,) = bars
    assert bar.kwargs["desc"] == "Evaluating eval_set"
    # One update a batch of the input, however many microbatches it runs in.
    assert (bar.kwargs["total"], bar.updates) == (total, len(make_batches()))
    assert bar.closed


@pytest.mark.parametrize(
    "setting, disable", [(None, None), ("1", False), ("0", True)],
    ids=["unset: on a TTY only", "forced on", "off"],
)
def test_the_environment_decides_where_bars_are_drawn(bars, monkeypatch, setting, disable):
    if setting is None:
        monkeypatch.delenv(progress.PROGRESS_BARS_ENV, raising=False)
    else:
        monkeypatch.setenv(progress.PROGRESS_BARS_ENV, setting)
    progress.progress_bar(total=3, desc="x", unit="item")
    assert bars[0].kwargs["disable"] is disable


def test_only_process_0_draws_bars(bars, monkeypatch):
    monkeypatch.setenv(progress.PROGRESS_BARS_ENV, "1")
    monkeypatch.setattr(jax, "process_index", lambda: 1)
    progress.progress_bar(total=3, desc="x", unit="item")
    assert bars[0].kwargs["disable"] is True


def test_an_unknown_setting_of_the_environment_is_an_error(monkeypatch):
    monkeypatch.setenv(progress.PROGRESS_BARS_ENV, "yes")
    with pytest.raises(ValueError, match="AXLEARN_PROGRESS_BARS='yes': expected 0, 1 or unset"):
        progress.progress_bar(total=3, desc="x", unit="item")


def test_a_forced_bar_is_drawn_on_stderr(monkeypatch, capsys):
    monkeypatch.setenv(progress.PROGRESS_BARS_ENV, "1")
    with progress.progress_bar(total=3, desc="Reading step_00000004", unit="array") as bar:
        for _ in range(3):
            bar.update()
    captured = capsys.readouterr()
    assert captured.out == ""
    # tqdm redraws at most every 0.1 s and erases the bar when it closes (leave=False).
    assert "Reading step_00000004:   0%" in captured.err and "0/3" in captured.err
