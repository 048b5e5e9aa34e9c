"""Data shipped with batchspec: samples of public LLM-serving traces.

``TRACES`` is the folder of the samples; ``traces/README.md`` gives each file's
source, license, attribution and how it was cut.  They are package data, so an
installed batchspec has them as well as a clone.
"""
from pathlib import Path

#: The folder of the bundled trace samples (``batchspec/data/traces``).
TRACES = Path(__file__).resolve().parent / "traces"

#: File extensions of the samples (the README and license texts are not traces).
_SAMPLE_SUFFIXES = (".csv", ".jsonl")


def trace_samples() -> list[Path]:
    """Every bundled trace sample, sorted by name."""
    return sorted(p for p in TRACES.iterdir() if p.suffix in _SAMPLE_SUFFIXES)
