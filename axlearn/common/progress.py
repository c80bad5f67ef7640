"""Progress bars for the long waits of a run: restoring a checkpoint, an evaluation pass.

A bar is drawn on stderr by process 0 only, and only where a person watches: on a
terminal. In a log file a bar is noise, so without a TTY none is drawn unless the
environment variable `AXLEARN_PROGRESS_BARS=1` asks for one; `AXLEARN_PROGRESS_BARS=0`
turns them off everywhere.
"""

import os
import sys
from typing import Optional

from tqdm import tqdm

# Environment variable: '1' draws bars even without a TTY, '0' never; unset: on a TTY.
PROGRESS_BARS_ENV = "AXLEARN_PROGRESS_BARS"


def _disable() -> Optional[bool]:
    """tqdm's `disable`: True (no bar), False (a bar) or None (a bar on a TTY only)."""
    import jax  # pylint: disable=import-outside-toplevel

    if jax.process_index() != 0:
        return True
    setting = os.environ.get(PROGRESS_BARS_ENV, "").strip()
    if setting not in ("", "0", "1"):
        raise ValueError(f"{PROGRESS_BARS_ENV}={setting!r}: expected 0, 1 or unset")
    return {"": None, "0": True, "1": False}[setting]


def progress_bar(*, total: Optional[int], desc: str, unit: str) -> tqdm:
    """A bar of `total` items (None: a count without an end), updated with `update()`
    per item and closed (erased) by the caller, e.g. as a context manager."""
    return tqdm(
        total=total,
        desc=desc,
        unit=unit,
        file=sys.stderr,
        disable=_disable(),
        leave=False,  # The log line that follows the wait reports its result.
        dynamic_ncols=True,
    )
