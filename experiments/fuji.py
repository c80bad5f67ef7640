"""Fuji trainer configs under AXLearn's names (fuji-test-v3, fuji-7B-v2-flash, ...).

The family is built in `axlearn.experiments.text.gpt.fuji` from its size and version
tables; each config's golden file equals AXLearn's own but for the defaults that
tests/test_experiments_fuji.py lists.
"""

from axlearn.experiments.text.gpt import fuji
from axlearn.experiments.text.gpt.fuji import named_trainer_configs

__all__ = ["DESCRIPTIONS", "named_trainer_configs"]

# One line each for `--list_configs`.
DESCRIPTIONS = fuji.descriptions()
