"""--init_from_hf, export and --eval_only, end to end: a random transformers Llama warm-starts
a named config, trains a few steps on two devices, is exported, and transformers reloads
it with our logits."""

import json
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from axlearn.common import hf_checkpoint, hf_llama, trainer_dir
from axlearn.common.base_layer import is_parameter_spec
from axlearn.common.config import ConfigError
from axlearn.common.launch_trainer import build_trainer_config
from axlearn.common.module import functional as F
from axlearn.common.utils import flatten_with_paths
from tests.fresh_python import REPO, assert_prints_ok, fresh_env

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

VOCAB = 64
EOS_IDS = [5, 9]
ROPE_SCALING = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                    original_max_position_embeddings=400)
RUN = (
    "--config=gpt_test",
    "--data_dir=FAKE",
    "--jax_backend=cpu",
    "--config_override=input.global_batch_size=4",
    "--config_override=input.max_sequence_length=32",
    "--config_override=evalers['validation'].input.global_batch_size=4",
    "--config_override=evalers['validation'].input.max_sequence_length=32",
    "--config_override=max_step=3",
)


def _hf_config(**changes):
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, rope_theta=500000.0,
        rope_scaling=dict(ROPE_SCALING), rms_norm_eps=1e-5, tie_word_embeddings=False,
        eos_token_id=EOS_IDS, pad_token_id=None, bos_token_id=1, initializer_range=0.2,
        max_position_embeddings=512,
    )
    config.update(changes)
    return config


@pytest.fixture(name="hf_dir", scope="module")
def fixture_hf_dir(tmp_path_factory):
    """A random Llama (GQA, untied head, llama3 rope, two EOS ids, no pad id) saved in
    safetensors shards with an index, and a tokenizer file."""
    directory = tmp_path_factory.mktemp("hf")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(_hf_config()).eval()
    model.save_pretrained(directory, max_shard_size="20KB")
    (directory / "tokenizer.json").write_text("{}")  # Only copied, never read here.
    return directory


def _main(*argv, devices=1):
    return subprocess.run(
        [sys.executable, "-m", "axlearn.common.launch_trainer_main", *argv],
        env=fresh_env(devices), cwd=REPO, capture_output=True, text=True, timeout=300,
    )


@pytest.fixture(name="warm_run", scope="module")
def fixture_warm_run(hf_dir, tmp_path_factory):
    """gpt_test's recipe on the HF model, 3 steps on two devices: (dir, log)."""
    run_dir = tmp_path_factory.mktemp("run")
    result = _main(*RUN, f"--init_from_hf={hf_dir}", f"--trainer_dir={run_dir}", devices=2)
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir, result.stderr


def _logits(model_cfg, params, ids):
    model = model_cfg.clone(name="model").instantiate(parent=None)
    out, _ = F(model.decoder, state=params["decoder"], inputs=(jnp.asarray(ids),),
               prng_key=None, is_training=False)
    return np.asarray(out["logits"])


def _hf_logits(directory, ids):
    model = transformers.LlamaForCausalLM.from_pretrained(directory).eval()
    with torch.no_grad():
        return model(torch.tensor(ids)).logits.numpy()


def test_unexpressible_hf_fields_stop_the_launch_naming_them(tmp_path):
    _hf_config(attention_bias=True, hidden_act="gelu").save_pretrained(tmp_path)
    with pytest.raises(ConfigError) as error:
        build_trainer_config(config_name="gpt_test", init_from_hf=str(tmp_path))
    message = str(error.value)
    assert str(tmp_path) in message and "attention_bias" in message and "hidden_act" in message


def test_the_model_comes_from_the_hf_config_and_the_recipe_from_the_named_config(tmp_path):
    _hf_config().save_pretrained(tmp_path)
    cfg = build_trainer_config(config_name="gpt_test", init_from_hf=str(tmp_path), data_dir="FAKE")
    assert cfg.model.decoder.vocab_size == VOCAB and cfg.input.vocab_size == VOCAB
    assert cfg.model.decoder.eos_token_id == EOS_IDS and cfg.model.decoder.pad_token_id is None
    assert cfg.init_params.path == str(tmp_path)
    recipe = build_trainer_config(config_name="gpt_test", data_dir="FAKE")
    assert cfg.learner.debug_string() == recipe.learner.debug_string()
    assert cfg.mesh_axis_names == recipe.mesh_axis_names and cfg.max_step == recipe.max_step


