"""Golden configs: every named config's files are current, parse back, name real code,
and every mesh rule resolves on its devices with an evenly split batch.

Regenerate after an intended change with
    python -m axlearn.common.golden_config --update
or  AXLEARN_UPDATE_GOLDEN=1 pytest tests/test_golden_configs.py
"""

import ast
import functools
import inspect
import itertools
import math
import os
import pathlib
import re
import subprocess
import textwrap
from typing import Optional

import pytest

from axlearn.common import golden_config
from axlearn.common.base_layer import BaseLayer
from axlearn.common.config import (
    ConfigBase,
    Configurable,
    MissingRequiredFieldsError,
    config_for_function,
    import_name,
)
from axlearn.common.golden_text import parse_flat_text
from axlearn.common.module import Module
from axlearn.common.mesh_selection import select_mesh_rule
from axlearn.common.trainer import infer_mesh_shape
from axlearn.common.trainer_config_modifier import apply_mesh_rule
from axlearn.experiments.text.gpt.common import instance_device_count
from tests import reference_spec

_GOLDEN_DIR = pathlib.Path(golden_config.GOLDEN_DIR)


@functools.lru_cache(maxsize=None)
def _named_configs() -> dict[str, tuple[str, object]]:
    return {name: (module, builder) for module, name, builder in golden_config.all_named_configs()}


def _config(name: str) -> ConfigBase:
    return _named_configs()[name][1]()


_NAMES = sorted(_named_configs())
_CONFIG_FILES = sorted(_GOLDEN_DIR.glob("*/*.txt"))
_FLAT_CONFIG_FILES = [
    p for p in _CONFIG_FILES if not p.name.endswith(("_init.txt", "_regularizer.txt"))
]


# ----- the files are current -----


@pytest.mark.parametrize("name", _NAMES)
def test_golden_files_equal_regenerated_text(name):
    module, builder = _named_configs()[name]
    update = os.environ.get(golden_config.UPDATE_ENV) == "1"
    problems = golden_config.check_or_update(module, name, builder(), update=update)
    if problems:
        pytest.fail(
            "\n\n".join(problems)
            + f"\n\nIf the change is intended, regenerate with {golden_config.REGENERATE_COMMAND}"
            " and review the golden diff.",
            pytrace=False,
        )


def test_no_golden_file_is_left_without_a_config():
    expected = [
        f"{module}/{filename}"
        for name, (module, _) in _named_configs().items()
        for filename in golden_config.golden_file_names(name)
    ]
    assert golden_config.stale_files(expected) == []


def test_gpt_3b_golden_file_is_the_spec_byte_for_byte():
    assert (_GOLDEN_DIR / "gpt" / "gpt_3b.txt").read_bytes() == reference_spec.path().read_bytes()


def test_a_changed_golden_file_fails_with_a_unified_diff(tmp_path):
    module, builder = _named_configs()["gpt_test"]
    cfg = builder()
    golden_config.check_or_update(module, "gpt_test", cfg, update=True, golden_dir=str(tmp_path))
    cfg.learner.optimizer.inner.learning_rate = 0.5
    problems = golden_config.check_or_update(
        module, "gpt_test", cfg, update=False, golden_dir=str(tmp_path)
    )
    assert len(problems) == 1  # Only the flat config mentions the learning rate.
    assert "-learner.optimizer.inner.learning_rate: 0.01" in problems[0]
    assert "+learner.optimizer.inner.learning_rate: 0.5" in problems[0]
    assert "gpt/gpt_test.txt (checked in)" in problems[0]



def test_check_of_an_unknown_config_name_fails_listing_close_names(capsys):
    assert golden_config.main(["--config=gpt_tst"]) != 0
    captured = capsys.readouterr()
    assert "Unknown config 'gpt_tst'" in captured.err and "Did you mean: gpt_test" in captured.err
    assert "Golden files match" not in captured.out


def test_check_of_a_named_config_compares_its_files(capsys):
    assert golden_config.main(["--config=gpt_test"]) == 0
    assert capsys.readouterr().out.strip() == "Golden files match."

# ----- parsing back -----


