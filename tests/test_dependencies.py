"""Every third-party package gateway/ and trainer/ import is declared in pyproject.toml, where it belongs (issue 37).

A package that is only installed because something else pulls it in (httptools via uvicorn[standard], starlette via
fastapi, safetensors via transformers) works until that other package drops it or a slimmer install leaves it out;
then the import fails on a user's machine and nowhere in CI. So each import is mapped to its distribution and looked
up in what the module's install actually promises:

    the base install (`dependencies`)   every module: `pip install trajgate` is the gateway
    + the extras in EXTRAS below        the modules that only run when the user installed that extra

Imports are read with `ast`, module-level, function-level and `if TYPE_CHECKING:` ones alike (as tests/test_layers.py
does): a lazy import is still a dependency, it just fails later. An import of a package that is not installed here
(unsloth: the `gpu` extra) is looked up under its own name. A module named only in a string is not seen: the
trackers (trainer/worker/trackers.py) import wandb/trackio/mlflow that way, each behind its own extra.
"""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from collections.abc import Iterable, Mapping
from importlib.metadata import packages_distributions
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = ROOT / "pyproject.toml"
PACKAGES = ("gateway", "trainer")
FIRST_PARTY = {"gateway", "trainer", "migrations"}

# Path prefix -> the extras a module there may rely on besides the base install; the longest matching prefix wins.
# Each extra is what the user installs to run that code: the trainer needs `train`, the demo `train,demo`, etc.
EXTRAS: dict[str, set[str]] = {
    "gateway/": set(),
    "gateway/judge/": {"judge"},
    "gateway/store/export_formats.py": {"export"},  # `trajgate export --format parquet`
    "gateway/cli.py": {"train"},  # `trajgate train` pins torch's threads before it imports the trainer
    "trainer/": {"train"},
    "trainer/backends/unsloth.py": {"train", "gpu"},
    "trainer/demo/": {"train", "demo"},
}


def canonical(name: str) -> str:
    """PEP 503 normalisation: `Jinja2`, `pydantic_settings` and `pydantic-settings` compare as pip compares them."""
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(requirement: str) -> str:
    """`uvicorn[standard]>=0.54,<0.55` -> `uvicorn`."""
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    assert match, f"pyproject.toml: cannot read the requirement {requirement!r}"
    return canonical(match[1])


def declared(project: Mapping[str, Any], extras: Iterable[str]) -> set[str]:
    """The distributions the base install plus these extras promise."""
    optional = project.get("optional-dependencies", {})
    names = {requirement_name(req) for req in project.get("dependencies", [])}
    for extra in extras:
        assert extra in optional, f"pyproject.toml has no extra {extra!r} (EXTRAS in {Path(__file__).name})"
        names |= {requirement_name(req) for req in optional[extra]}
    return names


def extras_for(relative: str) -> set[str]:
    prefix = max((p for p in EXTRAS if relative.startswith(p)), key=len)
    return EXTRAS[prefix]


def third_party_imports(path: Path) -> set[str]:
    """The top-level names of every absolute import in the module that is neither stdlib nor the project's own."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return {name for name in names if name not in sys.stdlib_module_names and name not in FIRST_PARTY}


def undeclared(project: Mapping[str, Any], distributions: Mapping[str, list[str]]) -> list[str]:
    """`path: import name (distribution) not in pyproject.toml's <where>` for every import nothing declares."""
    problems: list[str] = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            relative = path.relative_to(ROOT).as_posix()
            extras = extras_for(relative)
            allowed = declared(project, extras)
            for name in sorted(third_party_imports(path)):
                dists = {canonical(dist) for dist in distributions.get(name, [name])}
                if not dists & allowed:
                    where = "dependencies" + "".join(f" or [{extra}]" for extra in sorted(extras))
                    problems.append(f"{relative}: import {name} ({', '.join(sorted(dists))}) is not in {where}")
    return problems


@pytest.fixture(scope="module")
def project() -> dict[str, Any]:
    with PYPROJECT.open("rb") as file:
        document = tomllib.load(file)
    project: dict[str, Any] = document["project"]
    return project


def test_every_import_is_declared(project: dict[str, Any]) -> None:
    problems = undeclared(project, packages_distributions())
    assert not problems, "declare these in pyproject.toml (or import them elsewhere):\n" + "\n".join(problems)


def test_a_package_only_pulled_in_by_another_is_caught(project: dict[str, Any]) -> None:
    """httptools arrives with uvicorn[standard]; without its own line gateway/upstream/client.py's import is flagged."""
    dependencies = [req for req in project["dependencies"] if requirement_name(req) != "httptools"]
    problems = undeclared({**project, "dependencies": dependencies}, packages_distributions())
    assert any(problem.startswith("gateway/upstream/client.py: import httptools") for problem in problems), problems


def test_extras_are_per_module() -> None:
    """A trainer module may lean on `train`, a gateway module not: torch in gateway/store would be flagged."""
    assert extras_for("gateway/store/db.py") == set()
    assert extras_for("gateway/judge/providers.py") == {"judge"}
    assert extras_for("trainer/backends/hf.py") == {"train"}
    assert extras_for("trainer/demo/cpu_demo.py") == {"train", "demo"}