@pytest.mark.slow
def test_each_device_loads_its_shard_of_the_hf_weights(hf_dir):
    script = f"""
import jax, numpy as np, transformers
from axlearn.common import hf_llama
from axlearn.common.base_layer import is_parameter_spec
from axlearn.common.launch_trainer import build_trainer_config
from axlearn.common.sharding import named_sharding
from axlearn.common.trainer import infer_mesh_shape
from axlearn.common.utils import flatten_with_paths
cfg = build_trainer_config(config_name="gpt_test", mesh_selector="cpu", init_from_hf="{hf_dir}")
mesh = jax.make_mesh(infer_mesh_shape(cfg.mesh_shape, 2), cfg.mesh_axis_names)
specs = cfg.model.clone(name="model").instantiate(parent=None)
specs = specs.create_parameter_specs_recursively()
shardings = jax.tree.map(lambda s: named_sharding(mesh, s.partition_spec), specs,
                         is_leaf=is_parameter_spec)
loaded = cfg.init_params.instantiate().load(
    model_config=cfg.model, param_specs=specs, shardings=shardings)
hf = transformers.LlamaForCausalLM.from_pretrained("{hf_dir}")
expected = hf_llama.params_from_hf(hf.state_dict(), cfg.model)
split = 0
for (path, got), (_, want) in zip(flatten_with_paths(loaded), flatten_with_paths(expected)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=path)
    split += len({{str(s.index) for s in got.addressable_shards}}) > 1
assert split > 5, split  # Most weights are split over the two devices (fsdp).
print("OK")
"""
    assert_prints_ok(script, devices=2)


@pytest.mark.slow
def test_warm_start_trains_and_transformers_reloads_the_export_with_our_logits(
    warm_run, hf_dir, tmp_path
):
    run_dir, log = warm_run
    assert "Initialized the model parameters with HfLlamaWeights" in log
    assert "step 3/3 | loss" in log
    step, dtype, written = hf_llama.export_trainer_dir(
        str(run_dir), str(tmp_path), dtype="float32", max_shard_size="30KB"
    )
    assert step == 3 and dtype == "float32" and hf_checkpoint.SAFETENSORS_INDEX_FILE in written
    assert "tokenizer.json" in written  # The warm start's, recorded with the run.
    with open(tmp_path / "config.json", encoding="utf-8") as f:
        config = json.load(f)
    assert config["rope_scaling"] == ROPE_SCALING and config["eos_token_id"] == EOS_IDS
    assert config["pad_token_id"] is None
    with open(tmp_path / "generation_config.json", encoding="utf-8") as f:
        assert json.load(f)["eos_token_id"] == EOS_IDS
    ids = np.random.RandomState(0).randint(0, VOCAB, size=(2, 40))  # Token 0 included.
    cfg = trainer_dir.read_trainer_config(str(run_dir))
    _, params = trainer_dir.restore_model_params(str(run_dir))
    ours, exported = _logits(cfg.model, params, ids), _hf_logits(tmp_path, ids)
    assert np.max(np.abs(ours - exported)) <= 1e-4 * np.max(np.abs(exported))
    # Training moved the weights: the export is not the checkpoint it started from.
    assert np.max(np.abs(_hf_logits(hf_dir, ids) - exported)) > 1e-3


