"""llama_lora end to end: a random transformers Llama warm-starts the LoRA config, trains on
chat shards built here (the loss on the assistant's turns alone), checkpoints its adapters alone, and comes out as a PEFT adapter that
peft loads onto transformers, or merged, with our logits; generate runs it."""

import json
import random
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from axlearn.common import generate, hf_llama, lora, trainer_dir
from axlearn.common.checkpointer import CheckpointMismatchError
from axlearn.common.config import ConfigError
from axlearn.common.launch_trainer import build_trainer_config
from axlearn.common.module import functional as F
from axlearn.common.trainer import check_fingerprint, params_fingerprint
from axlearn.common.utils import flatten_with_paths
from tests.fresh_python import REPO, fresh_env

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

VOCAB = 384  # The byte vocabulary's 259 ids, padded.
STEPS = 40
SMALL = (
    "--jax_backend=cpu",
    "--config_override=input.global_batch_size=8",
    "--config_override=input.max_sequence_length=64",
    "--config_override=evalers['validation'].input.global_batch_size=8",
    "--config_override=evalers['validation'].input.max_sequence_length=64",
    "--config_override=learner.optimizer.inner.learning_rate.peak_lr=0.01",
    "--config_override=learner.optimizer.inner.learning_rate.warmup_steps=3",
    "--config_override=summary_writer.write_every_n_steps=5",
)


def _save_hf(directory, seed=0):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=10000.0,
        rms_norm_eps=1e-5, tie_word_embeddings=False, eos_token_id=1, pad_token_id=0,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(directory)
    return directory


@pytest.fixture(name="hf_dir", scope="module")
def fixture_hf_dir(tmp_path_factory):
    return _save_hf(tmp_path_factory.mktemp("hf"))


# A chat template of the simplest kind: each turn as `<|role|>content` and a newline.
TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"


@pytest.fixture(name="data_dir", scope="module")
def fixture_data_dir(tmp_path_factory):
    """Chat shards (bytes) of sums: 600 conversations of five questions and answers, the
    loss counted on the assistant's answers alone (`input_tokens build --chat`)."""
    work = tmp_path_factory.mktemp("sums")
    rng = random.Random(0)
    (work / "template.jinja").write_text(TEMPLATE, encoding="utf-8")
    with open(work / "sums.jsonl", "w", encoding="utf-8") as f:
        for _ in range(600):
            messages = []
            for _ in range(5):
                a, b = rng.randint(0, 50), rng.randint(0, 50)
                messages += [
                    {"role": "user", "content": f"What is {a} plus {b}?"},
                    {"role": "assistant", "content": f"{a + b}."},
                ]
            f.write(json.dumps({"messages": messages}) + "\n")
    build = subprocess.run(
        [sys.executable, "-m", "axlearn.common.input_tokens", "build", "--chat",
         "--vocab=bytes", f"--chat_template={work / 'template.jinja'}",
         f"--output={work}/data/train", "--validation_fraction=0.1", str(work / "sums.jsonl")],
        env=fresh_env(), cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    assert build.returncode == 0, build.stderr[-2000:]
    return work / "data"


def _train(*argv):
    result = subprocess.run(
        [sys.executable, "-m", "axlearn.common.launch_trainer_main", *SMALL, *argv],
        env=fresh_env(1), cwd=REPO, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stderr


@pytest.fixture(name="lora_run", scope="module")
def fixture_lora_run(hf_dir, data_dir, tmp_path_factory):
    """(run dir, log) of llama_lora on the HF model, STEPS steps on the sums."""
    run_dir = tmp_path_factory.mktemp("lora_run") / "run"
    log = _train("--config=llama_lora", f"--init_from_hf={hf_dir}", f"--data_dir={data_dir}",
                 f"--trainer_dir={run_dir}", f"--config_override=max_step={STEPS}")
    return run_dir, log


def _losses(run_dir):
    with open(run_dir / "summaries" / "train" / "metrics.jsonl", encoding="utf-8") as f:
        return [json.loads(line)["loss"] for line in f]


def _our_logits(model_cfg, params, ids):
    model = model_cfg.clone(name="model").instantiate(parent=None)
    params = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), params)
    out, _ = F(model.decoder, state=params["decoder"], inputs=(jnp.asarray(ids),),
               prng_key=None, is_training=False)
    return np.asarray(out["logits"])


