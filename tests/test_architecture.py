"""docs/architecture.md's floors are the code's: every module of the library has one floor
in its table, and no module imports from a floor above its own.

The table is read from the document itself, so a new module, or an import that climbs,
fails here until the document says where it lives.
"""

import ast
import fnmatch
import pathlib
import re

REPO = pathlib.Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "architecture.md"
PACKAGES = ("axlearn", "experiments")


def _floor_patterns() -> list[tuple[int, str]]:
    """(floor, path pattern relative to the repository) of each name in the floors table:
    `x.py` and `input_*.py` under axlearn/common/, `kernels/` a folder there, and names
    given with a path (`axlearn/bench.py`, `experiments/`) as they are."""
    text = DOC.read_text(encoding="utf-8")
    section = text.split("## The floors", 1)[1].split("\n## ", 1)[0]
    patterns = []
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) < 2 or not cells[0].isdigit():
            continue
        for name in re.findall(r"`([^`]+)`", cells[1]):
            path = name if "/" in name.rstrip("/") else f"axlearn/common/{name}"
            patterns.append((int(cells[0]), path + "**" if path.endswith("/") else path))
    return patterns


def _modules() -> list[pathlib.Path]:
    return sorted(
        path.relative_to(REPO)
        for package in PACKAGES
        for path in (REPO / package).rglob("*.py")
        if path.name != "__init__.py"
    )


def _floor_of(path: pathlib.Path, patterns: list[tuple[int, str]]) -> list[int]:
    return [floor for floor, pattern in patterns if fnmatch.fnmatch(str(path), pattern)]


def _module_path(name: str) -> pathlib.Path:
    """The file of module `name` (a package's: its __init__.py's folder's first module)."""
    path = REPO / pathlib.Path(*name.split("."))
    return path.with_suffix(".py").relative_to(REPO)


def _imports(path: pathlib.Path) -> list[tuple[int, str]]:
    """(line, module) of every import of our packages in `path`, lazy ones included."""
    tree = ast.parse((REPO / path).read_text(encoding="utf-8"))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{alias.name}" for alias in node.names]
            found += [(node.lineno, name) for name in names]
        elif isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
    return [(line, name) for line, name in found if name.split(".")[0] in PACKAGES]


def _imported_module(name: str) -> pathlib.Path | None:
    """The module file an imported name lives in (`a.b.c` is a/b/c.py, or a/b.py's `c`)."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        path = REPO / pathlib.Path(*parts[:end])
        if path.with_suffix(".py").is_file():
            return path.with_suffix(".py").relative_to(REPO)
        if (path / "__init__.py").is_file():
            return None  # A package itself: its __init__ holds nothing floors rank.
    return None


def test_every_module_has_exactly_one_floor():
    patterns = _floor_patterns()
    floors = {path: _floor_of(path, patterns) for path in _modules()}
    missing = [str(path) for path, found in floors.items() if not found]
    several = [f"{path} {found}" for path, found in floors.items() if len(set(found)) > 1]
    assert not missing, f"modules docs/architecture.md's floors leave out: {missing}"
    assert not several, f"modules on more than one floor: {several}"


def test_no_module_imports_from_a_floor_above_its_own():
    patterns = _floor_patterns()
    upward = []
    for path in _modules():
        floor = max(_floor_of(path, patterns), default=None)
        if floor is None:
            continue  # Reported by the test above.
        for line, name in _imports(path):
            target = _imported_module(name)
            target_floor = max(_floor_of(target, patterns), default=None) if target else None
            if target_floor is not None and target_floor > floor:
                upward.append(f"{path}:{line} (floor {floor}) imports {name} (floor {target_floor})")
    assert not upward, "imports that climb:\n" + "\n".join(upward)