@pytest.mark.slow
def test_export_keeps_the_source_models_fields_and_the_runs_parameter_dtype(
    warm_run, hf_dir, tmp_path
):
    run_dir, _ = warm_run
    _, dtype, written = hf_llama.export_trainer_dir(str(run_dir), str(tmp_path))
    assert dtype == "float32"  # gpt_test's parameters are float32; no --dtype given.
    with open(hf_dir / "config.json", encoding="utf-8") as f:
        source = json.load(f)
    with open(tmp_path / "config.json", encoding="utf-8") as f:
        exported = json.load(f)
    for field in ("bos_token_id", "max_position_embeddings", "initializer_range"):
        assert exported[field] == source[field], field
    assert exported["torch_dtype"] == "float32"
    with open(tmp_path / "generation_config.json", encoding="utf-8") as f:
        assert json.load(f)["bos_token_id"] == source["bos_token_id"]
    weights = [name for name in written if name.endswith(".safetensors")]
    from safetensors.numpy import load_file  # pylint: disable=import-outside-toplevel

    dtypes = {str(a.dtype) for name in weights for a in load_file(str(tmp_path / name)).values()}
    assert dtypes == {"float32"}


@pytest.mark.slow
def test_eval_only_evaluates_the_checkpoint_without_reading_the_hf_weights(warm_run, hf_dir):
    run_dir, log = warm_run
    result = _main(*RUN, f"--init_from_hf={hf_dir}", f"--trainer_dir={run_dir}", "--eval_only")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Restored step 3" in result.stderr
    assert "init_params is not read: it initializes fresh runs only" in result.stderr
    metrics = json.loads(result.stdout.strip().splitlines()[-1])
    assert metrics["evaler"] == "validation" and metrics["step"] == 3
    assert metrics["perplexity"] == pytest.approx(np.exp(metrics["loss"]), rel=1e-4)
    # The same numbers as the run's own evaluation at step 3.
    trained = float(log.split("eval validation step 3:")[1].split("loss=")[1].split()[0])
    assert metrics["loss"] == pytest.approx(trained, rel=1e-3)
    assert sorted(os.listdir(os.path.join(run_dir, "checkpoints"))) == ["step_00000003"]


def test_an_fp8_recipe_warm_starts_with_fp8_matmuls_and_empty_scaling_state(hf_dir):
    # The H100 rule of gpt_1b_fp8 switches the HF model's matmuls to FP8, as it does gpt_1b's.
    cfg = build_trainer_config(
        config_name="gpt_1b_fp8", mesh_selector="gpu-h100-1", init_from_hf=str(hf_dir),
        data_dir="FAKE",
    )
    layer = cfg.model.decoder.transformer.layer
    assert layer.feed_forward.linear2.fp8 is not None
    assert layer.self_attention.attention.output_linear.fp8 is not None
    # Export reads the same Llama: FP8 casts are training's, the weights are the model.
    plain = build_trainer_config(config_name="gpt_test", init_from_hf=str(hf_dir))
    assert hf_llama.hf_config_dict(cfg.model) == hf_llama.hf_config_dict(plain.model)
    model = cfg.model.clone(name="model", dtype=jnp.float32).instantiate(parent=None)
    specs = model.create_parameter_specs_recursively()
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    loaded = cfg.init_params.instantiate().load(
        model_config=cfg.model, param_specs=specs,
        shardings=jax.tree.map(lambda _: device, specs, is_leaf=is_parameter_spec),
    )
    hf = transformers.LlamaForCausalLM.from_pretrained(hf_dir)
    weights = dict(flatten_with_paths(hf_llama.params_from_hf(hf.state_dict(), plain.model)))
    histories = 0
    for path, value in flatten_with_paths(loaded):
        if path.endswith("amax_history"):
            np.testing.assert_array_equal(np.asarray(value), 0.0, err_msg=path)
            histories += 1
        else:
            np.testing.assert_array_equal(np.asarray(value), np.asarray(weights[path]), path)
    # Two layers of 5 FP8 matmuls (qkv, o, gate, up, down), 3 cast tensors each.
    assert histories == 2 * 5 * 3


