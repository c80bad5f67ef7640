"""Chat and pair shards: `build --chat/--pairs`, target_weights, pair batches, bad input."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from axlearn.common.base_layer import is_parameter_spec
from axlearn.common.experiment_registry import build_named_config
from axlearn.common.hf_llama import llama_model_config
from axlearn.common.input_base import InputError
from axlearn.common.input_mixture import TokenShardMixtureInput
from axlearn.common.input_packing import FEATURE_KEYS
from axlearn.common.input_pairs import PAIR_KEYS, PreferencePairInput
from axlearn.common.input_token_format import TokenShard
from axlearn.common.input_tokens import TokenShardInput, _cli, main
from axlearn.common.launch_data import use_data_dir
from axlearn.common.module import functional as F

# A template for the byte vocabulary (no special tokens): <role>content</role> per turn.
TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</{{ m['role'] }}>\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
EOS = 1


def _ids(text: str) -> list[int]:
    return [b + 3 for b in text.encode("utf-8")]


def _expected(messages, *, train_on="assistant"):
    """(stored tokens, loss mask, trained bytes) of a conversation, rendered by hand."""
    ids, mask, trained = [], [], 0
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    for i, m in enumerate(messages):
        head, body = f"<{m['role']}>", f"{m['content']}</{m['role']}>\n"
        trains = train_on == "all" or (
            m["role"] == "assistant" and (train_on == "assistant" or i == last)
        )
        ids += _ids(head + body)
        mask += [int(train_on == "all")] * len(_ids(head)) + [int(trains)] * len(_ids(body))
        trained += len(body.encode()) if trains else 0
        trained += len(head.encode()) if train_on == "all" else 0
    return ids + [EOS], mask + [mask[-1]], trained


CONVERSATIONS = [
    [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello é"},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
    ],
    [{"role": "user", "content": "name?"}, {"role": "assistant", "content": "axlearn"}],
    [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y" * 30}],
]


def _write(path, records) -> str:
    with open(path, "w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")
    return str(path)


def _build(tmp_path, records, *flags) -> str:
    (tmp_path / "t.jinja").write_text(TEMPLATE)
    data = _write(tmp_path / "chat.jsonl", records)
    out = tmp_path / "out"
    main(["build", "--vocab=bytes", f"--chat_template={tmp_path / 't.jinja'}",
          f"--output={out}/", *flags, data])
    return str(out)


def _eval_batches(out, length=16, batch=2):
    cfg = TokenShardInput.default_config().set(
        name="input", is_training=False, global_batch_size=batch, max_sequence_length=length,
        paths=[f"{out}/train-*.tok"],
    )
    return list(cfg.instantiate(parent=None, process_index=0, process_count=1).dataset())


def _stream(batches, key):
    return np.concatenate([b[key].reshape(-1) for b in batches])


@pytest.mark.parametrize("train_on", ["assistant", "last_turn", "all"])
def test_chat_batches_carry_the_loss_mask_of_each_role_as_target_weights(tmp_path, train_on):
    out = _build(tmp_path, [{"messages": m} for m in CONVERSATIONS], "--chat",
                 f"--train_on={train_on}")
    expected = [_expected(m, train_on=train_on) for m in CONVERSATIONS]
    tokens = np.concatenate([e[0] for e in expected])
    weights = np.concatenate([e[1] for e in expected])
    batches = _eval_batches(out)
    assert set(batches[0]) == {*FEATURE_KEYS, "target_weights"}
    assert batches[0]["target_weights"].dtype == np.float32
    n = tokens.size
    np.testing.assert_array_equal(_stream(batches, "target_labels")[:n], tokens)
    np.testing.assert_array_equal(_stream(batches, "target_weights")[:n], weights)
    assert not _stream(batches, "target_weights")[n:].any()  # Padding trains nothing.
    total_bytes = sum(int(b["target_num_bytes"].sum()) for b in batches)
    assert total_bytes == sum(e[2] for e in expected)


def test_prompt_completion_records_train_on_the_completion(tmp_path):
    out = _build(tmp_path, [{"prompt": "hi", "completion": "yo"}], "--chat")
    shard = TokenShard(f"{out}/train-00000.tok")
    tokens, mask, _ = _expected(
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    )
    np.testing.assert_array_equal(shard.tokens, tokens)
    np.testing.assert_array_equal(shard.loss_mask, mask)
    assert shard.manifest["chat"]["train_on"] == "assistant"


def test_masked_shards_are_version_3_and_plain_shards_stay_version_2(tmp_path):
    out = _build(tmp_path, [{"messages": CONVERSATIONS[1]}], "--chat")
    plain = tmp_path / "plain"
    main(["build", "--vocab=bytes", f"--output={plain}/",
          _write(tmp_path / "t.jsonl", [{"text": "abc"}])])
    with open(f"{out}/train-00000.tok", "rb") as f:
        assert f.read(12)[8:] == (3).to_bytes(4, "little")
    with open(f"{plain}/train-00000.tok", "rb") as f:
        assert f.read(12)[8:] == (2).to_bytes(4, "little")
    assert set(_eval_batches(str(plain))[0]) == set(FEATURE_KEYS)


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"messages": [{"role": "user", "content": "q"}]}, "no assistant turn"),
        ({"messages": [{"role": "asistant", "content": "q"}]}, "unknown role 'asistant'"),
    ],
)
def test_bad_chat_record_is_one_line_naming_file_and_line_and_nothing_is_left(
    tmp_path, capsys, bad, message
):
    (tmp_path / "t.jinja").write_text(TEMPLATE)
    data = _write(tmp_path / "chat.jsonl", [{"messages": CONVERSATIONS[1]}, bad])
    out = tmp_path / "out"
    code = _cli(["build", "--chat", "--vocab=bytes", f"--chat_template={tmp_path / 't.jinja'}",
                 f"--output={out}/", data])
    err = capsys.readouterr().err
    assert code == 1
    assert err.startswith(f"error: {data}:2: ") and message in err and err.count("\n") == 1
    assert not out.exists()


def test_byte_vocabulary_without_chat_template_flag_is_refused(tmp_path, capsys):
    data = _write(tmp_path / "chat.jsonl", [{"messages": CONVERSATIONS[1]}])
    assert _cli(["build", "--chat", "--vocab=bytes", f"--output={tmp_path}/o/", data]) == 1
    assert "no chat template" in capsys.readouterr().err


PAIRS = [
    {"prompt": "2+2?", "chosen": "4", "rejected": "five, surely"},
    {"prompt": [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}],
     "chosen": [{"role": "assistant", "content": "hello"}], "rejected": "go away"},
]


def _pair_input(out, length, **kwargs):
    cfg = PreferencePairInput.default_config().set(
        name="pairs", global_batch_size=2, max_sequence_length=length,
        paths=[f"{out}/train-*.tok"], **kwargs,
    )
    return cfg.instantiate(parent=None, process_index=0, process_count=1)


def _messages(value, role):
    return [{"role": role, "content": value}] if isinstance(value, str) else value


def test_pair_batches_hold_each_side_with_weights_on_its_response(tmp_path):
    out = _build(tmp_path, PAIRS, "--pairs", "--max_sequence_length=50")
    batch = next(iter(_pair_input(out, 50, is_training=False).dataset()))
    assert set(batch) == set(PAIR_KEYS)
    for row, pair in enumerate(PAIRS):
        prompt = _messages(pair["prompt"], "user")
        for side in ("chosen", "rejected"):
            messages = prompt + _messages(pair[side], "assistant")
            tokens, _, _ = _expected(messages)
            prompt_len = len(_ids("".join(f"<{m['role']}>{m['content']}</{m['role']}>\n"
                                          for m in prompt) + "<assistant>"))
            n = min(len(tokens), 50)
            labels = batch[f"{side}_target_labels"][row]
            np.testing.assert_array_equal(labels[:n], tokens[:n])
            assert not labels[n:].any()
            np.testing.assert_array_equal(batch[f"{side}_input_ids"][row, :n],
                                          [EOS] + tokens[: n - 1])
            weights = batch[f"{side}_target_weights"][row]
            np.testing.assert_array_equal(
                weights, [0] * prompt_len + [1] * (n - prompt_len) + [0] * (50 - n)
            )


def test_pair_training_order_is_a_permutation_per_epoch_and_resumes(tmp_path):
    out = _build(tmp_path, PAIRS * 3, "--pairs", "--max_sequence_length=50")
    pairs = _pair_input(out, 50, is_training=True)
    seen = np.concatenate([pairs.pair_indices(step) for step in range(3)])
    assert sorted(seen.tolist()) == list(range(6))
    pairs.set_state({"batches_consumed": 2})
    resumed = next(iter(pairs.dataset()))
    np.testing.assert_array_equal(resumed["chosen_target_labels"],
                                  pairs.host_batch(2)["chosen_target_labels"])


def test_pair_missing_rejected_is_named_and_nothing_is_left(tmp_path, capsys):
    (tmp_path / "t.jinja").write_text(TEMPLATE)
    data = _write(tmp_path / "p.jsonl", [PAIRS[0], {"prompt": "q", "chosen": "a"}])
    code = _cli(["build", "--pairs", "--max_sequence_length=50", "--vocab=bytes",
                 f"--chat_template={tmp_path / 't.jinja'}", f"--output={tmp_path}/o/", data])
    err = capsys.readouterr().err
    assert code == 1 and err.startswith(f"error: {data}:2: ") and "'rejected'" in err
    assert not os.path.exists(tmp_path / "o")


def test_pair_prompt_longer_than_the_sequence_is_named(tmp_path, capsys):
    (tmp_path / "t.jinja").write_text(TEMPLATE)
    data = _write(tmp_path / "p.jsonl", [{"prompt": "q" * 50, "chosen": "a", "rejected": "b"}])
    code = _cli(["build", "--pairs", "--max_sequence_length=32", "--vocab=bytes",
                 f"--chat_template={tmp_path / 't.jinja'}", f"--output={tmp_path}/o/", data])
    err = capsys.readouterr().err
    assert code == 1 and err.startswith(f"error: {data}:1: the prompt is 75 tokens")


def test_pair_input_refuses_a_shorter_row_than_a_prompt_and_chat_shards(tmp_path):
    out = _build(tmp_path, PAIRS, "--pairs", "--max_sequence_length=50")
    with pytest.raises(InputError, match=r"pair 0's prompt is 29 tokens.*max_sequence_length=20"):
        _pair_input(out, 20, is_training=False)
    (tmp_path / "c").mkdir()
    chat = _build(tmp_path / "c", [{"messages": CONVERSATIONS[1]}], "--chat")
    with pytest.raises(InputError, match="holds no preference pairs"):
        _pair_input(chat, 40, is_training=False)
    with pytest.raises(InputError, match="holds preference pairs"):
        _eval_batches(out)


def test_packed_chat_documents_do_not_see_each_other(tmp_path):
    out = _build(tmp_path, [{"messages": m} for m in CONVERSATIONS], "--chat")
    batch = _eval_batches(out, length=128, batch=2)[0]
    segments = batch["input_segment_ids"][0]
    assert segments.max() >= 2  # Row 0 packs two documents.
    second = segments == 2
    assert batch["input_positions"][0][second][0] == 0  # Positions restart.
    model = llama_model_config(
        vocab_size=259, dim=16, num_layers=1, num_heads=4, num_kv_heads=2, hidden_dim=24
    ).instantiate(parent=None)
    rng = np.random.default_rng(0)
    params = jax.tree.map(
        lambda spec: jnp.asarray(0.3 * rng.standard_normal(spec.shape), jnp.float32),
        model.create_parameter_specs_recursively(),
        is_leaf=is_parameter_spec,
    )
    run = jax.jit(lambda b: F(model, state=params, inputs=(b,), prng_key=None,
                              is_training=False)[0][1]["logits"])
    changed = dict(batch)
    changed["input_ids"] = batch["input_ids"].copy()
    changed["input_ids"][0][segments == 1] = 7  # Another first document.
    before = run({k: jnp.asarray(v) for k, v in batch.items()})
    after = run({k: jnp.asarray(v) for k, v in changed.items()})
    np.testing.assert_array_equal(before[0][second], after[0][second])
    assert not np.allclose(before[0][segments == 1], after[0][segments == 1])


def test_a_mixture_of_chat_and_plain_shards_weights_plain_rows_one(tmp_path):
    chat = _build(tmp_path, [{"messages": m} for m in CONVERSATIONS], "--chat")
    plain = tmp_path / "plain"
    main(["build", "--vocab=bytes", f"--output={plain}/",
          _write(tmp_path / "t.jsonl", [{"text": "plain text " * 9}])])
    cfg = TokenShardMixtureInput.default_config().set(
        name="mix", is_training=True, global_batch_size=8, max_sequence_length=16,
        sources=[TokenShardInput.default_config().set(paths=[f"{d}/train-*.tok"])
                 for d in (chat, plain)],
        weights=[1, 1],
    )
    mixture = cfg.instantiate(parent=None, process_index=0, process_count=1)
    batch = next(iter(mixture.dataset()))
    sources = mixture.row_sources(0)
    assert {0, 1} <= set(sources.tolist())
    assert batch["target_weights"][sources == 1].all()
    assert not batch["target_weights"][sources == 0].all()


def test_reference_logps_file_adds_each_pairs_reference_log_probabilities(tmp_path):
    out = _build(tmp_path, PAIRS, "--pairs", "--max_sequence_length=50")
    reference = np.array([[-1.5, -2.5], [-3.0, -4.25]], np.float32)
    np.save(tmp_path / "ref.npy", reference)
    pairs = _pair_input(out, 50, is_training=True, shuffle=True, seed=3,
                        reference_logps=str(tmp_path / "ref.npy"))
    batch = pairs.host_batch(1)
    order = pairs.pair_indices(1)
    np.testing.assert_array_equal(batch["reference_chosen_logps"], reference[order, 0])
    np.testing.assert_array_equal(batch["reference_rejected_logps"], reference[order, 1])
    np.save(tmp_path / "bad.npy", reference[:1])
    with pytest.raises(InputError, match=r"reference_logps: .*bad.npy holds float32 \(1, 2\)"):
        _pair_input(out, 50, is_training=False, reference_logps=str(tmp_path / "bad.npy"))


@pytest.mark.slow
def test_chat_build_with_several_workers_equals_one_worker(tmp_path, monkeypatch):
    from axlearn.common import input_tokens  # pylint: disable=import-outside-toplevel

    monkeypatch.setattr(input_tokens, "_RECORD_CHUNK", 2)  # Several tasks for the pool.
    records = [{"messages": m} for m in CONVERSATIONS] * 3 + [{"prompt": "a", "completion": "b"}]
    (tmp_path / "t.jinja").write_text(TEMPLATE)
    data = _write(tmp_path / "chat.jsonl", records)
    contents = []
    for workers in (1, 2):
        out = tmp_path / f"out{workers}"
        main(["build", "--chat", "--vocab=bytes", f"--chat_template={tmp_path / 't.jinja'}",
              f"--num_workers={workers}", f"--output={out}/", data])
        contents.append((out / "train-00000.tok").read_bytes())
    assert contents[0] == contents[1]


def test_data_dir_keeps_a_pair_input_and_points_it_at_the_pair_shards(tmp_path):
    out = _build(tmp_path, PAIRS, "--pairs", "--max_sequence_length=50")
    cfg = build_named_config("gpt_test").set(evalers={})
    cfg.input = PreferencePairInput.default_config().set(
        is_training=True, global_batch_size=2, max_sequence_length=50, paths=["elsewhere"], seed=7
    )
    cfg, _ = use_data_dir(cfg, out)
    assert cfg.input.klass is PreferencePairInput
    assert cfg.input.paths == [f"{out}/train-*.tok"] and cfg.input.seed == 7
    assert cfg.input.max_sequence_length == 50
