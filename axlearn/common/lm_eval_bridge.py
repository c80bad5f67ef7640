"""EleutherAI's lm-evaluation-harness (`lm-eval`) over our models: a model class its CLI and
Python API accept, and an evaler that runs chosen tasks during training.

    # lm-eval's own CLI, with our model class registered (any lm-eval flags follow):
    python -m axlearn.common.lm_eval_bridge run --model axlearn \\
        --model_args trainer_dir=T[,step=N] --tasks hellaswag,arc_easy --batch_size 16
    python -m axlearn.common.lm_eval_bridge run --model axlearn \\
        --model_args hf_dir=D,dtype=bfloat16 --tasks my_task --include_path tasks/

    # The Python API:
    import lm_eval, axlearn.common.lm_eval_bridge  # registers 'axlearn'
    lm_eval.simple_evaluate(model="axlearn", model_args="hf_dir=D", tasks=["arc_easy"])

`AxlearnLM` (registered as 'axlearn') implements lm-eval's three request types over a
`generate.Generator` (the model and its parameters, over one device or tensor parallel
over several: `devices=N`): `loglikelihood` and `loglikelihood_rolling` score batches of
token rows with one jitted forward pass of the decoder (rows sorted by length, padded to a
multiple of 32 tokens and to `batch_size` rows, so that few programs compile), and
`generate_until` decodes greedily (or with the request's temperature) on the KV cache
(`Generator.generate`), then cuts the text at the first stop sequence. Tokenization
follows lm-eval's `TemplateLM`: the context's trailing spaces move to the continuation,
which is the tail of the whole text's tokens; the bos token starts each text only with
`add_bos_token=True`; rows longer than `max_length` lose tokens on the left.

model_args: `trainer_dir` (and `step`: default the latest checkpoint) or `hf_dir` (a
Hugging Face Llama directory); `tokenizer` (default: the model's own, as
`axlearn.common.generate` finds it); `dtype` (float32, bfloat16 or auto); `devices`;
`batch_size`; `max_length` (2048); `max_gen_toks` (256); `add_bos_token`.

`LmEvalEvaler` is an evaler (`SpmdTrainer.Config.evalers`) that runs `tasks` at its
`eval_policy`'s steps on the current parameters and writes every task's metrics
('lm_eval/<task>/<metric>') to its summary writer, `summaries/<evaler name>/` beside the
other evalers' loss. Tasks are lm-eval's registered ones (their datasets must be
reachable) or YAML files in `include_path` (e.g. a task over a local JSON file; see
docs/evaluation.md).
"""

import logging
import math
import sys
from collections.abc import Sequence
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from axlearn.common import generate
from axlearn.common.causal_lm import language_model_config, language_model_field
from axlearn.common.config import (
    REQUIRED,
    ConfigError,
    InstantiableConfig,
    Required,
    close_names,
    config_class,
    config_for_function,
)
from axlearn.common.evaler import every_n_steps_policy
from axlearn.common.input_vocab import NO_ID, Vocabulary
from axlearn.common.module import Module, functional
from axlearn.common.run_dir import RunDir
from axlearn.common.summary_writer import SummaryWriter
from axlearn.common.utils import cast_floats

try:
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import register_model
except ImportError as e:  # pragma: no cover - the `eval` extra is missing.
    raise ImportError(
        "axlearn.common.lm_eval_bridge needs lm-eval: pip install 'axlearn[eval]'"
    ) from e

log = logging.getLogger(__name__)

MODEL_NAME = "axlearn"  # The name lm-eval's --model takes.
ROW_LENGTH_MULTIPLE = generate.PROMPT_LENGTH_MULTIPLE  # Scored rows are padded to this.


class TaskError(ValueError):
    """A task that lm-eval does not know or whose data cannot be read."""


# ----- scoring token rows -----


