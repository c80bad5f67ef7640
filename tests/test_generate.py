"""generate: batched decoding against transformers' `generate`, and the command."""

import io
import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from axlearn import bench
from axlearn.bench import KernelEvent
from axlearn.common import generate, hf_llama
from axlearn.common.decoder import prompt_lengths_of
from tests.fresh_python import REPO, fresh_env
from tools import generate_bench

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB = 64


def _hf_model(seed=1, num_kv_heads=2):
    """A random Llama without pad, bos or eos ids; weights of std 0.2 (the default 0.02
    makes a tiny model repeat its last token)."""
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=num_kv_heads, head_dim=8, rope_theta=10000.0,
        initializer_range=0.2, bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    return transformers.LlamaForCausalLM(config).eval()


def _hf_greedy(hf, prompt, max_new_tokens, eos_ids):
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos_ids,
            pad_token_id=eos_ids[0] if eos_ids else 0,
        )
    return out[0, len(prompt):].tolist()


def test_prompt_lengths_count_pad_ids_inside_a_prompt():
    prompts = jnp.asarray([[5, 0, 7, 0, 0], [0, 0, 3, 4, 9], [6, 0, 0, 0, 0]])
    np.testing.assert_array_equal(prompt_lengths_of(prompts, 0), [3, 5, 1])
    np.testing.assert_array_equal(prompt_lengths_of(prompts, None), [5, 5, 5])


@pytest.mark.slow
def test_batched_greedy_generation_equals_transformers_with_a_list_of_eos_ids():
    hf = _hf_model()
    # Prompts of different lengths holding token 0 (a real token: there is no pad id).
    prompts = [[0, 12, 0, 40], [7, 0], [0], [33, 21, 0, 5, 0, 9, 0]]
    free = [_hf_greedy(hf, p, 8, None) for p in prompts]
    # End-of-turn style ids: tokens that the greedy continuations produce part-way.
    eos_ids = sorted({free[0][3], free[1][2]})
    expected = [_hf_greedy(hf, p, 8, eos_ids) for p in prompts]
    lengths = sorted(len(e) for e in expected)
    assert lengths[0] < 8 and lengths[-1] == 8, lengths  # Rows stop at either id, or run on.
    cfg = hf_llama.llama_config_from_hf(hf.config)
    cfg.decoder.eos_token_id = eos_ids
    assert cfg.decoder.pad_token_id is None
    generator = generate.Generator(cfg, hf_llama.params_from_hf(hf.state_dict(), cfg))
    outputs, stats = generator.generate(prompts, max_new_tokens=8, batch_size=4)
    assert outputs == expected
    assert stats.new_tokens == sum(len(e) for e in expected)


@pytest.mark.slow
def test_sampling_with_top_k_1_equals_greedy():
    hf = _hf_model(seed=2)
    cfg = hf_llama.llama_config_from_hf(hf.config)
    generator = generate.Generator(cfg, hf_llama.params_from_hf(hf.state_dict(), cfg))
    prompts = [[1, 2, 3], [4, 0]]
    greedy, _ = generator.generate(prompts, max_new_tokens=5, batch_size=2)
    sampled, _ = generator.generate(
        prompts, max_new_tokens=5, batch_size=2,
        sampling=generate.Sampling(temperature=0.7, top_k=1, seed=3),
    )
    assert sampled == greedy


def _tokenizer_files(directory):
    """A word-level tokenizer.json: '!' is id 0, then <s>, </s>, then w0..w60."""
    tokenizers = pytest.importorskip("tokenizers")
    words = ["!", "<s>", "</s>"] + [f"w{i}" for i in range(VOCAB - 3)]
    tokenizer = tokenizers.Tokenizer(
        tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="!")
    )
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(["<s>", "</s>"])
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>"})
    )


@pytest.mark.slow
def test_the_command_generates_from_a_hf_directory_with_its_tokenizer(tmp_path, capsys):
    hf = _hf_model(seed=3)
    hf.save_pretrained(tmp_path, max_shard_size="20KB")  # Sharded, with an index.
    _tokenizer_files(tmp_path)
    prompts = ["w3 ! w7", "! w12"]
    args = generate.parse_flags([
        f"--hf_dir={tmp_path}", f"--prompt={prompts[0]}", f"--prompt={prompts[1]}",
        "--max_new_tokens=6", "--batch_size=2", "--dtype=float32",
    ])
    stats = generate.run(args)
    captured = capsys.readouterr()
    printed = captured.out  # The text alone; the speed line goes to stderr.
    assert f"{stats.new_tokens} tokens generated" in captured.err and "tokens/s" in captured.err
    assert "tokens/s" not in printed
    # The same ids through transformers: <s> (id 1) then the words' ids.
    for text in prompts:
        ids = [1] + [0 if w == "!" else int(w[1:]) + 3 for w in text.split()]
        new = _hf_greedy(hf, ids, 6, None)
        words = ["!" if i == 0 else f"w{i - 3}" for i in new]
        assert " ".join(text.split() + words) in printed


