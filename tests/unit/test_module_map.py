"""docs/design.md's tree (§2.2) and module map (§2.3) match the code: every path they name exists, every file a
map row names inside its folder exists, and every package and top-level module of rlasync/ and every file of
actors/ is named somewhere in them. A file moved, added or removed without the docs following fails here."""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1].parent
DESIGN = REPO / "docs" / "design.md"


def _section(title_pattern: str) -> str:
    text = DESIGN.read_text()
    match = re.search(rf"^### {title_pattern}\n(.*?)(?=^##)", text, re.S | re.M)
    assert match, f"docs/design.md has no section matching {title_pattern!r}"
    return match.group(1)


def _map_rows() -> list[tuple[list[str], str]]:
    """(paths of the first column, the role text) of each module-map row."""
    rows = []
    for line in _section(r"2\.3 Module map").splitlines():
        if not line.startswith("| `"):
            continue
        first, role = line.split(" | ", 1)
        rows.append((re.findall(r"`([^`]+)`", first), role))
    return rows


def _tree_text() -> str:
    return _section(r"2\.2 The tree")


def test_every_path_the_map_names_exists():
    missing = []
    for paths, role in _map_rows():
        for path in paths:
            if not (REPO / path.rstrip("/")).exists():
                missing.append(path)
            folder = REPO / path
            if path.endswith("/") and folder.is_dir():  # files a folder's row names by their bare name
                for name in re.findall(r"`([\w/]+\.py)`", role):
                    if "/" not in name and not (folder / name).exists():
                        missing.append(f"{path}{name}")
    assert not missing, f"docs/design.md §2.3 names paths that do not exist: {missing}"


def _exists_somewhere(name: str) -> bool:
    """A `x.py` or `x/` the tree names exists under rlasync/ or actors/ (the tree nests names; it has no paths)."""
    stem = name.rstrip("/")
    return any(
        p.name == stem and (p.is_dir() == name.endswith("/"))
        for root in (REPO / "rlasync", REPO / "actors")
        for p in [root, *root.rglob(stem)]
    )


def test_every_path_the_tree_names_exists():
    text = _tree_text()
    block = re.search(r"```\n(.*?)```", text, re.S).group(1)
    names = {name for line in block.splitlines() for name in re.findall(r"(?<![\w.-])([a-z_]+(?:\.py|/))", line)}
    assert {"rlasync/", "actors/", "algorithms/", "grpo/", "distill/", "spec.py"} <= names
    missing = sorted(name for name in names if not _exists_somewhere(name))
    assert not missing, f"docs/design.md §2.2's tree names files or folders that do not exist: {missing}"
    sample_path = text.split("```")[-1]  # one sample through the tree: every `folder/file.py` it names exists
    paths = re.findall(r"`((?:[a-z_]+/)+[a-z_]+\.py)`", sample_path)
    assert len(paths) > 15, paths
    gone = [p for p in paths if not ((REPO / p).exists() or (REPO / "rlasync" / p).exists())]
    assert not gone, f"§2.2's sample path names files that do not exist: {gone}"


def test_every_package_and_actor_file_is_in_the_docs():
    named = " ".join(path for paths, _ in _map_rows() for path in paths) + " " + _tree_text()
    roles = " ".join(role for _, role in _map_rows())
    unnamed = []
    for entry in sorted((REPO / "rlasync").iterdir()):
        if entry.name.startswith(("_", ".")) and entry.name != "__main__.py":
            continue
        if entry.is_dir() or entry.suffix == ".py":
            key = f"rlasync/{entry.name}" + ("/" if entry.is_dir() else "")
            if key not in named:
                unnamed.append(key)
    for entry in sorted((REPO / "actors").glob("*.py")):
        if entry.name != "__init__.py" and entry.name not in named + roles:
            unnamed.append(f"actors/{entry.name}")
    for entry in sorted((REPO / "rlasync" / "algorithms").iterdir()):
        if entry.is_dir() and not entry.name.startswith("_") and f"rlasync/algorithms/{entry.name}/" not in named:
            unnamed.append(f"rlasync/algorithms/{entry.name}/")
    assert not unnamed, f"not in docs/design.md §2.2/§2.3 (add a row or a line): {unnamed}"
