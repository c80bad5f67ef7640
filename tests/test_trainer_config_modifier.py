"""Tests of axlearn.common.trainer_config_modifier and mesh-rule selection."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from axlearn.common.attention import (
    RepeatedTransformerLayer,
    StackedTransformerLayer,
    build_remat_spec,
)
from axlearn.common.base_layer import is_parameter_spec
from axlearn.common.config import ConfigError, config_for_function
from axlearn.common.mesh_selection import select_mesh_rule
from axlearn.common.trainer_config_modifier import (
    OptimizerStateDtypeModifier,
    ChainConfigModifier,
    GradientAccumulationModifier,
    MeshShapeModifier,
    ModuleConfigModifier,
    PartitionSpecModifier,
    RematSpecModifier,
    TrainerFieldsModifier,
    apply_mesh_rule,
)
from axlearn.common.utils import flatten_with_paths
from axlearn.experiments.text.gpt import common
from tests.trainer_script import tiny_trainer_config

LAYER_PATH = "model.decoder.transformer.layer"


def _config():
    return tiny_trainer_config(trainer_dir=None, max_step=3)


def _apply(modifier_cfg, cfg):
    return modifier_cfg.instantiate()(cfg)


def _param_specs(cfg):
    model = cfg.model.clone(name="model").instantiate(parent=None)
    return model.create_parameter_specs_recursively()


# ----- mesh rules -----


RULES = [
    ("gpu-(h100|h200)-(1|2|4|8)", common.mesh_shape_from_axes(fsdp=-1)),
    ("gpu-h100-.*", common.mesh_shape_from_axes(data=-1)),
    ("cpu", MeshShapeModifier.default_config().set(mesh_shape=(1, 1, 1, 1, 1, -1))),
]


def test_select_mesh_rule_picks_the_first_rule_whose_regex_fully_matches():
    assert select_mesh_rule(RULES, "gpu-h100-8") == RULES[0]
    # Both the first and second patterns match a prefix of 'gpu-h100-16'; only the second
    # matches all of it.
    assert select_mesh_rule(RULES, "gpu-h100-16") == RULES[1]
    assert select_mesh_rule(RULES, "cpu")[1] is RULES[2][1]


@pytest.mark.parametrize("selector", ["tpu-v5p-1024", "xgpu-h100-8"])  # Search would match x...
def test_select_mesh_rule_names_the_config_and_its_patterns_when_nothing_matches(selector):
    with pytest.raises(ConfigError, match=rf"--mesh_selector={selector} matches none of gpt_x's"):
        select_mesh_rule(RULES, selector, config_name="gpt_x")
    with pytest.raises(ConfigError, match=r"mesh_rules: \[\]"):
        select_mesh_rule(None, "cpu")


def test_a_mesh_rule_value_may_be_a_mesh_shape_or_a_modifier():
    cfg = apply_mesh_rule(_config(), (1, 2, 1, -1, 1, 1))
    assert cfg.mesh_shape == (1, 2, 1, -1, 1, 1)
    cfg = apply_mesh_rule(cfg, RULES[2][1])
    assert cfg.mesh_shape == (1, 1, 1, 1, 1, -1)
    assert apply_mesh_rule(cfg, None).mesh_shape == (1, 1, 1, 1, 1, -1)


def test_a_mesh_rule_value_of_another_kind_is_rejected():
    with pytest.raises(ConfigError, match="mesh shape or a ConfigModifier config, got 'fsdp'"):
        apply_mesh_rule(_config(), "fsdp")


# ----- the modifiers -----


def test_mesh_shape_modifier_sets_the_mesh_shape():
    cfg = _apply(MeshShapeModifier.default_config().set(mesh_shape=[1, -1, 1, 4, 1, 1]), _config())
    assert cfg.mesh_shape == (1, -1, 1, 4, 1, 1)


def _remat_text(cfg) -> str:
    # Function configs compare by identity of their generated classes: compare the text.
    return cfg.model.decoder.transformer.layer.debug_string()


def test_remat_spec_modifier_sets_remat_spec_at_each_path():
    cfg = _apply(
        RematSpecModifier.default_config().set(remat_policies={LAYER_PATH: build_remat_spec()}),
        _config(),
    )
    text = _remat_text(cfg)
    assert "remat_spec['policy'].names_which_can_be_saved: '.*([qkvo]_proj|context)'" in text
    cfg = _apply(
        RematSpecModifier.default_config().set(remat_policies={LAYER_PATH: None}), cfg
    )
    assert cfg.model.decoder.transformer.layer.remat_spec is None


def test_remat_spec_modifier_names_a_path_without_remat_spec():
    modifier = RematSpecModifier.default_config().set(remat_policies={"learner": None})
    with pytest.raises(ConfigError, match="'learner' is not a config with a 'remat_spec'"):
        _apply(modifier, _config())


@pytest.mark.slow
def test_a_microbatch_size_set_by_a_modifier_trains_the_same_model_as_the_full_batch():
    plain = _config()
    microbatched = _apply(
        TrainerFieldsModifier.default_config().set(fields={"per_device_microbatch_size": 4}),
        _config(),
    )
    results, params = [], []
    for cfg, microbatches in ((plain, 1), (microbatched, 2)):
        trainer = cfg.instantiate(parent=None)
        assert trainer.num_microbatches(cfg.input.global_batch_size) == microbatches
        results.append(trainer.run())
        params.append(jax.tree.leaves(trainer.trainer_state.model))
    np.testing.assert_allclose(results[1]["loss"], results[0]["loss"], rtol=1e-5)
    np.testing.assert_allclose(
        results[1]["learner/gradient_norm"], results[0]["learner/gradient_norm"], rtol=1e-5
    )
    assert len(params[0]) == len(params[1])
    for full, micro in zip(*params):
        np.testing.assert_allclose(np.asarray(micro), np.asarray(full), rtol=1e-4, atol=1e-6)


def test_module_config_modifier_swaps_the_module_and_keeps_shared_fields():
    cfg = _config()
    old = cfg.model.decoder.transformer
    modifier = ModuleConfigModifier.default_config().set(
        target_config="model.decoder.transformer",
        modification=StackedTransformerLayer.default_config(),
    )
    cfg = _apply(modifier, cfg)
    new = cfg.model.decoder.transformer
    assert new.klass is StackedTransformerLayer and old.klass is not StackedTransformerLayer
    assert new.num_layers == old.num_layers and new.layer == old.layer
    # The swapped model builds: one child per layer instead of stacked parameters.
    transformer_specs = _param_specs(cfg)["decoder"]["transformer"]
    assert sorted(transformer_specs) == ["layer0", "layer1"]


def test_module_config_modifier_shared_fields_keep_the_old_value_even_if_set():
    # AXLearn's rule: a field both configs have keeps the replaced config's value.
    old = _config()
    modifier = ModuleConfigModifier.default_config().set(
        target_config="model.decoder.transformer",
        modification=StackedTransformerLayer.default_config().set(num_layers=1),
    )
    cfg = _apply(modifier, old.clone())
    assert cfg.model.decoder.transformer.num_layers == old.model.decoder.transformer.num_layers
    assert sorted(_param_specs(cfg)["decoder"]["transformer"]) == ["layer0", "layer1"]


def test_module_config_modifier_fields_the_old_config_lacks_come_from_the_modification():
    stacked = _apply(
        ModuleConfigModifier.default_config().set(
            target_config="model.decoder.transformer",
            modification=StackedTransformerLayer.default_config(),
        ),
        _config(),
    )
    assert "repeat" not in stacked.model.decoder.transformer.keys()
    repeated = RepeatedTransformerLayer.default_config()
    repeated.repeat.drop_output = None
    cfg = _apply(
        ModuleConfigModifier.default_config().set(
            target_config="model.decoder.transformer", modification=repeated
        ),
        stacked,
    )
    assert cfg.model.decoder.transformer.klass is RepeatedTransformerLayer
    assert cfg.model.decoder.transformer.repeat.drop_output is None


def test_module_config_modifier_names_a_bad_target_path():
    modifier = ModuleConfigModifier.default_config().set(
        target_config="model.decoder.transformr",
        modification=StackedTransformerLayer.default_config(),
    )
    with pytest.raises(ConfigError, match="no field 'transformr'.*transformer"):
        _apply(modifier, _config())


def test_partition_spec_modifier_sets_partition_specs_by_path():
    modifier = PartitionSpecModifier.default_config().set(
        partition_specs={
            "model.decoder.emb.token_emb": {"param_partition_spec": (None, "model")},
        }
    )
    cfg = _apply(modifier, _config())
    assert cfg.model.decoder.emb.token_emb.param_partition_spec == (None, "model")
    spec = _param_specs(cfg)["decoder"]["emb"]["token_emb"]["weight"]
    assert tuple(spec.mesh_axes) == (None, "model")


def test_partition_spec_modifier_only_sets_partition_spec_fields():
    modifier = PartitionSpecModifier.default_config().set(
        partition_specs={"model.decoder.emb.token_emb": {"num_embeddings": 3}}
    )
    with pytest.raises(ConfigError, match="token_emb.num_embeddings' is not a partition spec"):
        _apply(modifier, _config())


def test_chain_config_modifier_applies_its_modifiers_in_order():
    chain = ChainConfigModifier.default_config().set(
        config_modifiers=[
            MeshShapeModifier.default_config().set(mesh_shape=(1, 1, 1, -1, 1, 1)),
            TrainerFieldsModifier.default_config().set(fields={"per_device_microbatch_size": 2}),
            MeshShapeModifier.default_config().set(mesh_shape=(1, -1, 1, 1, 1, 1)),
        ]
    )
    cfg = _apply(chain, _config())
    assert cfg.mesh_shape == (1, -1, 1, 1, 1, 1)  # The later mesh modifier wins.
    assert cfg.per_device_microbatch_size == 2


def test_single_host_gpu_rule_of_the_gpt_experiments_is_a_chain():
    rule = common.single_host_gpu_rule(build_remat_spec())
    cfg = apply_mesh_rule(_config(), rule)
    assert cfg.mesh_shape == common.mesh_shape_from_axes(fsdp=-1)
    assert "remat_spec['policy']" in _remat_text(cfg)


def test_trainer_fields_modifier_sets_trainer_fields():
    modifier = TrainerFieldsModifier.default_config().set(
        fields={"carry_train_dtype_weights": True, "log_every_n_steps": 7}
    )
    cfg = _apply(modifier, _config())
    assert cfg.carry_train_dtype_weights is True and cfg.log_every_n_steps == 7


def test_trainer_fields_modifier_names_a_field_the_trainer_lacks():
    modifier = TrainerFieldsModifier.default_config().set(fields={"carry_weights": True})
    with pytest.raises(ConfigError, match="no 'carry_weights'"):
        _apply(modifier, _config())


@pytest.mark.parametrize(
    "mesh_shape,rows",
    [
        (None, True),  # All GPUs on fsdp: linear2 split along its hidden (first) dim.
        (common.mesh_shape_from_axes(data=-1), True),
        (common.mesh_shape_from_axes(fsdp=-1, model=2), False),  # Hidden keeps 'model'.
    ],
)
def test_single_host_gpu_rule_splits_linear2_by_rows_without_tensor_parallelism(
    mesh_shape, rows
):
    cfg = apply_mesh_rule(_config(), common.single_host_gpu_rule(None, mesh_shape=mesh_shape))
    linear2 = cfg.model.decoder.transformer.layer.feed_forward.linear2
    before = _config().model.decoder.transformer.layer.feed_forward.linear2.param_partition_spec
    assert before == ("model", common.FSDP_AXIS_NAMES)
    want = (common.FSDP_AXIS_NAMES, "model") if rows else before
    assert tuple(linear2.param_partition_spec) == want
    # The parameter follows (its last two dims: the tiny model stacks its layers first).
    specs = dict(flatten_with_paths(_param_specs(cfg), is_leaf=is_parameter_spec))
    linear2_weights = [s for p, s in specs.items() if p.endswith("feed_forward/linear2/weight")]
    assert linear2_weights and all(tuple(s.mesh_axes)[-2:] == want for s in linear2_weights)


@pytest.mark.parametrize("carry", [False, True])
def test_single_host_gpu_rule_carries_weight_copies_only_when_asked(carry):
    rule = common.single_host_gpu_rule(None, carry_train_dtype_weights=carry)
    cfg = apply_mesh_rule(_config(), rule)
    assert bool(cfg.carry_train_dtype_weights) is carry


# ----- ReplaceLayerConfigModifier -----


def _replace_feed_forward(**source_fields):
    # pylint: disable-next=import-outside-toplevel
    from axlearn.common.attention import TransformerFeedForwardLayer
    # pylint: disable-next=import-outside-toplevel
    from axlearn.common.mixture_of_experts import TransformerFeedForwardDropFreeMoE
    # pylint: disable-next=import-outside-toplevel
    from axlearn.common.trainer_config_modifier import ReplaceLayerConfigModifier

    return ReplaceLayerConfigModifier.default_config().set(
        target_cls=TransformerFeedForwardLayer,
        source_config=TransformerFeedForwardDropFreeMoE.default_config().set(**source_fields),
        exclude_keys=["num_experts"],
    )


def test_replace_layer_modifier_swaps_every_matching_layer_keeping_shared_fields():
    cfg = _config()
    before = cfg.model.decoder.transformer.layer.feed_forward
    cfg = _apply(_replace_feed_forward(num_experts=4, activation="nn.gelu"), cfg)
    after = cfg.model.decoder.transformer.layer.feed_forward
    assert after.klass.__name__ == "TransformerFeedForwardDropFreeMoE"
    assert after.num_experts == 4  # Excluded: the source's value.
    assert after.hidden_dim == before.hidden_dim and after.activation == before.activation
    assert after.norm.klass is before.norm.klass
    _param_specs(cfg)  # The swapped model builds.


def test_replace_layer_modifier_without_a_matching_layer_is_an_error():
    cfg = _apply(_replace_feed_forward(num_experts=4), _config())
    with pytest.raises(ConfigError, match="has no TransformerFeedForwardLayer config"):
        _apply(_replace_feed_forward(num_experts=4), cfg)


def test_replace_layer_modifier_rejects_exclude_keys_the_source_lacks():
    modifier = _replace_feed_forward(num_experts=4).set(exclude_keys=["num_expert"])
    with pytest.raises(ConfigError, match=r"exclude_keys \['num_expert'\]"):
        _apply(modifier, _config())


# ----- GradientAccumulationModifier -----
# GradientAccumulationModifier: AXLearn's gradient accumulation as the trainer's
# grad_acc_steps (the microbatch arithmetic itself is tested with the learner).


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


def test_axlearn_replace_layer_golden_lines_set_the_gmm_backend_of_every_moe_layer():
    """AXLearn's GPU mesh rules switch the MoE layers' grouped matmul this way: the excluded
    keys take the source's values, every other field keeps the replaced layer's."""
    # pylint: disable-next=import-outside-toplevel
    from axlearn.common.golden_text import parse_flat_text
    # pylint: disable-next=import-outside-toplevel
    from axlearn.common.mixture_of_experts import GMMBackend

    moe = "'axlearn.common.mixture_of_experts.TransformerFeedForwardDropFreeMoE'"
    text = "\n".join(
        [
            "m.exclude_keys[0]: 'gmm_backend'",
            "m.klass: 'axlearn.common.trainer_config_modifier.ReplaceLayerConfigModifier'",
            "m.source_config.gmm_backend: <GMMBackend.RAGGED_DOT: 'RAGGED_DOT'>",
            f"m.source_config.klass: {moe}",
            "m.source_config.num_experts: 64",
            f"m.target_cls: {moe}",
        ]
    )
    modifier = parse_flat_text(text)["m"]
    cfg = _apply(_replace_feed_forward(num_experts=4, grouped_matmul="mosaic_gpu"), _config())
    cfg = _apply(modifier, cfg)
    ffn = cfg.model.decoder.transformer.layer.feed_forward
    assert ffn.gmm_backend is GMMBackend.RAGGED_DOT  # Excluded: the source's value.
    assert ffn.num_experts == 4 and ffn.grouped_matmul == "mosaic_gpu"  # Kept.
    _param_specs(cfg)  # The model builds.


# ----- OptimizerStateDtypeModifier -----


def test_optimizer_state_dtype_modifier_narrows_the_state_as_the_learner_builder_does():
    from axlearn.common.experiment_registry import build_named_config  # pylint: disable=import-outside-toplevel

    state_dtypes = {"gradient_square_ema": jnp.bfloat16, "update_ema": jnp.float16}
    modifier = OptimizerStateDtypeModifier.default_config().set(state_dtypes=state_dtypes)
    cfg = modifier.instantiate()(build_named_config("gpt_1b"))
    # gpt_1b_narrow_state builds the same state dtypes in adastar_learner_config.
    want = build_named_config("gpt_1b_narrow_state").learner
    assert cfg.learner.debug_string() == want.debug_string()


def test_optimizer_state_dtype_modifier_names_a_path_without_an_optimizer():
    modifier = OptimizerStateDtypeModifier.default_config().set(
        state_dtypes={"update_ema": jnp.float16}, optimizer_path="learner.no_such_optimizer"
    )
    with pytest.raises(ConfigError, match="'learner.no_such_optimizer'"):
        modifier.instantiate()(tiny_trainer_config(trainer_dir=None))