@pytest.mark.slow
def test_streaming_delivers_the_first_token_after_prefill_then_each_chunk():
    hf = _hf_model(seed=4)
    prompt = [3, 9, 27]
    expected = _hf_greedy(hf, prompt, 8, None)
    cfg = hf_llama.llama_config_from_hf(hf.config)
    generator = generate.Generator(cfg, hf_llama.params_from_hf(hf.state_dict(), cfg))
    pieces = []
    outputs, _ = generator.generate(
        [prompt], max_new_tokens=8, batch_size=1, chunk_size=3,
        on_tokens=lambda index, ids: pieces.append((index, ids)),
    )
    # 1 token from prefill, then 7 in chunks of 3 (the last one cut at max_new_tokens).
    assert [len(ids) for _, ids in pieces] == [1, 3, 3, 1]
    assert [t for _, ids in pieces for t in ids] == outputs[0] == expected


def _save_hf_dir(directory, *, seed, num_kv_heads=2):
    hf = _hf_model(seed=seed, num_kv_heads=num_kv_heads)
    hf.save_pretrained(directory)
    _tokenizer_files(directory)
    return hf


def _run_command(*args, devices):
    return subprocess.run(
        [sys.executable, "-m", "axlearn.common.generate", *args],
        cwd=REPO, env=fresh_env(devices), capture_output=True, text=True, timeout=300,
        check=False,
    )


class _Writes:
    """A text stream that keeps each write apart."""

    def __init__(self):
        self.writes = []

    def write(self, text):
        self.writes.append(text)

    def flush(self):
        pass


@pytest.mark.slow
def test_the_command_streams_a_completion_in_pieces_that_make_the_printed_text(tmp_path):
    hf = _save_hf_dir(tmp_path, seed=5)
    fv = generate.parse_flags([
        f"--hf_dir={tmp_path}", "--prompt=w3 ! w7", "--max_new_tokens=7", "--batch_size=1",
        "--chunk_size=2", "--dtype=float32",
    ])
    out = _Writes()
    generate.run(fv, out=out)
    new = _hf_greedy(hf, [1, 6, 0, 10], 7, None)
    words = ["!" if i == 0 else f"w{i - 3}" for i in new]
    completion = " ".join(["w3", "!", "w7", *words])
    # The prompt with the first token, then the words of each chunk of 2 as they came.
    text_writes = out.writes[: out.writes.index("\n")]
    assert "".join(text_writes) == completion
    assert len(text_writes) == 4


@pytest.mark.slow  # Loads and compiles the command's model: 9 s of CPU.
def test_the_speed_line_counts_one_prompt_and_names_the_batch_it_was_padded_to(tmp_path):
    hf = _save_hf_dir(tmp_path, seed=9)
    fv = generate.parse_flags([
        f"--hf_dir={tmp_path}", "--prompt=w3 ! w7", "--max_new_tokens=3", "--dtype=float32",
    ])  # --batch_size: its default, 8.
    out, err = io.StringIO(), io.StringIO()
    generate.run(fv, out=out, err=err)
    assert "tokens/s (1 prompt, batch padded to 8; 1 device(s); " in err.getvalue()
    words = ["!" if i == 0 else f"w{i - 3}" for i in _hf_greedy(hf, [1, 6, 0, 10], 3, None)]
    assert out.getvalue() == " ".join(["w3", "!", "w7", *words]) + "\n\n"  # The text alone.


@pytest.mark.slow
def test_the_stats_count_the_prompts_and_the_padded_last_batch():
    hf = _hf_model(seed=10)
    cfg = hf_llama.llama_config_from_hf(hf.config)
    generator = generate.Generator(cfg, hf_llama.params_from_hf(hf.state_dict(), cfg))
    _, stats = generator.generate([[1, 2], [3], [4, 5]], max_new_tokens=2, batch_size=2)
    assert (stats.prompts, stats.batches, stats.batch_rows) == (3, 2, 2)
    assert stats.rows_text() == "3 prompts in 2 batches of 2, the last padded from 1"


