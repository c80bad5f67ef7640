"""benchmarks/optimizer_state_check.py: gpt_test trained twice on the CPU, and its window means."""

import json
import subprocess
import sys

from benchmarks import optimizer_state_check
from tests.fresh_python import REPO, fresh_env


def test_window_means_group_steps_by_the_window_they_end():
    losses = {1: 4.0, 2: 2.0, 3: 3.0, 4: 5.0, 6: 1.0}
    assert optimizer_state_check._window_means(losses, 2) == {2: 3.0, 4: 4.0, 6: 1.0}


def _run(tmp_path, *flags):
    out = tmp_path / "losses.json"
    subprocess.run(
        [
            sys.executable, "benchmarks/optimizer_state_check.py", "--config=gpt_test",
            f"--trainer_dir={tmp_path / 'runs'}", f"--json_out={out}",
            "--config_override=max_step=6", "--config_override=summary_writer.write_every_n_steps=1",
            "--config_override=evalers['validation'].eval_policy.n=3",
            "--config_override=evalers['validation'].eval_policy.max_step=6",
            *flags,
        ],
        cwd=REPO, env=fresh_env(), check=True, capture_output=True, text=True, timeout=600,
    )
    return json.loads(out.read_text())


def test_a_float32_cast_changes_nothing_and_bfloat16_changes_the_losses(tmp_path):
    # On the CPU the sums are deterministic: the float32 control must equal the run as
    # configured to the bit, at every training step and every evaluation, which fails if
    # the cast wrapper itself changed the update.
    control = _run(tmp_path / "f32", "--state_dtype=float32", "--window=2")
    assert set(control) == {"as_configured", "float32_state"}
    for source in ("train", "validation"):
        assert control["as_configured"][source] == control["float32_state"][source]
    assert sorted(control["as_configured"]["train"], key=int) == [str(s) for s in range(1, 7)]
    assert sorted(control["as_configured"]["validation"], key=int) == ["3", "6"]
    # The bfloat16 run trains first here (--cast_first) and is reported second all the same.
    rounded = _run(tmp_path / "bf16", "--cast_first")
    assert list(rounded) == ["as_configured", "bfloat16_state"]
    assert rounded["as_configured"]["train"] == control["as_configured"]["train"]
    assert rounded["as_configured"]["train"] != rounded["bfloat16_state"]["train"]
