"""A model folder that a real serving engine and the reference engine both load.

``batchspec make-model DIR --seed S`` writes, with nothing downloaded:

* ``config.json`` and ``model.safetensors`` — a small Llama (:data:`SERVING_CONFIG`)
  with the seeded weights of :func:`reference.model.init_weights`, in Hugging
  Face's ``LlamaForCausalLM`` layout (what vLLM's ``LlamaForCausalLM`` reads);
* ``tokenizer.json`` + ``tokenizer_config.json`` — a word-level tokenizer
  (:func:`tokenizer_json`) whose token ``i`` is the word ``w<i>`` (ids 0-2 are
  ``<unk>``, ``<s>``, ``</s>``, the trace format's reserved ids), so that any
  list of token ids is a text that tokenizes back to exactly those ids;
* ``generation_config.json`` — EOS and BOS ids, and nothing that changes sampling.

Why these sizes: vLLM's CPU attention supports head sizes from 32 up
(``CPUAttentionBackend.get_supported_head_sizes``), so the heads are 32 wide; two
layers of hidden size 128 keep a CPU forward pass at a few milliseconds, so a
server run of a few hundred requests takes a minute on two cores.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from reference.model import TinyLlama, TinyLlamaConfig
from spec.io import atomic_write_text

#: The served model: Llama architecture, grouped-query attention, head size 32 (vLLM's CPU minimum).
SERVING_CONFIG = TinyLlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                 max_position_embeddings=2048)
#: Reserved ids, the trace format's (spec.formats: EOS 2, synthetic tokens from 3).
UNK, BOS, EOS = 0, 1, 2
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")


def word(token_id: int) -> str:
    """The text of token ``token_id``: a special token, or ``w<id>``."""
    return SPECIAL_TOKENS[token_id] if token_id < len(SPECIAL_TOKENS) else f"w{token_id}"


def ids_to_text(token_ids: list[int]) -> str:
    """A text that :func:`tokenizer_json`'s tokenizer turns back into exactly ``token_ids``."""
    return " ".join(word(t) for t in token_ids)


def tokenizer_json(vocab_size: int) -> dict:
    """A Hugging Face ``tokenizers`` word-level tokenizer: whitespace split, one id per word.

    No normalizer and no post-processor (no BOS is added), so encoding is the
    inverse of :func:`ids_to_text` and a prompt's token ids are the ones sent.
    """
    added = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": True} for i, t in enumerate(SPECIAL_TOKENS)]
    return {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
        "normalizer": None, "pre_tokenizer": {"type": "WhitespaceSplit"}, "post_processor": None,
        "decoder": None,
        "model": {"type": "WordLevel", "vocab": {word(i): i for i in range(vocab_size)}, "unk_token": "<unk>"},
    }


def tokenizer_config_json(max_len: int) -> dict:
    """``tokenizer_config.json``: the fast tokenizer class and its special tokens."""
    return {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
            "unk_token": "<unk>", "model_max_length": max_len, "add_bos_token": False, "add_eos_token": False,
            "clean_up_tokenization_spaces": False}


def _write_json(path: Path, obj) -> None:
    """Through a temporary file and a rename: never a half-written file."""
    atomic_write_text(path, json.dumps(obj, indent=1) + "\n")


def make_model_folder(folder: str | Path, seed: int = 0, config: TinyLlamaConfig = SERVING_CONFIG) -> Path:
    """Write the seeded model, its tokenizer and configs into ``folder`` (created if needed).

    The same ``seed`` gives the same bytes (weights from :func:`reference.model.init_weights`).
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    TinyLlama.from_seed(config, seed, dtype=torch.float32).save_pretrained(folder)
    hf = json.loads((folder / "config.json").read_text())
    hf.update(bos_token_id=BOS, eos_token_id=EOS, pad_token_id=None)
    _write_json(folder / "config.json", hf)
    _write_json(folder / "generation_config.json", {"bos_token_id": BOS, "eos_token_id": EOS})
    _write_json(folder / "tokenizer.json", tokenizer_json(config.vocab_size))
    _write_json(folder / "tokenizer_config.json", tokenizer_config_json(config.max_position_embeddings))
    _write_json(folder / "batchspec-model.json", {"seed": seed, "made_by": "batchspec make-model"})
    return folder