@pytest.mark.slow
def test_the_command_on_four_devices_prints_the_text_of_one_device(tmp_path):
    _save_hf_dir(tmp_path, seed=6, num_kv_heads=4)
    args = [
        f"--hf_dir={tmp_path}", "--prompt=w3 ! w7", "--prompt=w12", "--prompt=! ! w40 w2",
        "--max_new_tokens=10", "--batch_size=3", "--dtype=float32", "--chunk_size=4",
    ]
    one = _run_command(*args, "--devices=1", devices=4)
    four = _run_command(*args, "--devices=4", devices=4)
    assert one.returncode == 0 and four.returncode == 0, one.stderr[-2000:] + four.stderr[-2000:]
    assert "1 device(s)" in one.stderr and "4 device(s)" in four.stderr
    assert "tokens generated" not in one.stdout + four.stdout  # stdout: the text alone.
    assert one.stdout.count("w") >= 20
    assert four.stdout == one.stdout


@pytest.mark.slow
@pytest.mark.parametrize(
    "devices, message",
    [
        ("3", "generate: --devices=3 does not divide the model's 4 attention heads, "
              "2 key/value heads"),
        ("5", "generate: --devices=5: this host has 4 cpu device(s)"),
    ],
)
def test_the_command_refuses_a_device_count_in_one_line(tmp_path, devices, message):
    _save_hf_dir(tmp_path, seed=7)
    result = _run_command(
        f"--hf_dir={tmp_path}", "--prompt=w3", f"--devices={devices}", devices=4
    )
    assert result.returncode != 0
    assert result.stderr.strip().splitlines()[-1] == message
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_help_exits_zero_and_lists_the_flags():
    result = subprocess.run(
        [sys.executable, "-m", "axlearn.common.generate", "--help"], cwd=REPO,
        env=fresh_env(), capture_output=True, text=True, timeout=120, check=False,
    )
    assert result.returncode == 0, result.stderr
    for flag in ("--hf_dir", "--devices", "--[no]stream", "--chunk_size", "--max_new_tokens"):
        assert flag in result.stdout


_SHARDS_SCRIPT = """
import json, sys
from axlearn.common import generate
from axlearn.common.utils import flatten_with_paths
generator, _ = generate.from_hf_dir(sys.argv[1], dtype="float32", devices=4)
print(json.dumps({
    path: [x.shape, x.addressable_shards[0].data.shape, len(x.devices())]
    for path, x in flatten_with_paths(generator.params)
}))
"""


