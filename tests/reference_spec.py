"""Where the tests find the reference files kept beside the repository, in shared/: the
spec (the 2.7B trainer config whose names, fields and text format the library follows,
shared/spec/) and AXLearn's goldens (shared/axlearn_goldens/). They are not part of the
repository; tests that need them skip where they are absent.

Each is found through its environment variable (AXLEARN_SPEC: the spec file;
AXLEARN_GOLDENS: the goldens' directory), else in shared/ beside the checkout (CI clones
the repository into a folder with shared/ next to it).
"""

import os
import pathlib
from typing import Optional

import pytest

NAME = "000_f33cfaded1b52723.txt"
SPEC_ENV = "AXLEARN_SPEC"
_REPO = pathlib.Path(__file__).resolve().parents[1]


def shared_path(env_var: str, relative: str) -> Optional[pathlib.Path]:
    """The path `$env_var` names, else `shared/<relative>` beside the checkout if it
    exists, else None. A variable naming a missing path is an error, not a skip."""
    named = os.environ.get(env_var)
    if named:
        if not pathlib.Path(named).exists():
            raise FileNotFoundError(f"{env_var}={named}: no such file or directory")
        return pathlib.Path(named)
    beside = _REPO.parent / "shared" / relative
    return beside if beside.exists() else None


def find() -> Optional[pathlib.Path]:
    """The spec's path, or None where no copy is found."""
    return shared_path(SPEC_ENV, f"spec/{NAME}")


def path() -> pathlib.Path:
    """The spec's path; skips the calling test where no copy is found."""
    found = find()
    if found is None:
        pytest.skip(f"the spec {NAME} was not found (set {SPEC_ENV} to its path)")
    return found


def lines_with_prefix(prefix: str) -> list[str]:
    """The spec's lines under `prefix` (e.g. 'model.'), the prefix removed."""
    lines = path().read_text(encoding="utf-8").splitlines()
    return [line[len(prefix) :] for line in lines if line.startswith(prefix)]
