"""The persistent compilation cache and other JAX options of a launch.

A start that finds its programs compiled by an earlier start (a restart of the same run, a
preempted run that resumes, a new run of the same config) loads them instead of compiling
them again. The cache is jax's own persistent compilation cache; `configure` places it:

- `--jax_compilation_cache_dir` unset: `$JAX_COMPILATION_CACHE_DIR` where set (jax's own
  variable; the test suite sets it), else a directory in the user's cache
  (`$XDG_CACHE_HOME/axlearn/jax`, by default `~/.cache/axlearn/jax`); `none`: no cache.
- A local path, or a URL: `gs://`, `s3://` (and the other TensorStore stores of
  `file_system`). jax reads URLs through `etils[epath]` where it is installed; without
  it, through `file_system` (`KvStoreCache`).
- Programs that compiled in under jax's `jax_persistent_cache_min_compile_time_secs`
  (1 s by default) are not stored; `--jax_config=KEY=VALUE` sets that and any other
  option of `jax.config`, type-checked against the option's current value.

A cache directory that cannot be made or written is one warning, and the run compiles as
it would without one; so are entries that cannot be loaded (written by another jax, or
damaged): jax compiles those programs again and overwrites them.

`CacheOutcome` tells a compile that loaded from the cache from one that did not (the
trainer logs it with the train step's compile time).

`CompiledAhead` compiles (or loads from the cache) a jitted function for abstract
arguments in a thread while the caller does other work: the trainer's train step, while
the state is restored or initialized; with an `executable_store.ExecutableStore` it loads
the executable an earlier start stored for those arguments instead, skipping the trace
too, and stores the one it compiles. `abstract_mismatch` says whether the concrete
arguments are those it was compiled for.
"""

import contextlib
import logging
import os
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any, ContextManager, Optional

from axlearn.common import executable_store, file_system
from axlearn.common.config import ConfigError, close_names

log = logging.getLogger(__name__)

# jax's own variable for the cache directory, read when no flag names one.
CACHE_DIR_ENV = "JAX_COMPILATION_CACHE_DIR"
# The flag values that turn the cache off.
_OFF = ("", "none")
# jax's warning for an entry it could not load (it then compiles the program).
_READ_ERROR_PREFIX = "Error reading persistent compilation cache entry"
_HIT_EVENT = "/jax/compilation_cache/cache_hits"
_MISS_EVENT = "/jax/compilation_cache/cache_misses"


