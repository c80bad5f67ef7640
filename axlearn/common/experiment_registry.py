"""The registry of named trainer configs: every tool's `--config` lookup, the one-line
descriptions and parameter counts `--list_configs` prints.

Experiment modules live in the top-level `experiments` package; each exposes
`named_trainer_configs() -> {name: () -> SpmdTrainer.Config}`, and may describe its configs
in one line each for `--list_configs` in a module-level `DESCRIPTIONS = {name: "..."}`.
"""

import functools
import importlib
import inspect
import pkgutil
from collections.abc import Callable
from typing import Any, Optional

from axlearn.common.config import (
    ConfigBase,
    ConfigError,
    UnknownKeyError,
    close_names,
    get_named_trainer_config,
    qualified_name,
)

# The package of the experiment modules: `experiments`, or AXLearn's `<root>.experiments`.
EXPERIMENTS_PACKAGE = "experiments"


def experiment_modules() -> list[str]:
    """Names of the experiment modules (experiments.<name>)."""
    package = importlib.import_module(EXPERIMENTS_PACKAGE)
    names = (info.name for info in pkgutil.iter_modules(package.__path__))
    return sorted(name for name in names if not name.startswith("_"))


Builder = Callable[[], ConfigBase]


def _experiment_module(name: str) -> Any:
    """The module experiments.<name>; an unknown name is an error listing the modules."""
    try:
        return importlib.import_module(f"{EXPERIMENTS_PACKAGE}.{name}")
    except ModuleNotFoundError as e:
        if e.name == f"{EXPERIMENTS_PACKAGE}.{name}":
            raise ConfigError(
                f"No experiment module '{name}'; available: {', '.join(experiment_modules())}"
            ) from e
        raise


def _config_sources(module: Optional[str]) -> dict[str, list[tuple[str, Builder]]]:
    """Config name -> every (module name, builder) defining it, over one module or all."""
    modules = [module] if module else experiment_modules()
    sources: dict[str, list[tuple[str, Builder]]] = {}
    for name in modules:
        mod = _experiment_module(name)
        for config_name, builder in mod.named_trainer_configs().items():
            sources.setdefault(config_name, []).append((name, builder))
    return sources


def named_configs(module: Optional[str] = None) -> dict[str, tuple[str, Builder]]:
    """Config name -> (module name, builder), over one module or all of them.

    Names that several modules define are left out: they need `--module`.
    """
    return {name: found[0] for name, found in _config_sources(module).items() if len(found) == 1}


def lookup_named_config(config_name: str, *, module: Optional[str] = None) -> tuple[str, Builder]:
    """(module name, builder) of `config_name`: the one lookup behind every tool's
    `--config`. With `module`, the builder is AXLearn's `config.get_named_trainer_config`'s;
    without, the one module defining the name. An unknown name is an error listing the
    close names."""
    if module:
        _experiment_module(module)
        try:
            root = EXPERIMENTS_PACKAGE.removesuffix("experiments").rstrip(".") or None
            builder = get_named_trainer_config(config_name, config_module=module, root_module=root)
            return module, builder
        except UnknownKeyError:
            pass  # The error below names the close names.
    sources = _config_sources(module)
    found = sources.get(config_name, [])
    if len(found) > 1:
        modules = ", ".join(m for m, _ in found)
        raise ConfigError(
            f"Config '{config_name}' is defined in several experiment modules ({modules}); "
            "choose one with --module"
        )
    if not found:
        close = close_names(config_name, sources, n=5, cutoff=0.4)
        hint = f" Did you mean: {', '.join(close)}?" if close else ""
        where = f"module '{module}'" if module else "the experiment modules"
        raise ConfigError(f"Unknown config '{config_name}' in {where}.{hint}")
    return found[0]


def build_named_config(config_name: str, *, module: Optional[str] = None) -> ConfigBase:
    """The trainer config `config_name` from `module` (or from the only module defining it)."""
    return lookup_named_config(config_name, module=module)[1]()


def _first_sentence(obj: Any) -> Optional[str]:
    doc = inspect.getdoc(obj)
    if not doc:
        return None
    paragraph = " ".join(doc.split("\n\n")[0].split())
    return paragraph.split(". ")[0].rstrip(".") + "."


def _short(value: Any) -> str:
    """A bound argument as a description shows it: classes and dtypes by their last name."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_short(v)}" for k, v in value.items()) + "}"
    name = qualified_name(value)
    return name.rsplit(".", 1)[-1] if name else repr(value)


DESCRIPTIONS_ATTRIBUTE = "DESCRIPTIONS"  # An experiment module's {config name: one line}.


def module_descriptions(module: str) -> dict[str, str]:
    """The `DESCRIPTIONS` of experiment module `module` ({} where it has none). A name it
    describes that the module does not define is an error (a rename left behind)."""
    mod = importlib.import_module(f"{EXPERIMENTS_PACKAGE}.{module}")
    descriptions = getattr(mod, DESCRIPTIONS_ATTRIBUTE, {})
    unknown = sorted(set(descriptions) - set(mod.named_trainer_configs()))
    if unknown:
        raise ConfigError(
            f"{mod.__name__}.{DESCRIPTIONS_ATTRIBUTE} describes {', '.join(unknown)}, which "
            "its named_trainer_configs() does not define"
        )
    return descriptions


def config_description(module: str, config_name: str, builder: Builder) -> str:
    """`config_name`'s line in its module's `DESCRIPTIONS`; without one, the builder's first
    docstring sentence, or for a functools.partial without a docstring of its own, its
    function's, followed by the arguments the partial binds."""
    described = module_descriptions(module).get(config_name)
    if described:
        return described
    if isinstance(builder, functools.partial) and "__doc__" not in vars(builder):
        bound = [_short(a) for a in builder.args]
        bound += [f"{k}={_short(v)}" for k, v in builder.keywords.items()]
        call = f"{builder.func.__name__}({', '.join(bound)})"
        return f"{_first_sentence(builder.func) or ''} [{call}]".lstrip()
    return _first_sentence(builder) or "(no docstring)"


def parameter_count(cfg: ConfigBase) -> int:
    """The model's parameters, counted from its parameter specs (no weights are made); a
    DPO model's are its policy's, without the frozen reference copy (as the trainer logs)."""
    from axlearn.common.causal_lm import count_parameters  # pylint: disable=import-outside-toplevel
    from axlearn.common.perf import reference_param_count  # pylint: disable=import-outside-toplevel

    model = cfg.model.clone(name="model").instantiate(parent=None)
    return count_parameters(model) - reference_param_count(model)


def list_configs_text(module: Optional[str] = None) -> str:
    """One line per named config: name, parameter count, description."""
    rows = []
    for name, found in sorted(_config_sources(module).items()):
        for mod, builder in found:
            shown = name if len(found) == 1 else f"{name} (--module={mod})"
            description = config_description(mod, name, builder)
            rows.append((shown, f"{parameter_count(builder()):,}", description))
    name_width = max(len(row[0]) for row in rows)
    count_width = max(len(row[1]) for row in rows)
    return "\n".join(
        f"{name:<{name_width}}  {count:>{count_width}} parameters  {description}"
        for name, count, description in rows
    )