def _bf16_base(hf_dir):
    """The HF model with its weights rounded to bf16, as the LoRA run stores its base."""
    return transformers.LlamaForCausalLM.from_pretrained(
        hf_dir, torch_dtype=torch.bfloat16
    ).float().eval()


def _close(actual, expected, tol=1e-4):
    assert np.max(np.abs(actual - expected)) <= tol * np.max(np.abs(expected))


IDS = np.random.RandomState(0).randint(3, 259, size=(2, 24))


@pytest.mark.slow
def test_lora_sft_lowers_the_assistant_token_loss_on_a_chat_corpus_made_in_the_test(lora_run):
    run_dir, log = lora_run
    assert "Initialized the model parameters with HfLlamaWeights" in log
    losses = _losses(run_dir)
    assert len(losses) == STEPS // 5
    # A random base (its frozen head too) and rank-16 adapters: a drop of half a nat.
    assert losses[-1] < losses[0] - 0.5, losses


@pytest.mark.slow
def test_checkpoints_hold_the_adapters_but_not_the_frozen_base(lora_run):
    run_dir, _ = lora_run
    step_dir = run_dir / "checkpoints" / f"step_{STEPS:08d}"
    with open(step_dir / "index.json", encoding="utf-8") as f:
        index = json.load(f)
    model_paths = [p for p in index["arrays"] if p.startswith("model/")]
    assert model_paths and all("/adapter/lora_" in p for p in model_paths), model_paths
    frozen = index["extra"]["frozen_params_fingerprint"]
    assert "decoder/emb/token_emb/weight" in frozen
    assert any(p.endswith("/layer/qkv_proj/weight") for p in frozen)


@pytest.mark.slow
def test_peft_export_loads_onto_transformers_with_our_logits(lora_run, hf_dir, tmp_path):
    run_dir, _ = lora_run
    step, dtype, written = hf_llama.export_trainer_dir(str(run_dir), str(tmp_path / "adapter"))
    assert (step, dtype) == (STEPS, "float32")
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(written)
    loaded = peft.PeftModel.from_pretrained(_bf16_base(hf_dir), str(tmp_path / "adapter")).eval()
    cfg = trainer_dir.read_trainer_config(str(run_dir))
    _, params = trainer_dir.restore_model_params(str(run_dir))
    with torch.no_grad():
        theirs = loaded(torch.tensor(IDS)).logits.numpy()
    _close(_our_logits(cfg.model, params, IDS), theirs)
    with lora.adapters_disabled():  # The adapters trained: they change the function.
        base = _our_logits(cfg.model, params, IDS)
    assert np.max(np.abs(base - theirs)) > 1e-2


@pytest.mark.slow
def test_merged_export_gives_transformers_our_logits(lora_run, tmp_path):
    run_dir, _ = lora_run
    result = subprocess.run(
        [sys.executable, "-m", "axlearn.common.hf_llama", "export", f"--trainer_dir={run_dir}",
         f"--output={tmp_path}/merged", "--merge_lora", "--dtype=float32"],
        env=fresh_env(), cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    merged = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "merged").eval()
    cfg = trainer_dir.read_trainer_config(str(run_dir))
    _, params = trainer_dir.restore_model_params(str(run_dir))
    with torch.no_grad():
        _close(_our_logits(cfg.model, params, IDS), merged(torch.tensor(IDS)).logits.numpy())


@pytest.mark.slow
def test_generate_decodes_a_lora_run_with_its_adapters(lora_run):
    run_dir, _ = lora_run
    generator, _ = generate.from_trainer_dir(str(run_dir), dtype="float32")
    prompt = [int(t) for t in IDS[0, :10]]
    (tokens,), _ = generator.generate([prompt], max_new_tokens=1)
    cfg = trainer_dir.read_trainer_config(str(run_dir))
    _, params = trainer_dir.restore_model_params(str(run_dir))
    logits = _our_logits(cfg.model, params, np.asarray([prompt]))
    assert tokens[0] == int(np.argmax(logits[0, -1]))