@pytest.mark.parametrize("path", _FLAT_CONFIG_FILES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_golden_text_parses_back_to_a_config_that_dumps_identically(path):
    text = path.read_text()
    assert parse_flat_text(text, source=str(path)).debug_string() == text


# ----- every klass and fn is real code -----


def _named_objects(path: pathlib.Path) -> set[str]:
    """The qualified names of every `klass` and `fn` line of a golden config file."""
    names = set()
    for line in path.read_text().splitlines():
        key, _, value = line.partition(": ")
        if re.fullmatch(r"(.*\.)?(klass|fn)", key):
            names.add(ast.literal_eval(value))
    return names


def _all_named_objects() -> list[str]:
    return sorted(set().union(*(_named_objects(p) for p in _FLAT_CONFIG_FILES)))


def _is_stub(fn) -> bool:
    """Whether a function's body (after its docstring) is only `pass`, `...` or a raise of
    NotImplementedError."""
    try:
        source = textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError):
        return False
    tree = ast.parse(source)
    body = tree.body[0].body
    first = body[0] if body else None
    if isinstance(first, ast.Expr) and isinstance(getattr(first.value, "value", None), str):
        body = body[1:]  # The docstring.
    if len(body) != 1:
        return False
    stmt = body[0]
    if isinstance(stmt, ast.Pass):
        return True
    if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant):
        return stmt.value.value is Ellipsis
    if isinstance(stmt, ast.Raise) and stmt.exc is not None:
        exc = stmt.exc.func if isinstance(stmt.exc, ast.Call) else stmt.exc
        return isinstance(exc, ast.Name) and exc.id == "NotImplementedError"
    return False


def _stub_methods(cls: type) -> list[str]:
    """Public methods (and __call__) that a concrete class leaves unimplemented.

    The optional hooks of the framework roots (e.g. Module.forward, which a checkpointer
    or an input has no use for) count only where the class is a layer, whose forward
    must exist."""
    stubs = []
    for name in dir(cls):
        if name.startswith("_") and name != "__call__":
            continue
        attr = inspect.getattr_static(cls, name)
        fn = attr.__func__ if isinstance(attr, (staticmethod, classmethod)) else attr
        if not (inspect.isfunction(fn) and fn.__module__.startswith("axlearn") and _is_stub(fn)):
            continue
        owner = fn.__qualname__.split(".")[0]
        if owner in ("Module", "Configurable") and not (
            name == "forward" and issubclass(cls, BaseLayer)
        ):
            continue
        stubs.append(fn.__qualname__)
    return stubs


def _extra_constructor_arguments(cls: type) -> list[str]:
    """Required constructor arguments besides the config and the parent."""
    params = list(inspect.signature(cls.__init__).parameters.values())[2:]  # self, cfg.
    return [
        p.name
        for p in params
        if p.default is inspect.Parameter.empty
        and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        and p.name != "parent"
    ]


@pytest.mark.parametrize("qualified_name", _all_named_objects())
def test_every_klass_and_fn_imports_and_is_implemented(qualified_name):
    obj = import_name(qualified_name)
    assert obj.__module__.startswith("axlearn."), f"{qualified_name} is not defined in axlearn"
    if inspect.isclass(obj):
        assert issubclass(obj, Configurable), f"{qualified_name} is not Configurable"
        assert _stub_methods(obj) == [], f"{qualified_name} has unimplemented methods"
        cfg = obj.default_config()
        assert cfg.klass is obj
        if _extra_constructor_arguments(obj):
            return  # Built by its owner, which passes e.g. the model; not alone.
        kwargs = {"parent": None} if issubclass(obj, Module) else {}
        if "name" in cfg.keys():
            cfg.name = "x"
        try:
            instance = cfg.instantiate(**kwargs)
        except MissingRequiredFieldsError:
            return  # The default leaves some field to the user; the golden values fill it.
        assert isinstance(instance, obj)
    else:
        assert inspect.isfunction(obj), f"{qualified_name} is not a function"
        assert not _is_stub(obj), f"{qualified_name} is a stub"
        assert config_for_function(obj).fn is obj


@pytest.mark.slow
def test_every_named_config_model_learner_and_outputs_instantiate(tmp_path):
    # As configured, not only by default: the model (its module tree only, no parameters),
    # the learner, the checkpointer and the summary writer build without error.
    for name in _NAMES:
        cfg = _config(name)
        cfg.model.clone(name="model").instantiate(parent=None)
        cfg.learner.clone(name="learner").instantiate(parent=None)
        with cfg.checkpointer.clone(name="checkpointer", dir=str(tmp_path / name)).instantiate(
            parent=None
        ):
            pass
        writer = cfg.summary_writer.clone(name="writer", dir=str(tmp_path / name / "summaries"))
        writer.instantiate(parent=None).close()


def test_stub_detection_recognises_unimplemented_bodies():
    def documented_pass():
        """Doc."""
        pass  # pylint: disable=unnecessary-pass

    def ellipsis():
        ...

    def raises():
        raise NotImplementedError("later")

    def real(x):
        """Doc."""
        return x + 1

    assert [_is_stub(f) for f in (documented_pass, ellipsis, raises, real)] == [
        True,
        True,
        True,
        False,
    ]


