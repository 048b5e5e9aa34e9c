"""gpu_engine is an independent implementation (DESIGN.md §1): it imports the spec's
data formats, protocol and knobs only, and runs with torch and numpy alone."""
from __future__ import annotations

import ast
import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
ALLOWED_SPEC = {"spec.formats", "spec.protocol", "spec.config"}
FORBIDDEN = ("spec.scheduler", "spec.kv", "spec.queues", "spec.invariants", "spec.rules", "spec.io",
             "reference", "invariants", "fuzz", "jsonschema", "z3", "hypothesis")


def _imports(path: pathlib.Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.add(node.module)
    return names


def test_gpu_engine_source_imports_only_allowed_modules():
    stdlib = sys.stdlib_module_names
    for path in sorted((ROOT / "gpu_engine").glob("*.py")):
        for name in _imports(path):
            top = name.split(".")[0]
            ok = (top in stdlib or top in ("torch", "numpy", "triton", "gpu_engine", "__future__")
                  or name in ALLOWED_SPEC)
            assert ok, f"{path.name} imports {name}"


def test_importing_gpu_engine_loads_no_spec_logic_and_no_optional_packages():
    code = ("import sys, json, gpu_engine, gpu_engine.engine, gpu_engine.model, gpu_engine.attention; "
            "print(json.dumps(sorted(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    loaded = json.loads(out.stdout)
    bad = [m for m in loaded if any(m == f or m.startswith(f + ".") for f in FORBIDDEN)]
    assert not bad, bad
