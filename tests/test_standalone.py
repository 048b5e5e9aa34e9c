"""The repository stands alone: nothing refers to files outside it, and the bundled data is intact.

A user who clones the repository has only the repository, so no source, doc, test,
benchmark or script may point at a folder beside it (the ``shared`` folder the
project was first developed next to) or at the development machine's own paths.  The trace samples the tests and the README
use are bundled, byte for byte as their README's sha256 list says.
"""
import fnmatch
import hashlib
import re
from pathlib import Path

from batchspec.data import TRACES, trace_samples

ROOT = Path(__file__).resolve().parents[1]
#: Built from parts so that this file does not match itself.
OUTSIDE = re.compile(r"\.\./" + "shared" + r"|\b" + "shared" + r"/(reference|traces)\b|\b" + "shared" + r" folder\b"
                     + r"|/" + "work" + r"/(main|shared|venv)\b")
TEXT_SUFFIXES = {".py", ".md", ".sh", ".toml", ".json", ".jsonl", ".txt", ".yaml", ".yml", ".cfg", ".ini"}
SKIP_DIRS = {".git", "__pycache__", ".pytest_cache", ".hypothesis", "build", "dist", "findings", "out"}


def project_files():
    for path in ROOT.rglob("*"):
        rel = path.relative_to(ROOT)
        if any(part in SKIP_DIRS or part.startswith(".venv") or part.endswith(".egg-info") for part in rel.parts):
            continue
        if path.is_file() and (path.suffix in TEXT_SUFFIXES or rel.as_posix() == ".ci/run"):
            if path.parent == TRACES and path.suffix in (".csv", ".jsonl"):
                continue  # trace data, not text that could cite a path
            yield path, rel


def test_no_file_refers_outside_the_repository():
    bad = []
    for path, rel in project_files():
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if OUTSIDE.search(line):
                bad.append(f"{rel}:{number}: {line.strip()[:120]}")
    assert not bad, "files citing a folder outside the repository:\n" + "\n".join(bad)


def test_bundled_samples_match_their_readme_checksums():
    readme = (TRACES / "README.md").read_text()
    listed = dict((name, digest) for digest, name in re.findall(r"^([0-9a-f]{64})  (\S+)$", readme, re.M))
    assert set(listed) == {p.name for p in trace_samples()}, "every sample has a checksum line, and vice versa"
    for sample in trace_samples():
        assert hashlib.sha256(sample.read_bytes()).hexdigest() == listed[sample.name], sample.name
        assert f"`{sample.name}`" in readme  # and a section saying where it came from


def test_license_texts_travel_with_the_samples():
    readme = (TRACES / "README.md").read_text()
    for name in ("LICENSE-Apache-2.0.txt", "LICENSE-MIT-vidur.txt"):
        assert (TRACES / name).is_file() and name in readme
    assert "creativecommons.org/licenses/by/4.0" in readme


def test_every_bundled_file_is_package_data():
    """``pip install .`` (not only a clone) must carry every sample and its license texts."""
    pyproject = (ROOT / "pyproject.toml").read_text()
    line = re.search(r'^"batchspec\.data"\s*=\s*\[(.*)\]\s*$', pyproject, re.M)
    assert line, "pyproject.toml declares no package data for batchspec.data"
    patterns = re.findall(r'"([^"]+)"', line.group(1))
    for path in TRACES.iterdir():
        if path.name.startswith("."):
            continue  # .gitattributes: for git, not for users
        assert any(fnmatch.fnmatch(f"traces/{path.name}", p) for p in patterns), f"{path.name} is not package data"
