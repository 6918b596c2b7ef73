"""The example agents under examples/ are scripts, not a package: tests and benches load them by path."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def load_example(name: str) -> Any:
    """examples/NAME.py as a module (it finds harness.py beside itself)."""
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module
