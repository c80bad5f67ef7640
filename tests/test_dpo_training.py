"""DPO training end to end: the trainer on pairs made here raises the reward accuracy
and the chosen-minus-rejected margin; LoRA DPO from a Hugging Face directory trains the
adapters alone and resumes; synthetic pairs share their prompt."""

import json
import os
import re

import jax
import numpy as np
import pytest

from axlearn.common import hf_llama, lora
from axlearn.common.input_fake import FakePairInput
from axlearn.common.launch_trainer import build_trainer_config
from axlearn.common.utils import flatten_with_paths
from experiments import llama_dpo

PAIRS, LENGTH, PROMPT, VOCAB = 8, 16, 6, 128


class _FixedPairs(FakePairInput):
    """The same 8 pairs every step: the chosen response counts up from the prompt's last
    token, the rejected one is random."""

    def host_batch(self, step: int):
        del step
        rng = np.random.default_rng(0)
        prompts = rng.integers(3, VOCAB, size=(PAIRS, PROMPT))
        counting = (prompts[:, -1:] + np.arange(1, LENGTH + 2 - PROMPT)) % (VOCAB - 3) + 3
        random = rng.integers(3, VOCAB, size=counting.shape)
        batch = {}
        for side, response in (("chosen", counting), ("rejected", random)):
            tokens = np.concatenate([prompts, response], axis=1).astype(np.int32)
            weights = np.zeros((PAIRS, LENGTH), np.float32)
            weights[:, PROMPT - 1 :] = 1.0
            batch[f"{side}_input_ids"] = tokens[:, :-1]
            batch[f"{side}_target_labels"] = tokens[:, 1:]
            batch[f"{side}_target_weights"] = weights
        return batch


def _metrics(trainer_dir):
    with open(os.path.join(trainer_dir, "summaries", "train", "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.mark.slow
def test_dpo_raises_reward_accuracy_and_margin_within_100_steps(tmp_path):
    cfg = llama_dpo.llama_dpo_test_trainer()
    cfg.dir = str(tmp_path)
    cfg.input = _FixedPairs.default_config().set(
        global_batch_size=PAIRS, max_sequence_length=LENGTH, vocab_size=VOCAB, is_training=True
    )
    cfg.summary_writer.write_every_n_steps = 1
    trainer = cfg.instantiate(parent=None)
    trainer.run()
    rows = _metrics(str(tmp_path))
    first, last = rows[0], rows[-1]
    # Step 1 scores the starting weights, which the reference equals: no reward yet.
    assert first["step"] == 1 and first["model/rewards/accuracies"] == 0.0
    assert last["step"] <= 100
    assert last["model/rewards/accuracies"] > 0.9
    assert last["model/rewards/margins"] > first["model/rewards/margins"] + 1.0


def test_fake_pairs_share_their_prompt_and_weigh_only_the_response():
    pairs = FakePairInput.default_config().set(
        name="input", global_batch_size=2, max_sequence_length=8, vocab_size=50,
        prompt_length=3, is_training=True,
    ).instantiate(parent=None)
    batch = pairs.host_batch(0)
    assert {k: (v.shape, v.dtype) for k, v in batch.items()} == {
        k: (v.shape, v.dtype) for k, v in pairs.element_spec().items()
    }
    np.testing.assert_array_equal(batch["chosen_input_ids"][:, :3], batch["rejected_input_ids"][:, :3])
    assert np.any(batch["chosen_input_ids"][:, 3:] != batch["rejected_input_ids"][:, 3:])
    for side in ("chosen", "rejected"):
        np.testing.assert_array_equal(batch[f"{side}_target_weights"][0], [0, 0, 1, 1, 1, 1, 1, 1])
        np.testing.assert_array_equal(batch[f"{side}_input_ids"][:, 1:], batch[f"{side}_target_labels"][:, :-1])


def _write_hf_llama(directory):
    """A random tiny Llama as a Hugging Face directory (float32)."""
    lm = hf_llama.llama_model_config(
        vocab_size=VOCAB, dim=32, num_layers=2, num_heads=4, num_kv_heads=2, hidden_dim=64,
        repeated=False,  # As the recipe stacks its layers.
    )
    model = lm.clone(name="m").instantiate(parent=None)
    hf_llama.write_hf_model(
        jax.jit(model.initialize_parameters_recursively)(jax.random.PRNGKey(0)), lm,
        str(directory), dtype="float32",
    )


def _lora_dpo_trainer(hf_dir, run_dir, max_step):
    cfg = build_trainer_config(
        config_name="llama_dpo_lora_test", mesh_selector="cpu", init_from_hf=str(hf_dir),
        trainer_dir=str(run_dir),
        config_overrides=[f"max_step={max_step}", "checkpointer.save_policy.n=2",
                          "summary_writer.write_every_n_steps=1"],
    )
    return cfg.instantiate(parent=None)


def _flat(params):
    return {path: np.asarray(x) for path, x in flatten_with_paths(jax.device_get(params))}


@pytest.mark.slow
def test_lora_dpo_from_hf_trains_the_adapters_only_and_resumes(tmp_path):
    _write_hf_llama(tmp_path / "hf")
    trainer = _lora_dpo_trainer(tmp_path / "hf", tmp_path / "run", max_step=4)
    cfg = trainer.config
    assert cfg.model.reference == "adapters_disabled" and cfg.checkpoint_frozen_params is False
    # What the run starts from: the directory's base, fresh adapters (lora_up zero).
    specs = trainer.model_param_specs
    cpu = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
    start = _flat(cfg.init_params.instantiate().load(
        model_config=cfg.model, param_specs=specs,
        shardings=jax.tree.map(lambda _: cpu, specs, is_leaf=lambda x: hasattr(x, "shape")),
    ))
    assert set(path.split("/")[0] for path in start) == {"policy"}  # No reference copy.
    trainer.run()
    assert trainer.step == 4
    adapters = {path for path in start if re.fullmatch(lora.ADAPTER_PARAM_REGEX, path)}
    assert len(adapters) == 2 * 2 * 5  # Two layers; q/k/v fused, o, gate, up, down.
    trained = _flat(trainer.model_params())
    for path, value in start.items():
        if path in adapters:
            assert np.any(value != trained[path]), path
        else:
            np.testing.assert_array_equal(trained[path], value, err_msg=path)
    # The checkpoint holds the adapters alone (and the base's fingerprint) ...
    with open(tmp_path / "run" / "checkpoints" / "step_00000004" / "index.json") as f:
        index = json.load(f)
    saved = {path[len("model/"):] for path in index["arrays"] if path.startswith("model/")}
    assert saved == adapters and "frozen_params_fingerprint" in index["extra"]
    # ... and a resumed run takes the base from the Hugging Face directory again (checked
    # by that fingerprint) and goes on from step 4.
    resumed = _lora_dpo_trainer(tmp_path / "hf", tmp_path / "run", max_step=6)
    resumed.run()
    assert [row["step"] for row in _metrics(str(tmp_path / "run"))] == [1, 2, 3, 4, 5, 6]
    final = _flat(resumed.model_params())
    for path, value in start.items():
        if path not in adapters:
            np.testing.assert_array_equal(final[path], value, err_msg=path)
