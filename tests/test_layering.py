"""The layering of serve/: api -> scheduling -> engine -> onnxruntime, one direction only.

Every import of every module counts, the ones inside functions and under TYPE_CHECKING too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SERVE = Path(__file__).resolve().parent.parent / "serve"
PROTOCOLS = (
    "grpc",
    "grpc_health",
    "grpc_reflection",
    "google.protobuf",
    "serve._proto",
    "fastapi",
    "starlette",
)
ONNX = ("onnxruntime", "onnx")
# The engine's public value types, which the front end builds requests from and reports.
ENGINE_TYPES = ("serve.engine.types", "serve.engine.sampling")


def imports_of(source: str) -> set[str]:
    """Every module a source imports (for `from a import b`: `a` and `a.b`, since b may be a module)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def is_under(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def modules(room: str) -> dict[str, set[str]]:
    """Each module of a room (a folder of serve/, or "" for the modules every layer shares: errors, bundle,
    process) and what it imports. serve/__main__.py is the front end's entry point (`python -m serve`)."""
    files = (
        (SERVE / room).rglob("*.py") if room else (f for f in SERVE.glob("*.py") if f.name != "__main__.py")
    )
    return {
        str(f.relative_to(SERVE.parent)): imports_of(f.read_text()) for f in files if "_proto" not in f.parts
    }


def offenders(room: str, forbidden: tuple[str, ...]) -> dict[str, list[str]]:
    found = {
        path: sorted(m for m in imported if is_under(m, forbidden))
        for path, imported in modules(room).items()
    }
    return {path: bad for path, bad in found.items() if bad}


def test_the_checker_sees_every_kind_of_import() -> None:
    source = (
        "import grpc\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from serve.api import server\n"
        "def f():\n    import onnxruntime as ort\n"
    )
    imported = imports_of(source)
    assert {"grpc", "serve.api", "serve.api.server", "onnxruntime"} <= imported
    assert is_under("serve.api.server", ("serve.api",)) and not is_under("serve.apix", ("serve.api",))


@pytest.mark.parametrize("room", ["", "api", "scheduling", "engine"])
def test_serve_never_imports_torch_or_export(room: str) -> None:
    assert offenders(room, ("torch", "transformers", "export")) == {}


@pytest.mark.parametrize("room", ["", "api", "scheduling"])
def test_only_the_engine_imports_onnx_runtime(room: str) -> None:
    assert offenders(room, ONNX) == {}


@pytest.mark.parametrize("room", ["", "scheduling", "engine"])
def test_nothing_below_the_front_end_knows_a_protocol_or_the_front_end(room: str) -> None:
    assert offenders(room, (*PROTOCOLS, "serve.api")) == {}


def test_the_engine_never_imports_the_layers_above_it() -> None:
    assert offenders("engine", ("serve.scheduling", "serve.api")) == {}


def test_the_front_end_reaches_the_engine_only_through_its_public_types() -> None:
    reached = {
        path: sorted(m for m in imported if is_under(m, ("serve.engine",)) and not is_under(m, ENGINE_TYPES))
        for path, imported in modules("api").items()
    }
    assert {path: bad for path, bad in reached.items() if bad} == {}
    assert modules("api"), "no front-end modules found: the test would pass on nothing"


WEB = ("fastapi", "starlette", "uvicorn")
# The folders of serve/api/ that speak HTTP: the shared parts, and each API's.
HTTP_ROOMS = {"http", "openai", "anthropic"}


def test_only_the_http_rooms_know_the_web_framework() -> None:
    outside = {
        path: bad for path, bad in offenders("api", WEB).items() if not HTTP_ROOMS & set(Path(path).parts)
    }
    assert outside == {}


@pytest.mark.parametrize(
    "module",
    [
        "openai/protocol",
        "openai/translate_completions",
        "openai/translate_chat",
        "openai/translate_responses",
        "openai/structured_output",
        "openai/logprobs",
        "openai/refusals",
        "http/fields",
        "http/translate",
        "http/constraints",
        "http/vocabulary",
        "anthropic/protocol",
        "anthropic/translate",
    ],
)
def test_the_http_translation_is_free_of_the_web_framework(module: str) -> None:
    imported = imports_of((SERVE / "api" / f"{module}.py").read_text())
    assert sorted(m for m in imported if is_under(m, WEB)) == []


def circles(imports: dict[str, set[str]]) -> list[list[str]]:
    """The import circles of a module graph (module -> the modules it imports): each set of two or more
    modules that reach one another, sorted."""
    reach: dict[str, set[str]] = {}
    for start in imports:
        seen: set[str] = set()
        todo = list(imports[start])
        while todo:
            module = todo.pop()
            if module in imports and module not in seen:
                seen.add(module)
                todo += imports[module]
        reach[start] = seen
    found = {tuple(sorted(n for n in reach[m] if m in reach[n])) for m in imports if m in reach[m]}
    return sorted(list(circle) for circle in found)


def test_the_circle_finder_sees_a_circle_through_a_third_module() -> None:
    graph = {"a": {"b"}, "b": {"c", "os"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert circles(graph) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


@pytest.mark.parametrize("room", ["api"])
def test_a_room_has_no_import_circle(room: str) -> None:
    graph = {
        path.removesuffix(".py").removesuffix("/__init__").replace("/", "."): imported
        for path, imported in modules(room).items()
    }
    assert circles(graph) == []


def folder_of(module: str, folders: set[str]) -> str:
    """The folder (a package of serve/api/) a module is in, or the module itself."""
    return next((f for f in folders if module == f or module.startswith(f + ".")), module)


def test_the_api_rooms_folders_have_no_import_circle() -> None:
    """Each folder of serve/api/ as one node: the HTTP APIs (openai/, anthropic/) stand on their shared parts
    (http/) and beside each other, so no folder reaches back to one that imports it."""
    api = SERVE / "api"
    folders = {f"serve.api.{d.name}" for d in api.iterdir() if (d / "__init__.py").is_file()}
    assert {"serve.api.http", "serve.api.openai", "serve.api.anthropic"} <= folders
    graph: dict[str, set[str]] = {}
    for path, imported in modules("api").items():
        node = folder_of(path.removesuffix(".py").removesuffix("/__init__").replace("/", "."), folders)
        graph.setdefault(node, set()).update(folder_of(m, folders) for m in imported)
    assert circles({node: edges - {node} for node, edges in graph.items()}) == []


@pytest.mark.parametrize(
    ("api", "other"), [("openai", "serve.api.anthropic"), ("anthropic", "serve.api.openai")]
)
def test_the_http_apis_import_neither_each_other_nor_their_assembly(api: str, other: str) -> None:
    assert offenders(f"api/{api}", (other, "serve.api.http_app")) == {}
    assert offenders("api/http", (f"serve.api.{api}", "serve.api.http_app")) == {}
