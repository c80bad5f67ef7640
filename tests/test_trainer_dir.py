"""trainer_dir: a run's config, model parameters and tokenizer, read outside the trainer."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from axlearn.common import run_dir, trainer_dir
from axlearn.common.base_layer import is_parameter_spec
from axlearn.common.checkpointer import Checkpointer
from axlearn.common.config import ConfigError
from axlearn.common.hf_llama import HfLlamaWeights, llama_model_config
from axlearn.common.input_builtin import BuiltinTextInput
from axlearn.common.input_fake import FakeLmInput
from axlearn.common.input_token_format import VocabularyRecord, write_shard
from axlearn.common.input_tokens import TokenShardInput
from axlearn.common.input_vocab import file_sha256
from experiments import gpt


def _trainer_config(directory):
    cfg = gpt.named_trainer_configs()["gpt_test"]()
    cfg.model = llama_model_config(
        vocab_size=32, dim=16, num_layers=1, num_heads=2, num_kv_heads=1, hidden_dim=24
    )
    cfg.dir = str(directory)
    return cfg


def _save(directory, step, state):
    checkpointer = Checkpointer.default_config().set(
        name="checkpointer", dir=os.path.join(directory, "checkpoints"), keep_last_n=2
    ).instantiate(parent=None)
    checkpointer.save(step, state)
    checkpointer.stop()


def test_the_model_parameters_of_a_step_are_restored_without_the_optimizer_state(tmp_path):
    cfg = _trainer_config(tmp_path)
    (tmp_path / run_dir.CONFIG_RECORD).write_text(cfg.debug_string())
    specs = cfg.model.clone(name="model").instantiate(parent=None)
    specs = specs.create_parameter_specs_recursively()
    rng = np.random.RandomState(0)
    params = jax.tree.map(
        lambda spec: jnp.asarray(rng.randn(*spec.shape), jnp.float32), specs,
        is_leaf=is_parameter_spec,
    )
    for step in (3, 5):
        scaled = jax.tree.map(lambda x, s=step: x * s, params)
        _save(tmp_path, step, {"prng_key": jax.random.PRNGKey(1), "model": scaled,
                               "learner": {"mu": jnp.zeros([7])}})
    restored_step, restored = trainer_dir.restore_model_params(str(tmp_path), step=3)
    assert restored_step == 3
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b * 3), restored, params)
    latest, _ = trainer_dir.restore_model_params(str(tmp_path))
    assert latest == 5
    assert trainer_dir.read_trainer_config(str(tmp_path)).debug_string() == cfg.debug_string()


def test_a_directory_without_a_run_is_named(tmp_path):
    with pytest.raises(ConfigError, match="config.txt"):
        trainer_dir.read_trainer_config(str(tmp_path))


def test_the_tokenizer_recorded_in_the_shards_is_found_beside_them(tmp_path):
    tokenizer = tmp_path / "data" / "my_tokenizer.model"
    tokenizer.parent.mkdir()
    tokenizer.write_bytes(b"a SentencePiece model")
    record = VocabularyRecord(
        name="my_tokenizer.model", size=32, eos_id=1, kind="sentencepiece",
        sha256=file_sha256(str(tokenizer)),
    )
    shard = tmp_path / "data" / "train" / "shard-0.tok"
    shard.parent.mkdir()
    write_shard(str(shard), [np.arange(3, 9)], [6], vocabulary=record)
    cfg = _trainer_config(tmp_path)
    cfg.input = TokenShardInput.default_config().set(paths=[str(shard.parent / "*.tok")])
    cfg.evalers = {}
    assert trainer_dir.recorded_tokenizer(cfg) == str(tokenizer)
    # Another file of that name is not the tokenizer the shards record.
    tokenizer.write_bytes(b"another model")
    assert trainer_dir.recorded_tokenizer(cfg) is None


def test_the_builtin_corpus_records_bytes_and_a_warm_start_its_hf_tokenizer(tmp_path):
    cfg = _trainer_config(tmp_path)
    cfg.input = BuiltinTextInput.default_config()
    assert trainer_dir.recorded_tokenizer(cfg) == trainer_dir.BYTES_TOKENIZER
    (tmp_path / "tokenizer.json").write_text("{}")
    cfg.input, cfg.evalers = FakeLmInput.default_config(), {}  # Data without a vocabulary.
    assert trainer_dir.recorded_tokenizer(cfg) is None
    cfg.init_params = HfLlamaWeights.default_config().set(path=str(tmp_path))
    assert trainer_dir.recorded_tokenizer(cfg) == str(tmp_path / "tokenizer.json")
