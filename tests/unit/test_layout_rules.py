"""Layout rules that keep the code easy to read (docs/design.md §2): file sizes, thin actors, and references that
point only at documents the repository contains."""

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# A ceiling, not a splitter: a readable 700-line file beats two halves that read each other's privates.
MAX_LINES = 800
MAX_ACTOR_LINES = 200


def _sources(*roots: str) -> list[Path]:
    return sorted(p for root in roots for p in (REPO / root).rglob("*.py"))


def _defines_ray_actor(tree: ast.Module) -> bool:
    """A class decorated with `@ray.remote` (or `@ray.remote(...)`): an actor module."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for decorator in node.decorator_list:
                target = decorator.func if isinstance(decorator, ast.Call) else decorator
                if ast.unparse(target) in ("ray.remote", "remote"):
                    return True
    return False


@pytest.mark.parametrize("path", _sources("rlasync", "actors"), ids=lambda p: str(p.relative_to(REPO)))
def test_no_source_file_is_over_the_line_limit(path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{path.relative_to(REPO)} has {lines} lines (> {MAX_LINES}): split it where a seam is"


def test_actor_modules_are_thin():
    actor_modules = [p for p in _sources("actors") if _defines_ray_actor(ast.parse(p.read_text()))]
    assert len(actor_modules) >= 6, actor_modules  # the queue, rollout, generation, reward, teacher, learner actors
    too_long = {
        str(p.relative_to(REPO)): n for p in actor_modules if (n := len(p.read_text().splitlines())) > MAX_ACTOR_LINES
    }
    assert not too_long, f"actor modules over {MAX_ACTOR_LINES} lines (move the logic into the core): {too_long}"


CITATION = re.compile(r"docs/(?P<doc>[\w.-]+\.md)(?: §(?P<section>\d+(?:\.\d+)*))?")
FOREIGN = re.compile(r"\bSPEC\b|DESIGN\.md|SPEC\.md")


def _documents() -> dict[str, set[str]]:
    """docs/<name>.md -> the section numbers its headings define ("## 4.2 Layout" defines "4.2")."""
    sections: dict[str, set[str]] = {}
    for doc in (REPO / "docs").glob("*.md"):
        numbers = set()
        for line in doc.read_text().splitlines():
            match = re.match(r"#+\s+(\d+(?:\.\d+)*)\.?\s", line)
            if match:
                numbers.add(match.group(1))
        sections[doc.name] = numbers
    return sections


def _texts() -> list[Path]:
    return [
        p
        for root in ("rlasync", "actors", "tests", "bench", "examples", "configs", "deploy")
        for p in (REPO / root).rglob("*")
        if p.suffix in (".py", ".md", ".yaml", ".toml")
    ] + [REPO / "README.md"]


def test_every_document_reference_resolves():
    documents = _documents()
    assert {"design.md", "algorithms.md"} <= set(documents)
    broken, foreign = [], []
    for path in _texts():
        if path == Path(__file__):
            continue
        text = path.read_text()
        for match in CITATION.finditer(text):
            doc, section = match.group("doc"), match.group("section")
            if doc not in documents or (section and section not in documents[doc]):
                broken.append(f"{path.relative_to(REPO)}: {match.group(0)}")
        foreign += [f"{path.relative_to(REPO)}: {m.group(0)}" for m in FOREIGN.finditer(text)]
    assert not broken, f"references to sections the docs do not have: {broken[:20]}"
    assert not foreign, f"references to documents outside the repository: {foreign[:20]}"


def test_no_untyped_args_object_in_the_core():
    """Components take typed settings or the typed config, never an `args: Any` read with getattr."""
    found = []
    for path in _sources("rlasync"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                arguments = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
                for arg in arguments:
                    if arg.arg == "args" and (arg.annotation is None or ast.unparse(arg.annotation) == "Any"):
                        found.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name}")
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "getattr" and node.args:
                if ast.unparse(node.args[0]) in ("args", "self.args"):
                    found.append(f"{path.relative_to(REPO)}:{node.lineno} getattr({ast.unparse(node.args[0])}, ...)")
    assert not found, f"untyped args objects: {found}"
