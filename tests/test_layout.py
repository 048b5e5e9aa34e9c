"""The import direction of DESIGN.md §1, enforced on the source itself."""
import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STDLIB = set(sys.stdlib_module_names)
PACKAGES = ("spec", "reference", "gpu_engine", "invariants", "fuzz", "batchspec")

#: What each package may import, beyond the standard library and itself.
ALLOWED = {
    "spec": {"jsonschema"},  # only spec.io, lazily, for file validation
    "reference": {"spec", "torch", "numpy", "safetensors"},
    "gpu_engine": {"spec.formats", "spec.protocol", "spec.config", "torch", "numpy", "triton", "safetensors"},
    "invariants": {"spec", "z3", "hypothesis", "gpu_engine", "torch", "numpy"},
    "fuzz": {"spec", "reference", "gpu_engine", "invariants", "hypothesis", "rich", "torch", "numpy", "vllm", "ray",
             "sglang", "aiohttp"},  # aiohttp: the live-server client (fuzz/server.py), installed with vLLM
    "batchspec": set(PACKAGES) | {"rich", "matplotlib", "numpy", "torch"},
}


def imports_of(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out += [(node.lineno, node.module)]
    return out


def allowed(package: str, module: str) -> bool:
    top = module.split(".")[0]
    if top in STDLIB or top == package or top == "__future__":
        return True
    return any(module == a or module.startswith(a + ".") or top == a for a in ALLOWED[package])


@pytest.mark.parametrize("package", PACKAGES)
def test_import_direction(package):
    bad = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for line, module in imports_of(path):
            if not allowed(package, module):
                bad.append(f"{path.relative_to(ROOT)}:{line}: imports {module}")
    assert not bad, "\n".join(bad)


def test_gpu_engine_never_imports_the_spec_logic():
    # spec.formats / spec.protocol / spec.config are data and contracts; anything else in spec is logic.
    for path in sorted((ROOT / "gpu_engine").rglob("*.py")):
        for line, module in imports_of(path):
            if module.startswith("spec"):
                assert module in ("spec.formats", "spec.protocol", "spec.config"), f"{path}:{line}: {module}"


def test_spec_semantics_import_without_third_party_packages():
    """The spec runs a trace with no third-party package importable (validation aside)."""
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('jsonschema','torch','numpy','z3','hypothesis','rich'):\n"
        "            raise ImportError('blocked ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "from spec.formats import Trace, TraceRequest\n"
        "from spec.scheduler import run\n"
        "t = Trace(config={'profile':'vllm-v1','num_blocks':8,'block_size':4}, "
        "requests=[TraceRequest(id='a', prompt_len=9, max_tokens=3, arrival_step=0)])\n"
        "print(len(run(t, check_invariants=True)))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "3"