@pytest.mark.slow
def test_init_lora_from_starts_the_adapters_from_a_peft_directory(lora_run, hf_dir, tmp_path):
    run_dir, _ = lora_run
    hf_llama.export_trainer_dir(str(run_dir), str(tmp_path / "adapter"))
    cfg = build_trainer_config(
        config_name="llama_lora", init_from_hf=str(hf_dir),
        init_lora_from=str(tmp_path / "adapter"),
    )
    model = cfg.model.clone(name="model").instantiate(parent=None)
    specs = model.create_parameter_specs_recursively()
    cpu = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
    loaded = cfg.init_params.instantiate().load(
        model_config=cfg.model, param_specs=specs,
        shardings=jax.tree.map(lambda _: cpu, specs, is_leaf=lambda x: hasattr(x, "shape")),
    )
    _, trained = trainer_dir.restore_model_params(str(run_dir), frozen=False)
    loaded, trained = dict(flatten_with_paths(loaded)), dict(flatten_with_paths(trained))
    for path, value in trained.items():
        np.testing.assert_array_equal(np.asarray(loaded[path]), np.asarray(value), err_msg=path)


@pytest.mark.slow
def test_a_changed_base_is_refused_at_restore_naming_the_parameter(lora_run, hf_dir, tmp_path):
    run_dir, _ = lora_run
    changed_hf = _save_hf(tmp_path / "hf", seed=1)  # Another model at the recorded path.
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy, ignore=shutil.ignore_patterns("LOCK"))
    config = (copy / "config.txt").read_text().replace(str(hf_dir), str(changed_hf))
    (copy / "config.txt").write_text(config)
    with pytest.raises(CheckpointMismatchError, match="frozen parameter decoder/"):
        trainer_dir.restore_model_params(str(copy))


def test_init_lora_from_refuses_an_adapter_for_other_layers_naming_the_file(hf_dir, tmp_path):
    base = transformers.LlamaForCausalLM.from_pretrained(hf_dir)
    other = peft.get_peft_model(
        base, peft.LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "v_proj"])
    )
    other.save_pretrained(str(tmp_path / "adapter"))
    with pytest.raises(ConfigError, match=r"adapter_config.json: target_modules"):
        build_trainer_config(
            config_name="llama_lora", init_from_hf=str(hf_dir),
            init_lora_from=str(tmp_path / "adapter"),
        )


def test_a_fingerprint_changes_with_any_one_element_and_names_the_parameter():
    x = np.arange(1000, dtype=np.float32).reshape(10, 100)
    y = x.copy()
    y[7, 3] = np.nextafter(y[7, 3], np.float32(1e9))  # One bit of one element.
    a = params_fingerprint({"w": jnp.asarray(x), "b": jnp.zeros([3], jnp.bfloat16)})
    b = params_fingerprint({"w": jnp.asarray(y), "b": jnp.zeros([3], jnp.bfloat16)})
    assert a["b"] == b["b"] and a["w"] != b["w"]
    with pytest.raises(CheckpointMismatchError, match="frozen parameter w from SRC"):
        check_fingerprint(b, a, source="SRC", step=3)


@pytest.mark.slow
def test_a_lora_base_comes_from_a_full_parameter_runs_checkpoint(hf_dir, data_dir, tmp_path):
    sft_dir = tmp_path / "sft"
    _train("--config=llama_sft", f"--init_from_hf={hf_dir}", f"--data_dir={data_dir}",
           f"--trainer_dir={sft_dir}", "--config_override=max_step=4")
    cfg = build_trainer_config(config_name="llama_lora", init_from_checkpoint=str(sft_dir))
    assert lora.lora_layer_configs(cfg.model) and cfg.model.dtype == jnp.bfloat16
    model = cfg.model.clone(name="model").instantiate(parent=None)
    specs = model.create_parameter_specs_recursively()
    cpu = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
    loaded = cfg.init_params.instantiate().load(
        model_config=cfg.model, param_specs=specs,
        shardings=jax.tree.map(lambda _: cpu, specs, is_leaf=lambda x: hasattr(x, "shape")),
    )
    _, sft = trainer_dir.restore_model_params(str(sft_dir))
    sft = dict(flatten_with_paths(sft))
    for path, base_path in lora.base_param_paths(model, loaded).items():
        value = np.asarray(dict(flatten_with_paths(loaded))[path], np.float32)
        if base_path is None:
            if "lora_up" in path:  # Fresh adapters: the LoRA model starts as the SFT model.
                assert not value.any(), path
            continue
        expected = np.asarray(sft[base_path].astype(jnp.bfloat16), np.float32)
        np.testing.assert_array_equal(value, expected, err_msg=path)
