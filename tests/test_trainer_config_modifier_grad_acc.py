"""GradientAccumulationModifier: AXLearn's gradient accumulation as the trainer's
grad_acc_steps (the microbatch arithmetic itself is tested with the learner)."""

import pytest

from axlearn.common.config import ConfigError, config_for_function
from axlearn.common.trainer_config_modifier import GradientAccumulationModifier
from tests.trainer_script import tiny_trainer_config


def _modifier(steps: int):
    return GradientAccumulationModifier.default_config().set(grad_acc_steps=steps)


def test_modifier_makes_each_step_run_that_many_microbatches():
    cfg = _modifier(4).instantiate()(tiny_trainer_config(trainer_dir=None, max_step=1))
    assert cfg.grad_acc_steps == 4
    trainer = cfg.instantiate(parent=None)
    assert trainer.num_microbatches(cfg.input.global_batch_size) == 4


def test_modifier_refuses_an_accumulator_other_than_metric_accumulator():
    modifier = _modifier(2).set(metric_accumulator=config_for_function(sum).set(iterable=()))
    with pytest.raises(ConfigError, match="only MetricAccumulator"):
        modifier.instantiate()(tiny_trainer_config(trainer_dir=None, max_step=1))


def test_trainer_refuses_grad_acc_steps_with_a_microbatch_size():
    cfg = tiny_trainer_config(trainer_dir=None, max_step=1)
    cfg.set(grad_acc_steps=2, per_device_microbatch_size=4)
    with pytest.raises(ConfigError, match="grad_acc_steps must be None or an int >= 1, and not"):
        cfg.instantiate(parent=None)
