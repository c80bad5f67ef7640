"""experiments/llama_dpo.py: as_dpo's trainer (the policy's mesh rule paths, the frozen
reference: refused for a LoRA policy, its parameters and FLOPs counted apart from the
policy's), and --init_from_hf filling the policy and the reference copy from one Hugging
Face directory."""

import math

import jax
import numpy as np
import pytest

from axlearn import bench
from axlearn.common import dpo, experiment_registry, hf_llama, perf
from axlearn.common.config import ConfigBase, ConfigError
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


def _lora_lm_trainer():
    """The tiny LM trainer of llama_dpo_lora_test (LoRA r4 on the seven maps), before DPO."""
    base = llama_dpo.llama_dpo_lora_test_trainer().clone()
    base.model = base.model.policy
    return base


# The refusal of a frozen copy for a LoRA policy: it names its first LoRA layer config.
LORA_FROZEN_COPY_LINE = (
    "model.reference='frozen_copy': the policy has LoRA adapters (model.policy.decoder."
    "transformer.layer.feed_forward.linear1, ...), so a frozen copy would duplicate its whole "
    "frozen base; use reference='adapters_disabled' (the policy's base with the adapters off)"
)


def test_as_dpo_refuses_a_frozen_copy_reference_for_a_lora_config_in_one_line():
    base = _lora_lm_trainer()
    with pytest.raises(ConfigError) as e:
        llama_dpo.as_dpo(base, pairs=base.input, learning_rate=1e-3, max_step=10,
                         reference="frozen_copy")
    assert str(e.value) == LORA_FROZEN_COPY_LINE


def test_a_lora_dpo_model_overridden_to_a_frozen_copy_is_refused_when_built():
    cfg = llama_dpo.llama_dpo_lora_test_trainer().model.clone(name="model", reference="frozen_copy")
    with pytest.raises(ConfigError) as e:
        cfg.instantiate(parent=None)
    assert str(e.value) == LORA_FROZEN_COPY_LINE


@pytest.mark.parametrize(
    "config, children",
    [("llama_dpo_lora_test", {"policy"}), ("llama_dpo_test", {"policy", "reference"})],
)
def test_lora_with_adapters_disabled_and_full_with_frozen_copy_build(config, children):
    cfg = llama_dpo.named_trainer_configs()[config]()
    model = cfg.model.clone(name="model").instantiate(parent=None)
    assert set(model.children) == children


def _policy_size(cfg) -> int:
    """The policy's parameters: the sizes of its own specs, built apart from DPO."""
    policy = cfg.model.policy.clone(name="policy").instantiate(parent=None)
    specs = jax.tree.leaves(policy.create_parameter_specs_recursively(),
                            is_leaf=lambda x: hasattr(x, "shape"))
    return sum(math.prod(spec.shape) for spec in specs)


def _tiny_dpo_trainer():
    cfg = llama_dpo.llama_dpo_test_trainer()
    return cfg.set(dir=None, max_step=0, compile_ahead=False).instantiate(parent=None)


def test_the_step_accounting_counts_the_policy_and_the_frozen_reference_apart():
    size = _policy_size(llama_dpo.llama_dpo_test_trainer())
    accounting = perf.StepAccounting.for_trainer(_tiny_dpo_trainer())
    assert (accounting.num_params, accounting.reference_params) == (size, size)
    assert accounting.params_text() == (
        f"{size:,} parameters (+{size:,} in the frozen DPO reference)"
    )


def test_the_frozen_reference_forward_counts_2_flops_a_matmul_parameter_a_token():
    # The tiny Llama by hand (head_dim 8, tied head): q, k, v, o, the gated MLP, the head.
    dim, layers, seq_len = 32, 2, 32
    matmul = layers * (dim * (4 + 2 + 2) * 8 + 4 * 8 * dim + 3 * dim * 64) + 128 * dim
    accounting = perf.StepAccounting.for_trainer(_tiny_dpo_trainer())
    # DESIGN.md: the policy trains (6 a parameter, 6 x layers x seq_len x d_model of
    # attention), the reference runs forward only (2 and 2).
    per_token = (6 + 2) * matmul + (6 + 2) * layers * seq_len * dim
    assert accounting.tokens_per_step == 2 * 8 * seq_len  # 8 pairs: 16 rows.
    assert accounting.flops_per_step == per_token * accounting.tokens_per_step


def test_the_bench_row_holds_the_policy_s_parameters_and_the_reference_apart():
    size = _policy_size(llama_dpo.llama_dpo_test_trainer())
    accounting = perf.StepAccounting.for_trainer(_tiny_dpo_trainer())
    row = bench._benchmark_row(  # pylint: disable=protected-access
        "llama_dpo_test", accounting, 1, losses=[0.7], step_times=[0.5], gpu_samples={}
    )
    assert (row["num_params"], row["reference_params"]) == (size, size)