class _Scorer:
    """Per-token log-probabilities of token rows under a Generator's model, batched."""

    def __init__(self, generator: generate.Generator, *, batch_size: int, max_length: int):
        self._generator = generator
        self._batch_size = batch_size
        self._max_length = max_length
        self._forward = jax.jit(self._token_scores)

    def _token_scores(self, params: Any, ids: jax.Array, targets: jax.Array):
        logits = self._generator._decoder_call(  # pylint: disable=protected-access
            params, "forward", input_ids=ids
        )["logits"].astype(jnp.float32)
        logp = jax.nn.log_softmax(logits, axis=-1)
        picked = jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
        return picked, jnp.argmax(logits, axis=-1) == targets

    def score(self, rows: Sequence[tuple[list[int], int]]) -> list[tuple[float, bool]]:
        """(sum of log p of the last `n` tokens of `tokens`, whether each was the greedy
        choice) of each (tokens, n); a row longer than max_length + 1 loses its first
        tokens."""
        results: list[Optional[tuple[float, bool]]] = [None] * len(rows)
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))
        for start in range(0, len(order), self._batch_size):
            chunk = order[start : start + self._batch_size]
            cut = [rows[i][0][-(self._max_length + 1) :] for i in chunk]
            longest = max(len(tokens) - 1 for tokens in cut)
            length = min(-(-longest // ROW_LENGTH_MULTIPLE) * ROW_LENGTH_MULTIPLE, self._max_length)
            ids = np.zeros((self._batch_size, length), np.int32)
            targets = np.zeros((self._batch_size, length), np.int32)
            for row, tokens in enumerate(cut):
                ids[row, : len(tokens) - 1] = tokens[:-1]
                targets[row, : len(tokens) - 1] = tokens[1:]
            logp, greedy = self._forward(
                self._generator.params, jnp.asarray(ids), jnp.asarray(targets)
            )
            logp, greedy = np.asarray(logp, np.float64), np.asarray(greedy)
            for row, (i, tokens) in enumerate(zip(chunk, cut)):
                end = len(tokens) - 1
                begin = end - min(rows[i][1], end)
                results[i] = (float(logp[row, begin:end].sum()), bool(greedy[row, begin:end].all()))
        return results


# ----- the lm-eval model class -----


@register_model(MODEL_NAME)
class AxlearnLM(TemplateLM):
    """Our causal LM as an lm-eval model (see the module docstring for model_args)."""

    def __init__(
        self,
        trainer_dir: Optional[str] = None,
        hf_dir: Optional[str] = None,
        step: Optional[int] = None,
        tokenizer: Optional[str] = None,
        dtype: str = "float32",
        devices: Optional[int] = None,
        batch_size: Any = 8,
        max_length: int = 2048,
        max_gen_toks: int = 256,
        add_bos_token: bool = False,
        generator: Optional[generate.Generator] = None,
        vocab: Optional[Vocabulary] = None,
        **lm_eval_kwargs,
    ):
        super().__init__()
        # lm-eval passes its --device (and max_batch_size) to every model: JAX places ours.
        unknown = sorted(set(lm_eval_kwargs) - {"device", "max_batch_size"})
        if unknown:
            raise ConfigError(f"--model_args: unknown argument(s) {unknown} for --model {MODEL_NAME}")
        if generator is None:
            if (trainer_dir is None) == (hf_dir is None):
                raise ConfigError(f"--model_args: give one of trainer_dir=DIR or hf_dir=DIR for --model {MODEL_NAME}")
            if trainer_dir is not None:
                generator, found = generate.from_trainer_dir(
                    trainer_dir, step=None if step is None else int(step), dtype=dtype,
                    devices=None if devices is None else int(devices),
                )
            else:
                generator, found = generate.from_hf_dir(
                    hf_dir, dtype=dtype, devices=None if devices is None else int(devices)
                )
            vocab = generate.load_tokenizer(tokenizer or found)
        if vocab is None:
            raise ConfigError("AxlearnLM: a generator needs its vocabulary")
        if str(batch_size).startswith("auto"):
            raise ConfigError(f"--batch_size={batch_size}: --model {MODEL_NAME} takes a number")
        self._generator = generator
        self._vocab = vocab
        self._batch_size = int(batch_size)
        self._max_length = int(max_length)
        self._max_gen_toks = int(max_gen_toks)
        self._add_bos = str(add_bos_token).lower() in ("true", "1")
        self._scorer = _Scorer(generator, batch_size=self._batch_size, max_length=self._max_length)

    # ----- tokenization (TemplateLM) -----

    @property
    def eot_token_id(self) -> int:
        return self._vocab.eos_id

    @property
    def prefix_token_id(self) -> int:
        bos = self._vocab.bos_id
        return self._vocab.eos_id if bos == NO_ID else bos

    @property
    def max_length(self) -> int:
        return self._max_length

    def tok_encode(self, string: str, add_special_tokens: Optional[bool] = None, **kwargs) -> list[int]:
        del kwargs
        add_bos = self._add_bos if add_special_tokens is None else add_special_tokens
        prefix = [self._vocab.bos_id] if add_bos and self._vocab.bos_id != NO_ID else []
        return prefix + list(self._vocab.encode(string))

    def tok_decode(self, ids: Sequence[int]) -> str:
        return self._vocab.decode(list(ids))

    # ----- the three request types -----

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
        del disable_tqdm, kwargs
        rows = [(list(context) + list(continuation), len(continuation))
                for _, context, continuation in requests]
        return self._scorer.score(rows)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        # pylint: disable-next=import-outside-toplevel
        from lm_eval import utils as lm_eval_utils

        windows, owners = [], []
        for index, (string,) in enumerate(request.args for request in requests):
            for context, continuation in map(
                lm_eval_utils.make_disjoint_window,
                lm_eval_utils.get_rolling_token_windows(
                    token_list=self.tok_encode(string),
                    prefix_token=self.prefix_token_id,
                    max_seq_len=self._max_length,
                    context_len=1,
                ),
            ):
                windows.append((None, context, continuation))
                owners.append(index)
        totals = [0.0] * len(requests)
        for owner, (logp, _) in zip(owners, self._loglikelihood_tokens(windows, disable_tqdm)):
            totals[owner] += logp
        for request, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        # pylint: disable-next=import-outside-toplevel
        from lm_eval.models import utils as model_utils

        del disable_tqdm
        results: list[Optional[str]] = [None] * len(requests)
        groups: dict[str, list[int]] = {}
        for index, request in enumerate(requests):
            groups.setdefault(repr(sorted(request.args[1].items())), []).append(index)
        for indices in groups.values():
            kwargs = model_utils.normalize_gen_kwargs(
                requests[indices[0]].args[1], self._max_gen_toks
            )
            until = model_utils.handle_stop_sequences(kwargs.pop("until", None), eos=None)
            max_gen_toks = int(kwargs.pop("max_gen_toks"))
            temperature = float(kwargs.pop("temperature", 0.0) or 0.0)
            if not kwargs.pop("do_sample", False):
                temperature = 0.0
            sampling = generate.Sampling(temperature=temperature)
            max_context = self._max_length - max_gen_toks
            if max_context < 1:
                raise ConfigError(
                    f"max_gen_toks={max_gen_toks} leaves no room for a context in "
                    f"max_length={self._max_length}"
                )
            prompts = [self.tok_encode(requests[i].args[0])[-max_context:] or [self.prefix_token_id]
                       for i in indices]
            new, _ = self._generator.generate(
                prompts, max_new_tokens=max_gen_toks, sampling=sampling, batch_size=self._batch_size
            )
            for i, ids in zip(indices, new):
                text = self.tok_decode(ids)
                results[i] = model_utils.postprocess_generated_text(text, until, None)
                self.cache_hook.add_partial("generate_until", requests[i].args, results[i])
        return results


# ----- tasks -----


def task_manager(include_path: Optional[str] = None, *, include_registry: bool = True):
    """lm-eval's TaskManager over the YAMLs in `include_path` and, with
    `include_registry`, lm-eval's own tasks (some 15,000 to index: seconds)."""
    # pylint: disable-next=import-outside-toplevel
    from lm_eval.tasks import TaskManager

    if include_path is None and not include_registry:
        raise ConfigError("include_registry=False needs an include_path of task YAMLs")
    return TaskManager(include_path=include_path, include_defaults=include_registry)


def check_tasks(tasks: Sequence[str], manager: Any, *, where: str = "tasks") -> None:
    """Refuses task names lm-eval does not know, naming the closest ones."""
    known = set(manager.all_tasks)
    for name in tasks:
        if name not in known:
            close = close_names(name, sorted(known))
            hint = f"; close names: {', '.join(close)}" if close else ""
            raise TaskError(
                f"{where}: unknown lm-eval task {name!r}{hint} (a local task: its YAML in "
                "include_path)"
            )


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"


def load_tasks(tasks: Sequence[str], manager: Any, *, where: str = "tasks") -> dict[str, Any]:
    """lm-eval's task dict of `tasks` (their data read); a task whose data cannot be read
    is one TaskError naming it."""
    # pylint: disable-next=import-outside-toplevel
    from lm_eval.tasks import get_task_dict

    check_tasks(tasks, manager, where=where)
    loaded = {}
    for name in tasks:
        try:
            loaded.update(get_task_dict([name], manager))
        except Exception as e:  # pylint: disable=broad-except
            raise TaskError(f"{where}: task {name!r}: its data cannot be read ({_first_line(e)})") from e
    return loaded


def evaluate(
    lm: AxlearnLM,
    tasks: Sequence[str],
    *,
    manager: Any = None,
    include_path: Optional[str] = None,
    limit: Optional[int] = None,
    num_fewshot: Optional[int] = None,
    log_samples: bool = False,
    where: str = "tasks",
) -> dict[str, Any]:
    """lm-eval's results dict of `lm` on `tasks` (as `lm_eval.simple_evaluate` gives it),
    from `manager`'s tasks (None: `task_manager(include_path)`)."""
    # pylint: disable-next=import-outside-toplevel
    import lm_eval

    manager = manager or task_manager(include_path)
    task_dict = load_tasks(tasks, manager, where=where)
    if num_fewshot is not None:
        for task in task_dict.values():
            if hasattr(task, "set_config"):
                task.set_config(key="num_fewshot", value=num_fewshot)
    return lm_eval.evaluate(lm=lm, task_dict=task_dict, limit=limit, log_samples=log_samples)


def flat_metrics(results: dict[str, Any]) -> dict[str, float]:
    """{'lm_eval/<task>/<metric>': value} of lm-eval's results (numbers only; a metric's
    ',none' filter suffix dropped, another filter kept as '<metric>/<filter>')."""
    flat = {}
    for task, metrics in sorted(results.get("results", {}).items()):
        for key, value in metrics.items():
            if not isinstance(value, (int, float)) or isinstance(value, bool) or key == "alias":
                continue
            metric, _, filter_name = key.partition(",")
            name = metric if filter_name in ("", "none") else f"{metric}/{filter_name}"
            if not (isinstance(value, float) and math.isnan(value)):
                flat[f"lm_eval/{task}/{name}"] = float(value)
    return flat


# ----- the evaler -----


class LmEvalEvaler(Module):
    """Runs lm-eval tasks on the model being trained at chosen steps (module docstring)."""

    @config_class
    class Config(Module.Config):
        """Configures LmEvalEvaler."""

        tasks: Required[Sequence[str]] = REQUIRED  # lm-eval task names (or local YAMLs').
        # The tokenizer of the model's data: a tokenizer.json, a SentencePiece model, 'bytes'.
        tokenizer: Required[str] = REQUIRED
        include_path: Optional[str] = None  # A directory of task YAMLs; None: registry only.
        # Index lm-eval's own tasks too (seconds); False: only include_path's.
        include_registry: bool = True
        limit: Optional[int] = None  # Examples of each task; None: all.
        num_fewshot: Optional[int] = None  # None: each task's own.
        batch_size: int = 8  # Rows scored or decoded at once.
        max_length: int = 2048  # Longest row; longer ones lose tokens on the left.
        max_gen_toks: int = 256  # Tokens generated at most, unless a task says.
        add_bos_token: bool = False  # Start each text with the tokenizer's bos token.
        eval_dtype: Any = jnp.float32  # The parameters are cast to this dtype.
        # A config of a function returning `policy(step) -> bool`.
        eval_policy: InstantiableConfig = config_for_function(every_n_steps_policy)
        summary_writer: InstantiableConfig = SummaryWriter.default_config()
        # Set by the trainer as for every evaler; the tasks run their own batches.
        batch_axis_names: Optional[Any] = None
        per_device_microbatch_size: Optional[int] = None

    def __init__(self, cfg: Config, *, parent: Optional[Module], model: Module,
                 model_param_partition_specs: Any = None):
        super().__init__(cfg, parent=parent)
        del model_param_partition_specs
        cfg = self.config
        self._manager = task_manager(cfg.include_path, include_registry=cfg.include_registry)
        check_tasks(list(cfg.tasks), self._manager, where=f"{self.path()}.tasks")
        self._model_field = language_model_field(model.config)
        self._lm_config = language_model_config(model.config).clone(dtype=cfg.eval_dtype)
        self._vocab = generate.load_tokenizer(cfg.tokenizer)
        self._policy = cfg.eval_policy.instantiate()
        writer = cfg.summary_writer.clone()
        run: Optional[RunDir] = getattr(parent, "run_dir", None)  # The trainer's.
        if writer.dir is None and run is not None:
            writer.dir = run.summaries(self.name)
        if writer.dir is not None:
            self._add_child("summary_writer", writer)

    def due(self, step: int) -> bool:
        """Whether the eval policy evaluates at `step`."""
        return bool(self._policy(step))

    def eval_step(self, step: int, *, prng_key: Any, model_params: Any) -> Optional[dict]:
        """Evaluates at `step` if the policy says so; returns the metrics or None."""
        if not self.due(step):
            return None
        return self.evaluate(step, prng_key=prng_key, model_params=model_params)

    def evaluate(self, step: int, *, prng_key: Any, model_params: Any) -> dict[str, float]:
        """Runs the tasks on `model_params` at `step`; returns (and writes) their metrics."""
        del prng_key
        cfg = self.config
        params = model_params if self._model_field is None else model_params[self._model_field]
        params = cast_floats(params, cfg.eval_dtype)
        lm = AxlearnLM(
            generator=generate.Generator(self._lm_config.clone(), params),
            vocab=self._vocab,
            batch_size=cfg.batch_size,
            max_length=cfg.max_length,
            max_gen_toks=cfg.max_gen_toks,
            add_bos_token=cfg.add_bos_token,
        )
        results = evaluate(
            lm, list(cfg.tasks), manager=self._manager, limit=cfg.limit,
            num_fewshot=cfg.num_fewshot, where=f"{self.path()}.tasks",
        )
        metrics = flat_metrics(results)
        if "summary_writer" in self.children:
            self.summary_writer(step, metrics)
            self.summary_writer.flush()
        log.info("%s step %d: %s", self.path(), step,
                 ", ".join(f"{k}={v:.4g}" for k, v in sorted(metrics.items())))
        return metrics


# ----- the command -----


def main(argv: Optional[Sequence[str]] = None) -> None:
    """lm-eval's CLI with `--model axlearn` registered. What lm-eval refuses (an unknown
    task, task data that cannot be read, a bad model argument) is one line on stderr and
    exit status 1; the traceback is logged at debug level."""
    # pylint: disable-next=import-outside-toplevel
    from lm_eval.__main__ import cli_evaluate

    argv = list(sys.argv[1:] if argv is None else argv)
    sys.argv = ["lm_eval", *argv]
    try:
        cli_evaluate()
    except Exception as e:  # pylint: disable=broad-except
        log.debug("lm-eval failed", exc_info=True)
        raise SystemExit(f"lm_eval_bridge: {_first_line(e)}") from None


if __name__ == "__main__":
    main()