@pytest.mark.slow
def test_export_of_a_run_whose_every_checkpoint_is_corrupt_stops_with_one_line(
    warm_run, tmp_path
):
    run_dir = tmp_path / "run"
    shutil.copytree(warm_run[0], run_dir)
    arrays = sorted(
        os.path.join(root, name)
        for root, _, names in os.walk(run_dir / "checkpoints")
        for name in names if "arrays/model/" in root + "/" and not name.startswith(".")
    )
    with open(arrays[0], "r+b") as f:  # A model weight: export reads only those.
        data = bytearray(f.read())
        data[-1] ^= 1
        f.seek(0)
        f.write(data)
    result = subprocess.run(
        [sys.executable, "-m", "axlearn.common.hf_llama", "export", f"--trainer_dir={run_dir}",
         f"--output={tmp_path / 'hf'}"],
        env=fresh_env(), cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 1 and "Traceback" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("hf_llama export: Every committed checkpoint in ")


# ----- gpt_8b: Llama 3 8B's shape -----

# The model fields of Meta's Llama 3 8B config.json (meta-llama/Meta-Llama-3-8B).
LLAMA_3_8B = dict(
    vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
    num_attention_heads=32, num_key_value_heads=8, hidden_act="silu", rms_norm_eps=1e-05,
    rope_theta=500000.0, tie_word_embeddings=False, attention_bias=False, mlp_bias=False,
)


def test_gpt_8b_exports_as_llama_3_8b_and_has_its_parameter_count():
    from axlearn.common.causal_lm import count_parameters  # pylint: disable=import-outside-toplevel
    from axlearn.common.experiment_registry import build_named_config  # pylint: disable=import-outside-toplevel

    model = build_named_config("gpt_8b").model
    config = hf_llama.hf_config_dict(model)
    assert {key: config[key] for key in LLAMA_3_8B} == LLAMA_3_8B
    # Llama 3 8B's parameters as transformers counts them (sum of numel()).
    assert count_parameters(model.clone(name="model").instantiate(parent=None)) == 8_030_261_248


def _llama_3_style_dir(directory):
    """A random Llama 3.1-style model (GQA 4/1, untied head, rope theta 500,000 with llama3
    scaling, two EOS ids, no pad id) saved in `directory`; returns the model."""
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, rope_theta=500000.0,
        rope_scaling=dict(ROPE_SCALING, original_max_position_embeddings=16),
        rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=250,
        eos_token_id=[251, 252], pad_token_id=None, max_position_embeddings=128,
        initializer_range=0.2,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(directory)
    return model


@pytest.mark.slow
def test_gpt_8b_on_its_one_gpu_rule_warm_starts_with_hf_logits_and_trains_at_hf_loss(tmp_path):
    hf_model = _llama_3_style_dir(tmp_path)
    cfg = build_trainer_config(
        config_name="gpt_8b", init_from_hf=str(tmp_path), mesh_selector="gpu-h200-1",
        data_dir="FAKE",
        config_overrides=["input.max_sequence_length=32", "input.global_batch_size=2"],
    )
    cfg.dir, cfg.evalers = None, {}
    assert cfg.split_carried_weights and cfg.per_device_microbatch_size == 1
    trainer = cfg.instantiate(parent=None, devices=jax.devices("cpu")[:1])
    # pylint: disable=protected-access
    trainer._state = trainer.init_state_from(jax.random.PRNGKey(0), trainer._loaded_params())
    batch = next(b for _, b in trainer._host_batches())
    # pylint: enable=protected-access
    ids = np.asarray(batch["input_ids"])
    with torch.no_grad():
        want = hf_model(torch.tensor(ids)).logits
    params = trainer.model_params()  # The carried bf16 copies and low bits, joined.
    out, _ = F(trainer.model.decoder, state=params["decoder"], inputs=(jnp.asarray(ids),),
               prng_key=None, is_training=False)
    np.testing.assert_allclose(np.asarray(out["logits"]), want.numpy(), atol=1e-4)
    # The first step's loss (bf16, two microbatches of one sequence) is HF's cross-entropy.
    labels = torch.tensor(np.asarray(batch["target_labels"])).long()
    hf_loss = torch.nn.functional.cross_entropy(want.reshape(-1, want.shape[-1]), labels.reshape(-1))
    loss = float(trainer.train_step(trainer.global_batch(batch))["loss"])
    np.testing.assert_allclose(loss, hf_loss.item(), rtol=2e-3)
