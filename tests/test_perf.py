"""The trainer's console beyond the step time: the loss as the mean of the window since the
last line (perf.WindowMean, perf.progress_line) and the notice of the first step's
compilation (perf.compile_notice); the account of a start (perf.StartTimes,
perf.process_start_time)."""

import numpy as np
import pytest

from axlearn.common import perf


def test_the_window_mean_is_the_mean_of_the_values_since_it_was_last_taken():
    values = np.random.default_rng(0).normal(3.0, 1.0, size=25)
    window = perf.WindowMean()
    for value in values:
        window.add(float(value))
    mean, count = window.take()
    np.testing.assert_allclose(mean, np.mean(values), rtol=1e-12)
    assert count == 25
    assert window.take() is None  # Taken: the next window starts empty.
    window.add(1.5)
    assert window.take() == (1.5, 1)


def test_the_progress_line_shows_the_windows_mean_loss_and_its_length():
    summaries = {"loss": 9.0}
    assert "| loss 2.5000 (mean of 25) |" in perf.progress_line(
        50, 100, summaries, mean_loss=(2.5, 25)
    )
    # A window of one step is that step's loss; without a window, the step's own.
    assert "| loss 2.5000 |" in perf.progress_line(50, 100, summaries, mean_loss=(2.5, 1))
    assert "| loss 9.0000 |" in perf.progress_line(50, 100, summaries)


def test_the_compile_notice_says_compiling_before_and_the_compile_time_after():
    messages, clock = [], iter([10.0, 14.5])
    with perf.compile_notice("the train step", messages.append, compile_clock=lambda: next(clock)):
        messages.append("dispatched")
    assert messages == [
        "Compiling the train step...", "dispatched", "Compiled the train step in 4.5s"
    ]


# ----- start-up -----


def test_the_start_line_lists_each_phase_from_where_the_last_ended():
    readings = iter([103.5, 104.0, 110.25])
    times = perf.StartTimes(since=100.0, clock=lambda: next(readings))
    times.phase("process to trainer")  # 103.5
    times.phase("state (restore)")  # 104.0
    times.phase("train step ready", "compiled at the first step", seconds=4.0)  # 108.0
    times.phase("first step")  # 110.25
    assert times.line() == (
        "Started in 10.2 s: process to trainer 3.5 s, state (restore) 0.5 s, train step "
        "ready 4.0 s (compiled at the first step), first step 2.2 s"
    )


def test_the_process_start_is_the_one_the_system_reports():
    psutil = pytest.importorskip("psutil")
    start = perf.process_start_time()
    assert start is not None
    # psutil adds the boot time in whole seconds; ours is to 10 ms.
    assert abs(start - psutil.Process().create_time()) < 1.0