@pytest.mark.slow
def test_four_devices_each_load_a_quarter_of_every_head_and_mlp_weight(tmp_path):
    _save_hf_dir(tmp_path, seed=8, num_kv_heads=4)
    result = subprocess.run(
        [sys.executable, "-c", _SHARDS_SCRIPT, str(tmp_path)], cwd=REPO, env=fresh_env(4),
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    shards = {
        path: (tuple(shape), tuple(shard), devices)
        for path, (shape, shard, devices) in json.loads(result.stdout.splitlines()[-1]).items()
    }
    layer = "decoder/transformer/layer0/"
    attention = layer + "self_attention/attention/"
    # [D, heads, H] split by head; [D, F] and [F, D] by hidden unit; the LM head by vocab.
    assert shards[attention + "i_proj/i_proj/q_proj/weight"][:2] == ((32, 4, 8), (32, 1, 8))
    assert shards[attention + "i_proj/i_proj/k_proj/weight"][:2] == ((32, 4, 8), (32, 1, 8))
    assert shards[attention + "i_proj/i_proj/v_proj/weight"][:2] == ((32, 4, 8), (32, 1, 8))
    assert shards[attention + "o_proj/weight"][:2] == ((32, 4, 8), (32, 1, 8))
    assert shards[layer + "feed_forward/linear1_0/weight"][:2] == ((32, 48), (32, 12))
    assert shards[layer + "feed_forward/linear2/weight"][:2] == ((48, 32), (12, 32))
    assert shards["decoder/lm_head/weight"][:2] == ((32, VOCAB), (32, VOCAB // 4))
    assert shards["decoder/emb/token_emb/weight"][:2] == ((VOCAB, 32), (VOCAB, 32))
    assert all(devices == 4 for *_, devices in shards.values())


@pytest.mark.slow
def test_the_benchmark_prints_a_row_per_shape_devices_and_batch_size():
    result = subprocess.run(
        [sys.executable, "tools/generate_bench.py", "--shapes=32x2x4x2x64x128",
         "--devices=1,2,8", "--batch_sizes=1,2", "--prompt_len=32", "--new_tokens=5",
         "--chunk_size=2", "--repeats=1", "--profile_top=2"],
        cwd=REPO, env=fresh_env(2), capture_output=True, text=True, timeout=300, check=False,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    rows = [line for line in result.stdout.splitlines() if line.startswith("| 32x2x4x2x64x128")]
    cells = [[c.strip() for c in row.strip("|").split("|")] for row in rows]
    assert [(c[1], c[2]) for c in cells] == [
        ("1", "1"), ("1", "2"), ("2", "1"), ("2", "2"), ("8", "1"), ("8", "2")
    ]
    # Measured rows give a first-token time and speeds; 8 devices (of 2) are skipped.
    assert all(float(c[5].replace(",", "")) > 0 and float(c[6].replace(",", "")) > 0
               for c in cells[:4])
    assert all("too few devices" in c[5] for c in cells[4:])
    # Each measured row was traced too (a CPU trace holds no GPU kernels).
    assert result.stdout.count("kernels and 0.0 us of GPU time per generated token") == 4


def test_the_benchmark_s_kernel_profile_counts_per_generated_token(monkeypatch):
    class TwoRowsOfFiveTokens:
        def generate(self, prompts, **kwargs):
            return [], generate.GenerationStats(new_tokens=5 * len(prompts))

    # A trace of 10 'gemm' kernels of 1 ms and 20 'norm' kernels of 0.2 ms.
    events = [KernelEvent(i, "gemm", 1.0, "") for i in range(10)]
    events += [KernelEvent(100 + i, "norm", 0.2, "") for i in range(20)]
    monkeypatch.setattr(bench, "gpu_kernel_events", lambda _: events)
    summary, lines = generate_bench.kernel_profile(TwoRowsOfFiveTokens(), [[1], [2]], top=1)
    # Two rows of five tokens: five decoding steps.
    assert summary == pytest.approx(dict(kernels_per_token=6.0, gpu_us_per_token=2800.0))
    assert len(lines) == 1 and lines[0].split() == ["2000.00", "us/token", "2.00/token", "gemm"]


@pytest.mark.slow
def test_the_split_qkv_layout_for_several_devices_decodes_as_transformers():
    hf = _hf_model(seed=9)
    prompts = [[5, 0, 17], [40, 2, 2, 9]]
    expected = [_hf_greedy(hf, p, 6, None) for p in prompts]
    fused = hf_llama.llama_config_from_hf(hf.config)
    split = generate.decoding_config(fused, num_devices=2)
    params = generate.unfuse_qkv(hf_llama.params_from_hf(hf.state_dict(), fused), fused, split)
    attention = params["decoder"]["transformer"]["repeat"]["layer"]["self_attention"]["attention"]
    assert sorted(attention["i_proj"]["i_proj"]) == ["k_proj", "q_proj", "v_proj"]
    outputs, _ = generate.Generator(split, params).generate(prompts, max_new_tokens=6)
    assert outputs == expected


@pytest.mark.slow
def test_a_generate_call_compiles_its_two_programs_and_nothing_else(caplog):
    # Eager ops on the host's inputs (jnp.asarray of a NumPy array, a PRNG key) would each
    # compile a program of their own on first use, inside the first token's time.
    cfg = generate_bench.model_config("32x1x2x1x32x64", 1)
    generator = generate.Generator(
        cfg, generate_bench.random_params(cfg, generate.make_mesh(1))
    )
    with caplog.at_level("WARNING"), jax.log_compiles(True):
        generator.generate([[1, 2, 3]], max_new_tokens=3, batch_size=1, chunk_size=2)
    compiled = sorted(
        r.getMessage().split("(")[1].split(")")[0]
        for r in caplog.records if r.getMessage().startswith("Compiling jit(")
    )
    assert compiled == ["chunk", "prefill"]


@pytest.mark.slow
def test_the_command_keeps_its_compiled_programs_for_the_next_run(tmp_path):
    _save_hf_dir(tmp_path / "hf", seed=8)
    cache = tmp_path / "cache"
    args = [f"--hf_dir={tmp_path / 'hf'}", "--prompt=w3", f"--jax_compilation_cache_dir={cache}"]
    env = dict(JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")  # Tiny programs count too.
    result = subprocess.run(
        [sys.executable, "-m", "axlearn.common.generate", *args], cwd=REPO,
        env={**fresh_env(1), **env}, capture_output=True, text=True, timeout=300, check=False,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    kept = {p.name.split("-")[0] for p in cache.iterdir()}
    assert {"jit_chunk", "jit_prefill"} <= kept, kept
