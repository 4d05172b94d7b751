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


UNTYPED = {"Any", "typing.Any", "Any | None", "None | Any", "Optional[Any]", "typing.Optional[Any]"}


def _is_untyped(annotation: ast.expr | None) -> bool:
    """Missing, or `Any` in any spelling (a quoted annotation is read as its text)."""
    if annotation is None:
        return True
    text = annotation.value if isinstance(annotation, ast.Constant) else ast.unparse(annotation)
    return str(text).replace(" ", "") in {u.replace(" ", "") for u in UNTYPED}


def _is_config_name(name: str) -> bool:
    return name in ("config", "args", "cfg") or name.endswith("_config")


def _untyped_configs(source: str, where: str) -> list[str]:
    """Parameters of every function (sync or async, methods included) named `config`, `args`, `cfg` or `*_config`
    whose annotation is missing or `Any` (`Any | None`, `Optional[Any]` too), and class attributes named `config`,
    `args` or `cfg` annotated `Any`; plus `getattr(args, ...)` reads. `*args: Any` (forwarded positionals) is not a
    config object and is not counted."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            arguments = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
            for arg in arguments:
                if _is_config_name(arg.arg) and _is_untyped(arg.annotation):
                    found.append(f"{where}:{node.lineno} {node.name}({arg.arg})")
        if isinstance(node, ast.ClassDef):
            for statement in node.body:
                if (
                    isinstance(statement, ast.AnnAssign)
                    and isinstance(statement.target, ast.Name)
                    and statement.target.id in ("config", "args", "cfg")
                    and _is_untyped(statement.annotation)
                ):
                    found.append(f"{where}:{statement.lineno} {node.name}.{statement.target.id}")
        if isinstance(node, ast.Call) and ast.unparse(node.func) == "getattr" and node.args:
            if ast.unparse(node.args[0]) in ("args", "self.args"):
                found.append(f"{where}:{node.lineno} getattr({ast.unparse(node.args[0])}, ...)")
    return found


def test_the_untyped_config_scan_catches_planted_examples():
    planted = (
        "from typing import Any, Optional\n"
        "def a(config: Any): ...\n"
        "async def b(*, args): ...\n"
        "class C:\n"
        "    config: Any\n"
        "    def m(self, cfg: Any | None = None): ...\n"
        "    async def n(self, model_config: Optional[Any] = None): ...\n"
        "def q(vllm_config: 'Any'): ...\n"
        "def d(args):\n"
        "    return getattr(args, 'x')\n"
    )
    found = _untyped_configs(planted, "planted.py")
    assert sorted(f.split(" ", 1)[1] for f in found) == sorted(
        [
            "a(config)",
            "b(args)",
            "C.config",
            "m(cfg)",
            "n(model_config)",
            "q(vllm_config)",
            "d(args)",
            "getattr(args, ...)",
        ]
    ), found
    typed = (
        "from typing import Any\n"
        "def a(config: TrainerConfig, *args: Any, peft_config: PeftConfig | None = None, **kwargs: Any): ...\n"
        "class C:\n"
        "    config: TrainerConfig\n"
        "    settings: Any\n"
    )
    assert _untyped_configs(typed, "typed.py") == []


def test_no_untyped_args_object_in_the_core():
    """Components take typed settings or the typed config, never a `config: Any` / `args: Any` read with getattr."""
    found = []
    for path in _sources("rlasync", "actors"):
        found += _untyped_configs(path.read_text(), str(path.relative_to(REPO)))
    assert not found, f"untyped config objects (type them: TrainerConfig, the component's settings, ...): {found}"
