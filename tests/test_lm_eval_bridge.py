"""The lm-eval bridge: per-example log-likelihoods and accuracies against lm-eval's own
Hugging Face backend on the same weights (exported by our hf_llama), on a multiple-choice
and a generation task made here (local JSON files and task YAMLs); bad tasks are refused
in one line."""

import json
import os

import jax
import numpy as np
import pytest

from axlearn.common import generate, hf_llama
from axlearn.common.input_vocab import load_vocabulary


def _bridge():
    """The bridge, imported when a test runs (lm-eval's import takes seconds); the tests
    skip where lm-eval (the eval extra) is not installed."""
    pytest.importorskip("lm_eval")
    return pytest.importorskip("axlearn.common.lm_eval_bridge")

WORDS = [f"w{i}" for i in range(40)]


def _write_tokenizer(directory: str) -> str:
    """A word-level tokenizer.json (and the tokenizer_config.json that names its special
    tokens) built with the `tokenizers` library."""
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"<unk>": 0, "</s>": 1, "<s>": 2, ".": 3}
    vocab.update({word: i + 4 for i, word in enumerate(WORDS)})
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = tokenizers.decoders.WordPiece(prefix="##")  # Joins words with spaces.
    tokenizer.add_special_tokens(["<unk>", "</s>", "<s>"])
    path = os.path.join(directory, "tokenizer.json")
    tokenizer.save(path)
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump(dict(tokenizer_class="PreTrainedTokenizerFast", eos_token="</s>",
                       bos_token="<s>", unk_token="<unk>", pad_token="<unk>"), f)
    return path


def _write_tasks(directory: str) -> None:
    rng = np.random.default_rng(0)
    mc = [dict(question=" ".join(rng.choice(WORDS, 5)), choices=list(rng.choice(WORDS, 3)),
               answer=int(rng.integers(3))) for _ in range(6)]
    gen = [dict(prompt=" ".join(rng.choice(WORDS, 4)), target=str(rng.choice(WORDS)))
           for _ in range(4)]
    for name, rows in (("mc", mc), ("gen", gen)):
        with open(os.path.join(directory, f"{name}.json"), "w") as f:
            f.write("\n".join(json.dumps(row) for row in rows))
    common = "dataset_path: json\ntest_split: test\n"
    with open(os.path.join(directory, "tiny_mc.yaml"), "w") as f:
        f.write(
            f"task: tiny_mc\n{common}dataset_kwargs:\n  data_files:\n"
            f"    test: {directory}/mc.json\noutput_type: multiple_choice\n"
            'doc_to_text: "{{question}}"\ndoc_to_choice: "{{choices}}"\n'
            'doc_to_target: "{{answer}}"\nmetric_list:\n  - metric: acc\n'
        )
    with open(os.path.join(directory, "tiny_gen.yaml"), "w") as f:
        f.write(
            f"task: tiny_gen\n{common}dataset_kwargs:\n  data_files:\n"
            f"    test: {directory}/gen.json\noutput_type: generate_until\n"
            'doc_to_text: "{{prompt}}"\ndoc_to_target: "{{target}}"\n'
            "generation_kwargs:\n  until: [\".\"]\n  max_gen_toks: 6\n  do_sample: false\n"
            "metric_list:\n  - metric: exact_match\n"
        )
    with open(os.path.join(directory, "tiny_missing.yaml"), "w") as f:
        f.write(
            f"task: tiny_missing\n{common}dataset_kwargs:\n  data_files:\n"
            f"    test: {directory}/no_such_file.json\noutput_type: generate_until\n"
            'doc_to_text: "{{prompt}}"\ndoc_to_target: "{{target}}"\n'
        )