def default_cache_dir() -> str:
    """The user's cache directory for compiled programs: $XDG_CACHE_HOME/axlearn/jax, or
    ~/.cache/axlearn/jax."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "axlearn", "jax")


def resolve_cache_dir(flag: Optional[str]) -> Optional[str]:
    """The cache directory that `flag` (--jax_compilation_cache_dir) names: unset, the
    environment's or the user's cache (module docstring); None for no cache."""
    if flag is None:
        flag = os.environ.get(CACHE_DIR_ENV) or default_cache_dir()
    if flag.strip().lower() in _OFF:
        return None
    return flag


# ----- --jax_config -----


def _parse_value(key: str, text: str, current: Any) -> Any:
    """`text` as a value of the jax option `key` whose value is now `current`."""
    text = text.strip()
    if isinstance(current, bool):
        lowered = text.lower()
        if lowered in ("true", "1", "yes"):
            return True
        if lowered in ("false", "0", "no"):
            return False
        raise ConfigError(f"--jax_config={key}={text}: expected true or false")
    if isinstance(current, int):
        try:
            return int(text)
        except ValueError:
            raise ConfigError(f"--jax_config={key}={text}: expected an int") from None
    if isinstance(current, float):
        try:
            return float(text)
        except ValueError:
            raise ConfigError(f"--jax_config={key}={text}: expected a number") from None
    if current is None and text.lower() == "none":
        return None
    return text  # A string option, or one unset (None) whose type jax checks on update.


def parse_jax_configs(entries: Sequence[str]) -> list[tuple[str, Any]]:
    """[(option, value)] of --jax_config=KEY=VALUE entries, each KEY an option of
    jax.config and VALUE parsed as its type; ConfigError (one line) for a bad entry."""
    import jax  # pylint: disable=import-outside-toplevel

    values = jax.config.values
    parsed = []
    for entry in entries:
        key, sep, text = entry.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"--jax_config={entry}: expected KEY=VALUE, e.g. jax_debug_nans=true")
        if key not in values and f"jax_{key}" in values:
            key = f"jax_{key}"
        if key not in values:
            close = close_names(key, values)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise ConfigError(f"--jax_config={entry}: jax has no option {key}{hint}")
        parsed.append((key, _parse_value(key, text, values[key])))
    return parsed


def apply_jax_configs(updates: Sequence[tuple[str, Any]]) -> None:
    """jax.config.update for each (option, value); ConfigError (one line) for a value jax
    refuses (an enum option's unknown choice)."""
    import jax  # pylint: disable=import-outside-toplevel

    for key, value in updates:
        try:
            jax.config.update(key, value)
        except (ValueError, TypeError) as e:
            raise ConfigError(f"--jax_config={key}={value}: {e}") from None


# ----- the cache -----


class KvStoreCache:
    """A jax compilation cache over `file_system` (TensorStore): one object per entry under
    a URL, for a bucket where etils[epath], jax's own route to it, is not installed.
    (`kvstore_cache` makes it a subclass of jax's cache interface.)"""

    def __init__(self, url: str):
        self._url = url
        self._path = url  # jax's log lines name the cache by it.

    def get(self, key: str) -> Optional[bytes]:
        try:
            return file_system.read_bytes(file_system.join(self._url, f"{key}-cache"))
        except FileNotFoundError:
            return None

    def put(self, key: str, value: bytes) -> None:
        file_system.write_bytes(file_system.join(self._url, f"{key}-cache"), value)


def kvstore_cache(url: str) -> KvStoreCache:
    """A KvStoreCache at `url` that is also an instance of jax's CacheInterface."""
    # pylint: disable-next=import-outside-toplevel
    from jax._src.compilation_cache_interface import CacheInterface

    class _JaxKvStoreCache(KvStoreCache, CacheInterface):
        pass

    return _JaxKvStoreCache(url)


def _install_kvstore_cache(url: str) -> bool:
    """Makes `kvstore_cache(url)` jax's persistent cache; False where this jax keeps its
    cache elsewhere than the module globals this knows (jax 0.10, 0.11)."""
    # pylint: disable-next=import-outside-toplevel
    from jax._src import compilation_cache as jax_cache

    if not all(hasattr(jax_cache, name) for name in ("_cache", "_cache_initialized_mutex")):
        return False
    with jax_cache._cache_initialized_mutex:  # pylint: disable=protected-access
        jax_cache._cache = kvstore_cache(url)  # pylint: disable=protected-access
        jax_cache._cache_initialized = True  # pylint: disable=protected-access
    return True


def _local_dir_problem(path: str) -> Optional[str]:
    """Why the local directory `path` cannot hold the cache (made here if missing), or None."""
    probe = os.path.join(path, f".axlearn-probe-{os.getpid()}")
    try:
        os.makedirs(path, exist_ok=True)
        with open(probe, "wb"):
            pass
        os.remove(probe)
    except OSError as e:
        return e.strerror or str(e)
    return None


class _OneReadWarning:
    """Turns jax's warnings for cache entries it could not load (one per program) into one
    warning line for the process; other warnings pass on unchanged."""

    def __init__(self, cache_dir: str):
        self._cache_dir = cache_dir
        self._warned = False
        self._lock = threading.Lock()
        self._show = warnings.showwarning

    def __call__(self, message, category, filename, lineno, file=None, line=None):
        text = str(message)
        if not text.startswith(_READ_ERROR_PREFIX):
            self._show(message, category, filename, lineno, file, line)
            return
        with self._lock:
            if self._warned:
                return
            self._warned = True
        detail = text.split(": ", 1)[-1]
        log.warning(
            "The compilation cache at %s holds entries this jax cannot load (%s): compiling "
            "those programs instead, and replacing the entries",
            self._cache_dir, detail[:200],
        )


_read_warning: Optional[_OneReadWarning] = None


def configure(cache_dir_flag: Optional[str], jax_configs: Sequence[str] = ()) -> Optional[str]:
    """Places jax's persistent compilation cache (`resolve_cache_dir(cache_dir_flag)`) and
    applies the --jax_config entries (which win over the cache's settings); returns the
    cache directory in use, None for none. Call before the first compile."""
    global _read_warning  # pylint: disable=global-statement
    import jax  # pylint: disable=import-outside-toplevel

    updates = parse_jax_configs(jax_configs)  # A bad entry fails before anything changes.
    cache_dir = resolve_cache_dir(cache_dir_flag)
    if cache_dir is not None and file_system.is_local(cache_dir):
        cache_dir = os.path.abspath(file_system.local_path(cache_dir))
        problem = _local_dir_problem(cache_dir)
        if problem is not None:
            log.warning(
                "The compilation cache directory %s cannot be used (%s): compiling every "
                "program (--jax_compilation_cache_dir=DIR places the cache elsewhere)",
                cache_dir, problem,
            )
            cache_dir = None
    jax.config.update("jax_compilation_cache_dir", cache_dir)
    # pylint: disable-next=import-outside-toplevel
    from jax._src import compilation_cache as jax_cache

    if getattr(jax_cache, "_cache_initialized", True):
        jax_cache.reset_cache()  # An earlier compile of this process opened another one.
    if cache_dir is not None and not file_system.is_local(cache_dir):
        # pylint: disable-next=import-outside-toplevel
        from jax._src import path as jax_path

        if not getattr(jax_path, "epath_installed", False) and not _install_kvstore_cache(
            cache_dir
        ):
            raise ConfigError(
                f"--jax_compilation_cache_dir={cache_dir}: this jax reads a bucket only through "
                "etils[epath] (pip install 'etils[epath]' gcsfs s3fs), which is not installed"
            )
    apply_jax_configs(updates)
    if cache_dir is not None and _read_warning is None:
        _read_warning = _OneReadWarning(cache_dir)
        warnings.showwarning = _read_warning
    if cache_dir is not None:
        log.info("Compilation cache: %s (--jax_compilation_cache_dir)", cache_dir)
    return cache_dir


# ----- hits and misses -----

_counts_by_thread: dict[int, list[int]] = {}
_counts_lock = threading.Lock()
_listener_registered = False


def _record_event(event: str, **kwargs) -> None:
    del kwargs
    if event in (_HIT_EVENT, _MISS_EVENT):
        counts = _counts_by_thread.setdefault(threading.get_ident(), [0, 0])
        counts[0 if event == _HIT_EVENT else 1] += 1


def _thread_counts() -> tuple[int, int]:
    """(cache hits, cache misses) of the calling thread's compiles so far."""
    global _listener_registered  # pylint: disable=global-statement
    import jax  # pylint: disable=import-outside-toplevel

    with _counts_lock:
        if not _listener_registered:
            jax.monitoring.register_event_listener(_record_event)
            _listener_registered = True
    hits, misses = _counts_by_thread.get(threading.get_ident(), (0, 0))
    return hits, misses


class CacheOutcome:
    """Where the programs that this thread compiles from its creation on came from:
    `describe()` after the compile says so in a few words."""

    def __init__(self):
        self._start = _thread_counts()

    def counts(self) -> tuple[int, int]:
        """(programs loaded from the cache, programs compiled and looked up in vain) since
        creation."""
        hits, misses = _thread_counts()
        return hits - self._start[0], misses - self._start[1]

    def describe(self) -> str:
        import jax  # pylint: disable=import-outside-toplevel

        cache_dir = jax.config.values.get("jax_compilation_cache_dir")
        if not cache_dir:
            return "no compilation cache"
        hits, misses = self.counts()
        if hits and not misses:
            return "loaded from the compilation cache"
        if hits:
            return f"{hits} of {hits + misses} programs from the compilation cache"
        return "not in the compilation cache"


# ----- compiling ahead -----


class CompiledAhead:
    """`jitted` compiled in a thread for the abstract arguments `args_fn()` returns (a tuple
    of trees of `jax.ShapeDtypeStruct`s with shardings; computed in the thread, inside
    `context()`). `result()` waits for the executable and raises what the compile raised,
    as a first call of `jitted` would have; `wait()` waits without raising. The thread logs
    the compile as `perf.compile_notice` does (`what`, its seconds and `CacheOutcome`), or
    the load from `store` where that holds the executable for these arguments."""

    def __init__(
        self,
        jitted: Any,
        args_fn: Callable[[], tuple],
        *,
        what: str,
        log_fn: Callable[[str], None],
        context: Callable[[], ContextManager] = contextlib.nullcontext,
        store: Optional["executable_store.ExecutableStore"] = None,
    ):
        self.args: Optional[tuple] = None  # The abstract arguments, once computed.
        # Where an earlier start's executable is loaded from and this one's is stored.
        self.store = store
        self.seconds = 0.0  # Spent compiling (perf.compile_seconds), once done.
        self.outcome = ""  # Where the programs came from (CacheOutcome.describe), once done.
        self.loaded = False  # Whether `store` held the executable (nothing was traced).
        self._compiled = None
        self._error: Optional[BaseException] = None
        self._thread = threading.Thread(
            target=self._compile,
            args=(jitted, args_fn, what, log_fn, context),
            name=f"compile {what}",
            daemon=True,
        )
        self._thread.start()

    def _compile(self, jitted, args_fn, what, log_fn, context) -> None:
        from axlearn.common import perf  # pylint: disable=import-outside-toplevel

        outcome = CacheOutcome()
        before = perf.compile_seconds()
        try:
            with context():
                self.args = args_fn()
                key = None if self.store is None else self.store.key(self.args)
                if key is not None:
                    start = time.perf_counter()
                    self._compiled = self.store.load(key)
                    if self._compiled is not None:
                        self.loaded = True
                        self.seconds = time.perf_counter() - start
                        self.outcome = f"loaded whole from {self.store.directory}, not traced"
                        took = f"{self.seconds:.1f}s"
                        log_fn(f"Loaded {what} as compiled by an earlier start in {took}")
                        return
                with perf.compile_notice(what, log_fn, note=outcome.describe):
                    self._compiled = jitted.lower(*self.args).compile()
                if key is not None:
                    self.store.save(key, self._compiled)
        except BaseException as e:  # pylint: disable=broad-except
            self._error = e  # Raised by result(), in the caller's thread.
        finally:
            if not self.loaded:
                self.seconds = perf.compile_seconds() - before
                self.outcome = outcome.describe()

    def done(self) -> bool:
        return not self._thread.is_alive()

    @property
    def compiled(self) -> Any:
        """The executable; None until compiled, or where the compile failed."""
        return self._compiled

    def wait(self) -> None:
        """Returns once the compile has ended, however it ended."""
        self._thread.join()

    def result(self) -> Any:
        """The compiled executable (`jax.stages.Compiled`), once ready; the compile's error,
        raised here, where it failed."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._compiled


def _describe_leaf(leaf: Any) -> str:
    import numpy as np  # pylint: disable=import-outside-toplevel

    shape = getattr(leaf, "shape", None)
    dtype = getattr(leaf, "dtype", None)
    if shape is None or dtype is None:
        return f"a {type(leaf).__name__}"
    return f"{np.dtype(dtype).name}{list(shape)}"


def abstract_mismatch(expected: Any, actual: Any, what: str) -> Optional[str]:
    """Where the arrays (or abstract values) `actual` differ from `expected` (a tree of
    `jax.ShapeDtypeStruct`s with shardings) in structure, shape, dtype or sharding: a few
    words naming the first leaf of `what` that differs; None where they agree."""
    import jax  # pylint: disable=import-outside-toplevel

    want, want_tree = jax.tree_util.tree_flatten_with_path(expected)
    got, got_tree = jax.tree_util.tree_flatten_with_path(actual)
    if want_tree != got_tree:
        want_paths = {jax.tree_util.keystr(path) for path, _ in want}
        got_paths = {jax.tree_util.keystr(path) for path, _ in got}
        parts = []
        extra, missing = sorted(got_paths - want_paths), sorted(want_paths - got_paths)
        if extra:
            parts.append(f"has {', '.join(extra[:3])}{' ...' if len(extra) > 3 else ''}")
        if missing:
            parts.append(f"lacks {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}")
        return f"{what} {' and '.join(parts) or 'is a tree of another kind'}"
    for (path, w), (_, g) in zip(want, got):
        name = f"{what}{jax.tree_util.keystr(path)}"
        if _describe_leaf(g) != _describe_leaf(w):
            return f"{name} is {_describe_leaf(g)}, expected {_describe_leaf(w)}"
        sharding = getattr(g, "sharding", None)
        if sharding is None or not sharding.is_equivalent_to(w.sharding, len(w.shape)):
            return f"{name} is sharded as {sharding}, expected {w.sharding}"
    return None
