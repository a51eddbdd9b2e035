"""Tiny real transformers, built here from a config (no hub): what the real server serves and the trainer trains.

Both are Qwen3 models with the built-in tokenizer (its 1,102 ids; end of turn ``<|im_end|>`` = 3) copied into the
model directory, so the server's ``/tokenize`` agrees with ``model.tokenizer``, saved in float32 as safetensors:

- ``dense`` (``Qwen3ForCausalLM``, 0.9 M parameters): served in float32 its logprobs match a float32 recomputation
  to < 1e-6 before and after any number of reloads, so it is the model for parity and learning.
- ``moe`` (``Qwen3MoeForCausalLM``, 8 experts, top 2, 1.3 M parameters): vLLM's CPU backend does not reload its
  expert weights (REAL-VLLM.md), so after a reload it serves a policy that is not the checkpoint. It is the model
  that shows what the trainer's mismatch report must catch.
- ``teacher``: the dense model at another seed (1) with a ten times larger initial scale (``initializer_range``
  0.2): a teacher to distil into the dense model (on-policy distillation). Its shapes are the dense model's, so a
  dense server can load it (``reload_weights``). At the dense model's own scale two seeds are both nearly uniform
  (entropy 6.98 of 7.0 nats, KL 0.05 between them) and a student gets closer to the other just by spreading out
  (KL 0.025 from uniform); at 0.2 the teacher's entropy is 4.65 and the KL 2.5, which only imitation lowers.

Built deterministically (seeded); a directory is rebuilt only when its recorded spec differs.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from orchestrator.assets import tokenizer_dir, vocab_size

SPEC_FILE = "orchestrator-model.json"
SEED = 0

COMMON: dict[str, Any] = {
    "hidden_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
    "max_position_embeddings": 2048, "eos_token_id": 3, "pad_token_id": 0, "bos_token_id": None,
    "tie_word_embeddings": False,
}
SPECS: dict[str, dict[str, Any]] = {
    "dense": {"class": "Qwen3ForCausalLM", "config": "Qwen3Config", **COMMON, "intermediate_size": 256},
    "moe": {"class": "Qwen3MoeForCausalLM", "config": "Qwen3MoeConfig", **COMMON, "intermediate_size": 256,
            "moe_intermediate_size": 64, "num_experts": 8, "num_experts_per_tok": 2, "decoder_sparse_step": 1,
            "norm_topk_prob": True},
    "teacher": {"class": "Qwen3ForCausalLM", "config": "Qwen3Config", **COMMON, "intermediate_size": 256,
                "initializer_range": 0.2, "seed": 1},
}
KINDS = tuple(SPECS)


def spec(kind: str) -> dict[str, Any]:
    """The recorded spec of model ``kind`` (``dense`` or ``moe``): its config and the seed it was built with."""
    tokenizer = tokenizer_dir()
    return {"seed": SEED, **SPECS[kind], "vocab_size": vocab_size(tokenizer)}


def built(directory: Path, kind: str) -> bool:
    try:
        return bool(json.loads((directory / SPEC_FILE).read_text()) == spec(kind))
    except (OSError, ValueError):
        return False


def build_model(directory: Path, kind: str) -> int:
    """Build model ``kind`` into ``directory`` (replaced; skipped when already built); its parameter count.
    Needs torch and transformers (the project's ``[torch]`` extra)."""
    import torch
    import transformers

    want = spec(kind)
    fields = {k: v for k, v in want.items() if k not in ("class", "config", "seed")}
    config = getattr(transformers, want["config"])(**fields)
    torch.manual_seed(want["seed"])
    model = getattr(transformers, want["class"])(config).to(torch.float32)
    tmp = directory.with_name(directory.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    (tmp / "generation_config.json").unlink(missing_ok=True)  # no sampling defaults of the model's: requests say
    for f in tokenizer_dir().iterdir():
        if f.is_file():
            shutil.copy(f, tmp / f.name)
    (tmp / SPEC_FILE).write_text(json.dumps(want))
    shutil.rmtree(directory, ignore_errors=True)
    tmp.rename(directory)
    return sum(p.numel() for p in model.parameters())