# ----- mesh rules -----


def _selector_device_counts(pattern: str) -> list[int]:
    """Device counts of the instance types a mesh-rule selector names: alternatives in
    parentheses are expanded (gpu-h100-(1|2|4|8) -> 1, 2, 4, 8); a CPU rule gets 1 and 8.
    A selector with a wildcard (tpu-v5p-.*) names no count to check: the test skips."""
    if ".*" in pattern:
        pytest.skip(f"{pattern} matches any size; there is no device count to check")
    if pattern.startswith("cpu"):
        for name in ("cpu", "cpu-8"):
            assert re.fullmatch(pattern, name), f"{pattern} does not match {name}"
        return [1, 8]
    pieces = re.split(r"\(([^()]*)\)", pattern)
    # Odd pieces are the groups' alternatives; even pieces are literal text.
    choices = [piece.split("|") if i % 2 else [piece] for i, piece in enumerate(pieces)]
    counts = set()
    for parts in itertools.product(*choices):
        instance_type = "".join(parts)
        assert re.fullmatch(pattern, instance_type), (pattern, instance_type)
        count = instance_device_count(instance_type)
        assert count, f"{instance_type} (from {pattern}) names no device count"
        counts.add(count)
    return sorted(counts)


def test_selector_device_counts_expand_alternatives():
    assert _selector_device_counts("gpu-(h100|h200)-(1|2|4|8)") == [1, 2, 4, 8]
    assert _selector_device_counts("tpu-v5litepod-256") == [256]
    assert _selector_device_counts("cpu(-[0-9]+)?") == [1, 8]
    # TPU v4/v5p sizes count TensorCores, two per JAX device.
    assert _selector_device_counts("tpu-v5p-(1024|2048)") == [512, 1024]


def _global_batch_size(input_cfg: ConfigBase) -> Optional[int]:
    """The input's global batch size; None where an `input_dispatcher` pads the logical
    batch to the mesh (any logical batch then splits)."""
    if "input_dispatcher" in input_cfg.keys() and input_cfg.input_dispatcher is not None:
        return None
    found = []
    input_cfg.visit(
        lambda path, value: found.append(value)
        if path.split(".")[-1] == "global_batch_size"
        else None
    )
    assert len(found) == 1, f"expected one global_batch_size in the input, found {found}"
    return found[0]


def _mesh_rule_cases():
    for name in _NAMES:
        for index, (pattern, _) in enumerate(_config(name).mesh_rules or ()):
            yield pytest.param(name, index, id=f"{name}[{index}]:{pattern}")


@pytest.mark.parametrize("name,index", list(_mesh_rule_cases()))
def test_mesh_rule_resolves_and_splits_the_batch_evenly(name, index):
    base = _config(name)
    pattern, rule = base.mesh_rules[index]
    for num_devices in _selector_device_counts(pattern):
        cfg = apply_mesh_rule(base.clone(), rule)
        shape = infer_mesh_shape(cfg.mesh_shape, num_devices)  # Raises if -1 cannot resolve.
        axes = dict(zip(cfg.mesh_axis_names, shape))
        split = math.prod(axes[axis] for axis in cfg.batch_axis_names)
        inputs = {"input": cfg.input}
        inputs.update({f"evalers['{k}'].input": e.input for k, e in cfg.evalers.items()})
        for where, input_cfg in inputs.items():
            batch = _global_batch_size(input_cfg)
            assert batch is None or batch % split == 0, (
                f"{name}: mesh rule {pattern} on {num_devices} devices gives mesh {shape}, "
                f"which splits the batch {split} ways, but {where} has global batch {batch}"
            )


@pytest.mark.parametrize("name,index", list(_mesh_rule_cases()))
def test_mesh_rule_is_not_shadowed_by_an_earlier_rule(name, index):
    rules = _config(name).mesh_rules
    pattern = rules[index][0]
    if pattern.startswith("cpu"):
        selectors = ["cpu", "cpu-8"]
    else:
        pieces = re.split(r"\(([^()]*)\)", pattern)
        choices = [p.split("|") if i % 2 else [p] for i, p in enumerate(pieces)]
        selectors = ["".join(parts) for parts in itertools.product(*choices)]
    for selector in selectors:
        first = next(i for i, (p, _) in enumerate(rules) if re.fullmatch(p, selector))
        assert first == index, f"{name}: {selector} selects rule {first}, not rule {index}"
        assert select_mesh_rule(rules, selector)[1] is rules[index][1]


# ----- the review aid -----


