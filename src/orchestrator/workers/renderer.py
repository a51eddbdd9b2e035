"""The renderer verifiers' train client renders prompts with, built once per env worker before ``ready``, without
importing torch where that changes nothing.

verifiers 0.4.0's ``TrainClient`` takes its renderer from ``ElasticRendererPool`` (verifiers/v1/clients/train.py):
renderers shared by the whole process in a list per build inputs (tokenizer, renderer config, chat-template
kwargs), one renderer per ``multiplex`` (256) rollouts in flight, each made over a tokenizer from
``renderers.base.load_tokenizer`` (renderers 0.1.12), which is transformers' ``AutoTokenizer``. AutoTokenizer reads
the model's configuration to pick the tokenizer class, and transformers' configuration code imports torch whenever
torch is installed (``configuration_utils.py`` imports ``modeling_rope_utils.py``, which imports torch;
transformers 5.24): ~200 MB of RSS and ~1.6 s of imports in a process that only tokenizes. That was most of an env
worker's 480 MB at ready (scripts/perf/soak_workers.py).

For a tokenizer directory whose ``tokenizer_config.json`` names the generic fast tokenizer (``GENERIC_CLASSES``) and
no custom code, AutoTokenizer ends at transformers' ``TokenizersBackend`` over the directory's ``tokenizer.json``
(models/auto/tokenization_auto.py, 5.24: the branches for such a class), unless a ``config.json`` names a model
type whose hub class it overrides. There ``warm_renderer`` builds that same class itself, without AutoTokenizer
and so without torch, and adds the renderer to the pool's shared list, where verifiers' client finds it: the same
tokenizer and renderer for ~20 MB of transformers' tokenizer modules. A ``config.json`` of a model type not in
``CHECKED_MODEL_TYPES`` (each checked against AutoTokenizer by tests/test_worker_renderer.py), a model-specific class
(Qwen2Tokenizer...), custom code (``auto_map``) or a name that is not a local directory: verifiers' own build.
"""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

GENERIC_CLASSES = frozenset({"PreTrainedTokenizerFast", "TokenizersBackend"})  # the same class in transformers 5
# model types for which AutoTokenizer loads a generic class as TokenizersBackend (5.24; tests check each one)
CHECKED_MODEL_TYPES = frozenset({"llama", "qwen3", "qwen3_moe"})


def why_not_lean(tokenizer: str) -> str | None:
    """None when ``tokenizer`` (a path) can be loaded as ``TokenizersBackend`` without AutoTokenizer and get the
    class AutoTokenizer would pick; otherwise why not, in a few words."""
    directory = Path(tokenizer)
    if not (directory / "tokenizer.json").is_file():
        return "not a local directory with a tokenizer.json"
    try:
        config = json.loads((directory / "tokenizer_config.json").read_text())
    except (OSError, ValueError) as e:
        return f"tokenizer_config.json unreadable ({type(e).__name__})"
    if not isinstance(config, dict) or config.get("tokenizer_class") not in GENERIC_CLASSES:
        found = config.get("tokenizer_class") if isinstance(config, dict) else None
        return f"tokenizer_class {found!r} is model-specific"
    if "auto_map" in config:
        return "tokenizer_config.json names custom code (auto_map)"
    if (directory / "config.json").exists():
        try:
            model_type = json.loads((directory / "config.json").read_text()).get("model_type")
        except (OSError, ValueError, AttributeError) as e:
            return f"config.json unreadable ({type(e).__name__})"
        if model_type not in CHECKED_MODEL_TYPES:
            return f"config.json's model_type {model_type!r} is not one checked to load the generic class"
    return None


def load_lean_tokenizer(tokenizer: str) -> Any:
    """transformers' ``TokenizersBackend`` for the directory ``tokenizer`` (see ``why_not_lean``), as AutoTokenizer
    would make it, without importing transformers' model configuration code (nor torch). Blocking: seconds."""
    from transformers import TokenizersBackend

    return TokenizersBackend.from_pretrained(tokenizer)


async def warm_renderer(tokenizer: str, renderer: Any, multiplex: int) -> str:
    """Make sure verifiers' renderer pool for (``tokenizer``, ``renderer``, no chat-template kwargs) holds a renderer,
    built off the loop; returns how its tokenizer was loaded. Run before any rollout: the pool's single-flight lock
    is not taken here, so nothing else may be growing the same pool."""
    from verifiers.v1.clients.train import ElasticRendererPool, RendererSlot

    pool = ElasticRendererPool(tokenizer, renderer, multiplex=multiplex)
    if pool.renderers:
        return "already built"
    reason = why_not_lean(tokenizer)
    if reason is not None:
        await pool.grow()  # verifiers' own build: AutoTokenizer
        return f"AutoTokenizer ({reason})"

    def build() -> Any:
        from renderers import create_renderer

        return create_renderer(load_lean_tokenizer(tokenizer), renderer)

    built = await asyncio.to_thread(build)
    if not pool.renderers:  # still empty: nothing else grew it meanwhile
        pool.renderers.append(RendererSlot(built))
    return "TokenizersBackend (tokenizer.json, no AutoTokenizer)"
