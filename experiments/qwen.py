"""Qwen3 trainer configs under AXLearn's names (qwen3-30B-A3B-bs8m-seq8k, ...).

Built in `axlearn.experiments.text.gpt.qwen`; each config's golden file equals AXLearn's
own (tests/test_experiments_qwen.py).
"""

from axlearn.experiments.text.gpt import qwen
from axlearn.experiments.text.gpt.qwen import named_trainer_configs

__all__ = ["DESCRIPTIONS", "named_trainer_configs"]

# One line each for `--list_configs`.
DESCRIPTIONS = qwen.descriptions()
