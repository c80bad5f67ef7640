"""tools/step_breakdown.py: gpt_test's step split into its parts, on the CPU."""

import re
import subprocess
import sys

import pytest

from tests.fresh_python import REPO, fresh_env


@pytest.mark.slow
def test_prints_the_time_of_each_part_and_of_the_whole_step():
    proc = subprocess.run(
        # A smaller batch than gpt_test's: each part runs 11 times.
        [
            sys.executable, "tools/step_breakdown.py", "--config=gpt_test",
            "--config_override=input.global_batch_size=4",
            "--config_override=input.max_sequence_length=64",
        ],
        cwd=REPO, env=fresh_env(), capture_output=True, text=True, timeout=600, check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    parts = dict(re.findall(r"^(\S.*?)\s+([\d.]+) ms$", proc.stdout, re.MULTILINE))
    assert list(parts) == [
        "forward (loss)",
        "forward + backward",
        "optimizer update (learner.update)",
        "full train step",
    ]