@pytest.fixture(name="offline")
def offline_fixture(tmp_path, monkeypatch):
    """Hugging Face's caches under tmp_path and no network."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    _write_tasks(str(tasks))
    return str(tasks)


def _samples(results, task):
    return sorted(results["samples"][task], key=lambda s: s["doc_id"])


@pytest.mark.slow
def test_loglikelihoods_and_generations_match_lm_eval_hf_backend(tmp_path, offline):
    import lm_eval  # pylint: disable=import-outside-toplevel

    hf_dir = str(tmp_path / "hf")
    os.makedirs(hf_dir)
    tokenizer = _write_tokenizer(hf_dir)
    cfg = hf_llama.llama_model_config(
        vocab_size=48, dim=32, num_layers=2, num_heads=4, num_kv_heads=2, hidden_dim=64,
        pad_token_id=0, eos_token_id=1,
    )
    params = cfg.clone(name="model").instantiate(parent=None).initialize_parameters_recursively(
        jax.random.PRNGKey(0)
    )
    # Larger weights than the initializer's: sharper distributions, no near-ties in argmax.
    params = jax.tree.map(lambda p: p * 4.0 if p.ndim > 1 else p, params)
    hf_llama.write_hf_model(params, cfg, hf_dir, dtype="float32")

    tasks = ["tiny_mc", "tiny_gen"]
    manager = _bridge().task_manager(offline, include_registry=False)
    ours = _bridge().AxlearnLM(
        generator=generate.Generator(cfg, params),
        vocab=load_vocabulary(tokenizer, any_special_ids=True),
        batch_size=4, max_length=64,
    )
    our_results = _bridge().evaluate(ours, tasks, manager=manager, log_samples=True)
    hf_results = lm_eval.simple_evaluate(
        model="hf", model_args=f"pretrained={hf_dir},dtype=float32,max_length=64",
        tasks=tasks, task_manager=manager, batch_size=1, log_samples=True, device="cpu",
    )
    assert len(_samples(our_results, "tiny_mc")) == len(_samples(hf_results, "tiny_mc")) == 6
    generated = [sample["resps"][0][0] for sample in _samples(our_results, "tiny_gen")]
    assert len(generated) == 4 and all(generated), generated  # Words were generated.
    for ours_sample, hf_sample in zip(_samples(our_results, "tiny_mc"), _samples(hf_results, "tiny_mc")):
        ours_ll = [resp[0][0] for resp in ours_sample["resps"]]
        hf_ll = [resp[0][0] for resp in hf_sample["resps"]]
        np.testing.assert_allclose(ours_ll, hf_ll, atol=1e-4)
        assert ours_sample["acc"] == hf_sample["acc"]
    for ours_sample, hf_sample in zip(_samples(our_results, "tiny_gen"), _samples(hf_results, "tiny_gen")):
        assert ours_sample["resps"] == hf_sample["resps"]
        assert ours_sample["exact_match"] == hf_sample["exact_match"]


def test_unknown_task_is_one_line_naming_it(offline):
    manager = _bridge().task_manager(offline, include_registry=False)
    with pytest.raises(_bridge().TaskError, match="unknown lm-eval task 'tiny_mcq'.*tiny_mc") as e:
        _bridge().check_tasks(["tiny_mcq"], manager)
    assert "\n" not in str(e.value)


def test_task_whose_data_cannot_be_read_is_one_line_naming_it(offline):
    manager = _bridge().task_manager(offline, include_registry=False)
    with pytest.raises(_bridge().TaskError, match="task 'tiny_missing': its data cannot be read") as e:
        _bridge().load_tasks(["tiny_missing"], manager)
    assert "\n" not in str(e.value)


# ----- in training, and the run's policy out -----


@pytest.fixture(name="dpo_run", scope="module")
def dpo_run_fixture(tmp_path_factory):
    """A 4-step llama_dpo_test run with an LmEvalEvaler on the local tasks at step 4."""
    # pylint: disable-next=import-outside-toplevel
    from experiments import llama_dpo

    root = tmp_path_factory.mktemp("dpo_run")
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setenv("HF_HOME", str(root / "hf_home"))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    tasks = root / "tasks"
    tasks.mkdir()
    _write_tasks(str(tasks))
    tokenizer = _write_tokenizer(str(root))
    cfg = llama_dpo.llama_dpo_test_trainer().set(max_step=4, dir=str(root / "run"))
    cfg.evalers["lm_eval"] = _bridge().LmEvalEvaler.default_config().set(
        tasks=["tiny_mc"], tokenizer=tokenizer, include_path=str(tasks), include_registry=False,
        max_length=32,
    )
    cfg.evalers["lm_eval"].eval_policy.set(n=4, max_step=4)
    # pylint: disable-next=import-outside-toplevel
    from axlearn.common import run_record
    from axlearn.common.run_dir import RunDir

    os.makedirs(cfg.dir)
    run_record.record_config(RunDir(cfg.dir), cfg.debug_string(), allow_change=False, write=True)
    cfg.instantiate(parent=None).run()
    yield str(root / "run")
    monkeypatch.undo()


@pytest.mark.slow
def test_lm_eval_evaler_writes_task_metrics_beside_the_loss(dpo_run):
    with open(os.path.join(dpo_run, "summaries", "lm_eval", "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    assert [row["step"] for row in rows] == [4]
    assert 0.0 <= rows[0]["lm_eval/tiny_mc/acc"] <= 1.0


@pytest.mark.slow
def test_export_of_a_dpo_run_writes_its_policy(dpo_run, tmp_path):
    safetensors = pytest.importorskip("safetensors.numpy")
    # pylint: disable-next=import-outside-toplevel
    from axlearn.common import trainer_dir

    out = str(tmp_path / "hf")
    hf_llama.export_trainer_dir(dpo_run, out, dtype="float32")
    exported = safetensors.load_file(os.path.join(out, "model.safetensors"))
    _, params = trainer_dir.restore_model_params(dpo_run)
    table = exported["model.embed_tokens.weight"]
    np.testing.assert_array_equal(table, np.asarray(params["policy"]["decoder"]["emb"]["token_emb"]["weight"]))
    assert np.any(table != np.asarray(params["reference"]["decoder"]["emb"]["token_emb"]["weight"]))


# ----- lm-eval's CLI, as a process -----


def _cli(tmp_path, tasks_dir, *args):
    # pylint: disable-next=import-outside-toplevel
    import subprocess
    import sys

    env = dict(os.environ, HF_HOME=str(tmp_path / "hf_home"), HF_DATASETS_OFFLINE="1",
               HF_HUB_OFFLINE="1", PYTHONPATH=os.getcwd(), JAX_PLATFORMS="cpu")
    return subprocess.run(
        [sys.executable, "-m", "axlearn.common.lm_eval_bridge", "run", "--model", "axlearn",
         "--include_path", tasks_dir, *args],
        env=env, capture_output=True, text=True, timeout=600, check=False,
    )


@pytest.fixture(name="tiny_hf_dir")
def tiny_hf_dir_fixture(tmp_path):
    hf_dir = str(tmp_path / "hf")
    os.makedirs(hf_dir)
    _write_tokenizer(hf_dir)
    cfg = hf_llama.llama_model_config(
        vocab_size=48, dim=16, num_layers=1, num_heads=2, num_kv_heads=1, hidden_dim=32,
    )
    params = cfg.clone(name="model").instantiate(parent=None).initialize_parameters_recursively(
        jax.random.PRNGKey(0)
    )
    hf_llama.write_hf_model(params, cfg, hf_dir, dtype="float32")
    return hf_dir


@pytest.mark.slow
def test_lm_eval_cli_runs_a_local_task_on_an_hf_dir(tmp_path, offline, tiny_hf_dir):
    result = _cli(tmp_path, offline, "--model_args", f"hf_dir={tiny_hf_dir},max_length=32",
                  "--tasks", "tiny_mc", "--output_path", str(tmp_path / "out"))
    assert result.returncode == 0, result.stderr[-2000:]
    assert "tiny_mc" in result.stdout and "acc" in result.stdout


@pytest.mark.slow
def test_lm_eval_cli_unknown_task_is_one_line(tmp_path, offline, tiny_hf_dir):
    result = _cli(tmp_path, offline, "--model_args", f"hf_dir={tiny_hf_dir}", "--tasks", "tiny_mcq")
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("lm_eval_bridge: ") and "tiny_mcq" in last


@pytest.mark.slow
def test_rolling_loglikelihoods_over_several_windows_match_lm_eval_hf_backend(tiny_hf_dir):
    # pylint: disable-next=import-outside-toplevel
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    rng = np.random.default_rng(1)
    texts = [" ".join(rng.choice(WORDS, n)) for n in (5, 23, 40)]  # 1, 2 and 3 windows of 16.

    def requests():
        return [Instance(request_type="loglikelihood_rolling", doc={}, arguments=(t,), idx=0)
                for t in texts]

    ours = _bridge().AxlearnLM(hf_dir=tiny_hf_dir, dtype="float32", max_length=16, batch_size=2)
    hf = HFLM(pretrained=tiny_hf_dir, dtype="float32", max_length=16, batch_size=1, device="cpu")
    np.testing.assert_allclose(
        ours.loglikelihood_rolling(requests()), hf.loglikelihood_rolling(requests()), atol=1e-4
    )
