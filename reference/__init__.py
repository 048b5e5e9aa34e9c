"""The reference engine: the spec's decisions executed by a tiny Llama computed naively.

* :mod:`reference.model`    — the decoder (HF Llama conventions), seeded weights, safetensors I/O;
* :mod:`reference.sampling` — greedy and seeded sampling that no batch can influence;
* :mod:`reference.engine`   — :class:`ReferenceEngine`, the engine protocol over the spec;
* :mod:`reference.cli`      — ``batchspec generate`` (:func:`cli_generate`).
"""
from reference.cli import GenerateResult, cli_generate
from reference.engine import ReferenceEngine, generate_alone, make_model
from reference.model import (
    KVCache,
    TinyLlama,
    TinyLlamaConfig,
    init_weights,
    load_pretrained,
    save_pretrained,
)
from reference.sampling import GREEDY, SamplingParams, sample

__all__ = [
    "GREEDY",
    "GenerateResult",
    "KVCache",
    "ReferenceEngine",
    "SamplingParams",
    "TinyLlama",
    "TinyLlamaConfig",
    "cli_generate",
    "generate_alone",
    "init_weights",
    "load_pretrained",
    "make_model",
    "sample",
    "save_pretrained",
]
