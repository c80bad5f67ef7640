"""Where the tests find the reference golden dump (the spec): the 2.7B trainer config whose
names, fields and text format the library follows. It is not part of the repository; the
project keeps it beside it, in shared/spec/. Tests that need it skip where it is absent.
"""

import os
import pathlib
from typing import Optional

import pytest

NAME = "000_f33cfaded1b52723.txt"
_REPO = pathlib.Path(__file__).resolve().parents[1]
# In order: a copy named by AXLEARN_SPEC, shared/ beside this checkout, and the project
# workspace's own shared/ (for clones made elsewhere on the same machine, such as CI's).
_CANDIDATES = (
    os.environ.get("AXLEARN_SPEC"),
    _REPO.parent / "shared" / "spec" / NAME,
    pathlib.Path("/work/shared/spec") / NAME,
)


def find() -> Optional[pathlib.Path]:
    """The spec's path, or None where no copy is found."""
    for candidate in _CANDIDATES:
        if candidate and pathlib.Path(candidate).is_file():
            return pathlib.Path(candidate)
    return None


def path() -> pathlib.Path:
    """The spec's path; skips the calling test where no copy is found."""
    found = find()
    if found is None:
        pytest.skip(f"the spec {NAME} was not found (set AXLEARN_SPEC to its path)")
    return found


def lines_with_prefix(prefix: str) -> list[str]:
    """The spec's lines under `prefix` (e.g. 'model.'), the prefix removed."""
    lines = path().read_text(encoding="utf-8").splitlines()
    return [line[len(prefix) :] for line in lines if line.startswith(prefix)]