def test_list_configs_counts_a_dpo_config_s_policy_alone():
    cfg = llama_dpo.llama_dpo_test_trainer()
    assert experiment_registry.parameter_count(cfg) == _policy_size(cfg)


@pytest.mark.slow  # Initializes the trainer's state (jitted): seconds of the quick suite's budget.
def test_the_trainer_logs_the_policy_s_parameters_with_the_frozen_reference_beside(caplog):
    size = _policy_size(llama_dpo.llama_dpo_test_trainer())
    with caplog.at_level("INFO", logger="axlearn.common.trainer"):
        _tiny_dpo_trainer().run()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Model: ")]
    assert len(lines) == 1
    want = f"Model: {size:,} parameters (+{size:,} in the frozen DPO reference), "
    assert lines[0].startswith(want)


def _loaded_init_params(cfg):
    """The parameters `cfg.init_params` loads for `cfg.model`, on the CPU."""
    model = cfg.model.clone(name="model").instantiate(parent=None)
    specs = model.create_parameter_specs_recursively()
    cpu = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
    shardings = jax.tree.map(lambda _: cpu, specs, is_leaf=lambda x: hasattr(x, "shape"))
    return cfg.init_params.instantiate().load(
        model_config=cfg.model, param_specs=specs, shardings=shardings
    )


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
    loaded = _loaded_init_params(cfg)
    # float32 weights travel exactly; the reference equals them too.
    jax.tree.map(np.testing.assert_array_equal, loaded["policy"], params)
    jax.tree.map(np.testing.assert_array_equal, loaded["reference"], params)


@pytest.mark.slow
def test_init_from_checkpoint_starts_the_policy_and_reference_from_another_runs_policy(tmp_path):
    import subprocess  # pylint: disable=import-outside-toplevel
    import sys  # pylint: disable=import-outside-toplevel

    from axlearn.common import trainer_dir  # pylint: disable=import-outside-toplevel
    from axlearn.common.launch_trainer import (  # pylint: disable=import-outside-toplevel
        use_run_checkpoint,
    )
    from tests.fresh_python import REPO, fresh_env  # pylint: disable=import-outside-toplevel

    source = tmp_path / "first"  # A DPO run: its policy is the language model to start from.
    result = subprocess.run(
        [sys.executable, "-m", "axlearn.common.launch_trainer_main", "--config=llama_dpo_test",
         f"--trainer_dir={source}", "--config_override=max_step=2", "--jax_backend=cpu"],
        env=fresh_env(1), cwd=REPO, capture_output=True, text=True, timeout=600, check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    _, _, expected = trainer_dir.restore_language_model(str(source))
    cfg = use_run_checkpoint(llama_dpo.llama_dpo_test_trainer(), str(source))
    loaded = _loaded_init_params(cfg)
    jax.tree.map(np.testing.assert_array_equal, loaded["policy"], expected)
    jax.tree.map(np.testing.assert_array_equal, loaded["reference"], expected)


@pytest.mark.slow
def test_a_dpo_config_trains_on_pair_shards_given_as_its_data_dir(tmp_path):
    import json  # pylint: disable=import-outside-toplevel
    import subprocess  # pylint: disable=import-outside-toplevel
    import sys  # pylint: disable=import-outside-toplevel

    from tests.fresh_python import REPO, fresh_env  # pylint: disable=import-outside-toplevel

    with open(tmp_path / "pairs.jsonl", "w", encoding="utf-8") as f:
        for a in range(60):
            f.write(json.dumps({"prompt": f"{a} plus 1?", "chosen": f" {a + 1}.",
                                "rejected": f" {a + 2}."}) + "\n")
    (tmp_path / "t.jinja").write_text(
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}",
        encoding="utf-8",
    )

    def run(*args):
        return subprocess.run(
            [sys.executable, "-m", *args], env=fresh_env(1), cwd=REPO, capture_output=True,
            text=True, timeout=600, check=False,
        )

    build = run("axlearn.common.input_tokens", "build", "--pairs", "--vocab=bytes",
                f"--chat_template={tmp_path / 't.jinja'}", "--max_sequence_length=32",
                f"--output={tmp_path}/data/train", str(tmp_path / "pairs.jsonl"))
    assert build.returncode == 0, build.stderr[-2000:]
    train = run("axlearn.common.launch_trainer_main", "--config=llama_dpo_test",
                f"--data_dir={tmp_path / 'data'}", f"--trainer_dir={tmp_path / 'run'}",
                "--config_override=max_step=2",
                "--config_override=model.policy.decoder.vocab_size=384")
    assert train.returncode == 0, train.stderr[-3000:]
    assert "PreferencePairInput" in (tmp_path / "run" / "config.txt").read_text(encoding="utf-8")
