"""The trainer's console beyond the step time: the loss as the mean of the window since the
last line (perf.WindowMean, perf.progress_line) and the notice of the first step's
compilation (perf.compile_notice)."""

import numpy as np

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
