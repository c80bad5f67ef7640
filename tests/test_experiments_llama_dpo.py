"""experiments/llama_dpo.py: as_dpo's trainer (the policy's mesh rule paths, the frozen
reference), and --init_from_hf filling the policy and the reference copy from one
Hugging Face directory."""

import jax
import numpy as np
import pytest

from axlearn.common import dpo, hf_llama
from axlearn.common.config import ConfigBase
from axlearn.common.launch_trainer import use_hf_checkpoint
from experiments import llama_dpo


def _strings(value, found):
    if isinstance(value, str):
        found.append(value)
    elif isinstance(value, dict):
        for key, item in value.items():
            _strings(key, found)
            _strings(item, found)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _strings(item, found)
    elif isinstance(value, ConfigBase):
        for name in value.keys():
            _strings(getattr(value, name), found)
    return found


def test_mesh_rule_paths_follow_the_policy():
    paths = [s for s in _strings(llama_dpo.gpt_1b_dpo_trainer().mesh_rules, []) if s.startswith("model.")]
    assert paths and all(path.startswith("model.policy.decoder.") for path in paths)


def test_reference_is_frozen_and_the_lm_update_rules_move_under_the_policy():
    base = llama_dpo.llama_dpo_test_trainer().clone()
    base.model = base.model.policy
    base.learner.update_rules = [("decoder/emb/.*", "no_update"), (".*lora.*", "all")]
    cfg = llama_dpo.as_dpo(base, pairs=base.input, learning_rate=1e-3, max_step=10)
    assert cfg.learner.update_rules == [
        dpo.REFERENCE_UPDATE_RULE, ("policy/decoder/emb/.*", "no_update"), (".*lora.*", "all")
    ]


@pytest.mark.slow
def test_init_from_hf_loads_the_policy_and_an_equal_reference(tmp_path):
    lm = hf_llama.llama_model_config(
        vocab_size=128, dim=32, num_layers=2, num_heads=4, num_kv_heads=2, hidden_dim=64,
        repeated=False,  # As the recipe stacks its layers.
    )
    params = lm.clone(name="m").instantiate(parent=None).initialize_parameters_recursively(
        jax.random.PRNGKey(0)
    )
    hf_llama.write_hf_model(params, lm, str(tmp_path), dtype="float32")
    cfg = use_hf_checkpoint(llama_dpo.llama_dpo_test_trainer(), str(tmp_path))
    assert cfg.model.policy.decoder.transformer.num_layers == 2
    model = cfg.model.clone(name="model").instantiate(parent=None)
    specs = model.create_parameter_specs_recursively()
    cpu = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
    shardings = jax.tree.map(lambda _: cpu, specs, is_leaf=lambda x: hasattr(x, "shape"))
    loaded = cfg.init_params.instantiate().load(
        model_config=cfg.model, param_specs=specs, shardings=shardings
    )
    # float32 weights travel exactly; the reference equals them too.
    jax.tree.map(np.testing.assert_array_equal, loaded["policy"], params)
    jax.tree.map(np.testing.assert_array_equal, loaded["reference"], params)