def _git(repo: pathlib.Path, *args: str) -> None:
    subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
        cwd=repo,
        check=True,
        capture_output=True,
    )


def test_summarize_diff_groups_a_change_across_configs_into_one_line(tmp_path):
    golden = tmp_path / "golden_configs" / "gpt"
    golden.mkdir(parents=True)
    for name in ("a", "b", "c"):
        (golden / f"{name}.txt").write_text(
            f"learner.optimizer.peak_lr: 0.01\nmodel.dim: {len(name) * 8}\nname: '{name}'"
        )
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "commit", "-q", "-m", "golden")
    for name in ("a", "b"):  # Change the learning rate of two configs and the dim of one.
        path = golden / f"{name}.txt"
        path.write_text(path.read_text().replace("0.01", "0.02"))
    (golden / "a.txt").write_text((golden / "a.txt").read_text().replace(": 8", ": 16"))
    (golden / "d.txt").write_text("name: 'd'")

    summary = golden_config.summarize_golden_diff(golden_dir=str(tmp_path / "golden_configs"))
    lines = summary.splitlines()
    lr_lines = [line for line in lines if "peak_lr" in line]
    assert lr_lines == [
        "[config] learner.optimizer.peak_lr: 2 configs, 0.01 -> 0.02  (gpt/a, gpt/b)"
    ]
    assert "[config] model.dim: 1 config, 8 -> 16  (gpt/a)" in lines
    assert "[added] golden_configs/gpt/d.txt" in lines
    assert lines[0].startswith("Golden changes against HEAD: 2 distinct edits, 1 files added")


def test_summarize_diff_reports_no_changes(tmp_path):
    golden = tmp_path / "golden_configs" / "m"
    golden.mkdir(parents=True)
    (golden / "x.txt").write_text("a: 1")
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "commit", "-q", "-m", "golden")
    summary = golden_config.summarize_golden_diff(
        golden_dir=str(tmp_path / "golden_configs"), generate=lambda: {"m/x.txt": "a: 1"}
    )
    assert summary == (
        "No golden changes against HEAD; the code generates the same golden files."
    )


def test_summarize_diff_without_staged_changes_summarizes_what_the_code_generates(tmp_path):
    golden = tmp_path / "golden_configs" / "m"
    golden.mkdir(parents=True)
    (golden / "x.txt").write_text("a: 1\nb: 2")
    (golden / "old.txt").write_text("a: 1")
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "commit", "-q", "-m", "golden")
    generated = {"m/x.txt": "a: 1\nb: 3", "m/new.txt": "a: 1"}
    summary = golden_config.summarize_golden_diff(
        golden_dir=str(tmp_path / "golden_configs"), generate=lambda: generated
    )
    lines = summary.splitlines()
    assert lines[0].startswith("No golden changes against HEAD, but the code generates")
    assert "1 distinct edits, 1 files added, 1 removed" in lines[0]
    assert "[config] b: 1 config, 2 -> 3  (m/x)" in lines
    assert "[added] golden_configs/m/new.txt" in lines
    assert "[removed] golden_configs/m/old.txt" in lines


def _rules_text(rules) -> str:
    """Golden lines of a mesh rule list [(pattern, mesh shape)] and one other field."""
    lines = ["max_step: 10"]
    for i, (pattern, shape) in enumerate(rules):
        lines.append(f"mesh_rules[{i}][0]: '{pattern}'")
        lines += [f"mesh_rules[{i}][1][{k}]: {n}" for k, n in enumerate(shape)]
    return "\n".join(lines)


def test_a_mesh_rule_inserted_in_the_list_summarizes_as_one_edit(tmp_path):
    golden = tmp_path / "golden_configs" / "m"
    golden.mkdir(parents=True)
    rules = [(f"gpu-{i}", (1, -1, i)) for i in range(20)]
    (golden / "c.txt").write_text(_rules_text(rules))
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "commit", "-q", "-m", "golden")
    # A new rule before the fifth, and a mesh change of a later rule.
    changed = rules[:4] + [("gpu-new", (1, 2, 3))] + rules[4:]
    changed[10] = (changed[10][0], (1, -1, 99))
    (golden / "c.txt").write_text(_rules_text(changed))
    summary = golden_config.summarize_golden_diff(
        golden_dir=str(tmp_path / "golden_configs"), generate=None
    )
    lines = summary.splitlines()
    assert lines[1:] == [
        "[config] mesh_rules: 1 config, (absent) -> rule 'gpu-new'  (m/c)",
        f"[config] mesh_rules['{changed[10][0]}'][1][2]: 1 config, 9 -> 99  (m/c)",
    ]
