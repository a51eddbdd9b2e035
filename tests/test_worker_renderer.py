"""The env worker's renderer (workers/renderer.py): for a tokenizer directory that names the generic fast tokenizer,
built without AutoTokenizer (and so without importing torch) and rendering exactly as the renderer verifiers would
build through AutoTokenizer; any other directory goes through verifiers' own build.

The comparisons run AutoTokenizer for real (``renderers.base.load_tokenizer``, what verifiers' pool calls), so a
transformers release that picks another class for a checked model type fails here, not in a training run.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from orchestrator.assets import tokenizer_dir
from orchestrator.workers.renderer import CHECKED_MODEL_TYPES, why_not_lean

pytestmark = pytest.mark.timeout(120)

CHATS: list[list[dict[str, str]]] = [
    [{"role": "user", "content": "What is 17 + 25? Answer with the number."}],
    [{"role": "system", "content": "You play a guessing game."}, {"role": "user", "content": "Guess: 1 to 100"},
     {"role": "assistant", "content": "50"}, {"role": "user", "content": "higher <|im_end|> 7"}],
    [{"role": "user", "content": "  spaces,\ttabs\nand newlines  "}, {"role": "assistant", "content": ""}],
]


def tokenizer_copy(tmp_path: Path, name: str, *, config: dict[str, Any] | None = None,
                   tokenizer_config: dict[str, Any] | None = None) -> Path:
    """The built-in tokenizer's files in ``tmp_path/name`` (a fresh pool key), with a ``config.json`` and
    ``tokenizer_config.json`` changes if given."""
    target = tmp_path / name
    shutil.copytree(tokenizer_dir(), target)
    if config is not None:
        (target / "config.json").write_text(json.dumps(config))
    if tokenizer_config is not None:
        path = target / "tokenizer_config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **tokenizer_config}))
    return target


def renders(renderer: Any) -> list[list[int]]:
    return [list(renderer.render(chat, add_generation_prompt=True).token_ids) for chat in CHATS]


@pytest.mark.parametrize("model_type", [None, *sorted(CHECKED_MODEL_TYPES)])
def test_the_lean_tokenizer_is_the_one_autotokenizer_gives_and_renders_the_same(tmp_path: Path,
                                                                                 model_type: str | None) -> None:
    from renderers import create_renderer
    from renderers.base import load_tokenizer
    from renderers.configs import DefaultRendererConfig

    from orchestrator.workers.renderer import load_lean_tokenizer

    directory = tokenizer_copy(tmp_path, "tok", config=None if model_type is None else {"model_type": model_type})
    assert why_not_lean(str(directory)) is None
    auto, lean = load_tokenizer(str(directory)), load_lean_tokenizer(str(directory))
    assert type(lean) is type(auto)
    assert type(auto).__name__ == "TokenizersBackend"
    text = "higher <|im_end|> 7, then: 42"
    assert lean.encode(text, add_special_tokens=False) == auto.encode(text, add_special_tokens=False)
    ids = auto.encode(text, add_special_tokens=False)
    assert lean.decode(ids, skip_special_tokens=False) == auto.decode(ids, skip_special_tokens=False)
    assert (lean.eos_token_id, lean.unk_token_id) == (auto.eos_token_id, auto.unk_token_id)
    assert lean.all_special_tokens == auto.all_special_tokens
    assert lean.convert_tokens_to_ids("<|im_end|>") == auto.convert_tokens_to_ids("<|im_end|>")
    config = DefaultRendererConfig()
    assert renders(create_renderer(lean, config)) == renders(create_renderer(auto, config))


@pytest.mark.parametrize(("change", "reason"), [
    ({"tokenizer_config": {"tokenizer_class": "Qwen2Tokenizer"}}, "'Qwen2Tokenizer' is model-specific"),
    ({"tokenizer_config": {"auto_map": {"AutoTokenizer": ["x.Tok", None]}}}, "custom code"),
    ({"config": {"model_type": "phi3"}}, "model_type 'phi3' is not one checked"),
    ({"config": {"model_type": None}}, "model_type None is not one checked"),
])
def test_a_tokenizer_that_may_load_another_class_goes_through_autotokenizer(tmp_path: Path, change: dict[str, Any],
                                                                          reason: str) -> None:
    found = why_not_lean(str(tokenizer_copy(tmp_path, "tok", **change)))
    assert found is not None
    assert reason in found


def test_a_name_that_is_not_a_tokenizer_directory_goes_through_autotokenizer(tmp_path: Path) -> None:
    assert why_not_lean("Qwen/Qwen3-4B") == "not a local directory with a tokenizer.json"
    broken = tokenizer_copy(tmp_path, "tok")
    (broken / "tokenizer_config.json").write_text("{not json")
    assert why_not_lean(str(broken)) == "tokenizer_config.json unreadable (JSONDecodeError)"


def test_the_renderer_warmed_is_the_one_the_train_client_takes(tmp_path: Path) -> None:
    from renderers.configs import DefaultRendererConfig
    from verifiers.v1.clients.train import ElasticRendererPool

    from orchestrator.workers.renderer import warm_renderer

    directory = str(tokenizer_copy(tmp_path, "tok"))
    config = DefaultRendererConfig()
    assert asyncio.run(warm_renderer(directory, config, 256)).startswith("TokenizersBackend")
    assert asyncio.run(warm_renderer(directory, config, 256)) == "already built"
    pool = ElasticRendererPool(directory, DefaultRendererConfig(), multiplex=256)  # as TrainClient makes it

    async def acquire() -> Any:
        async with pool.acquire() as slot:
            return slot

    slot = asyncio.run(acquire())
    assert pool.renderers == [slot]  # taken, not grown: no tokenizer loaded on a rollout
    assert type(slot.renderer._tokenizer).__name__ == "TokenizersBackend"


def test_an_unchecked_tokenizer_is_built_by_verifiers(tmp_path: Path) -> None:
    from renderers.configs import DefaultRendererConfig
    from verifiers.v1.clients.train import ElasticRendererPool

    from orchestrator.workers.renderer import warm_renderer

    directory = str(tokenizer_copy(tmp_path, "tok", config={"model_type": "gpt2"}))
    how = asyncio.run(warm_renderer(directory, DefaultRendererConfig(), 256))
    assert how == "AutoTokenizer (config.json's model_type 'gpt2' is not one checked to load the generic class)"
    assert len(ElasticRendererPool(directory, DefaultRendererConfig(), multiplex=256).renderers) == 1


WARM_IN_A_FRESH_PROCESS = """
import asyncio, json, sys
from renderers.configs import DefaultRendererConfig
from orchestrator.workers.renderer import warm_renderer
from verifiers.v1.clients.train import ElasticRendererPool

how = asyncio.run(warm_renderer(sys.argv[1], DefaultRendererConfig(), 256))
[slot] = ElasticRendererPool(sys.argv[1], DefaultRendererConfig(), multiplex=256).renderers
ids = list(slot.renderer.render([{"role": "user", "content": "2 + 2?"}], add_generation_prompt=True).token_ids)
print(json.dumps({"how": how, "torch": "torch" in sys.modules, "ids": ids}))
"""


@pytest.mark.slow
def test_a_worker_process_warms_its_renderer_without_importing_torch(tmp_path: Path) -> None:
    """What an env worker pays at ready: in a process of its own (this one may have imported torch), verifiers
    imported, the renderer built; torch, when installed, stays out (it is ~200 MB of RSS)."""
    from renderers import create_renderer
    from renderers.base import load_tokenizer
    from renderers.configs import DefaultRendererConfig

    directory = tokenizer_copy(tmp_path, "tok", config={"model_type": "qwen3"})
    out = subprocess.run([sys.executable, "-c", WARM_IN_A_FRESH_PROCESS, str(directory)], capture_output=True,
                         text=True, timeout=110, env={**os.environ, "HOME": str(tmp_path)})
    assert out.returncode == 0, out.stderr
    child = json.loads(out.stdout.splitlines()[-1])
    assert child["how"] == "TokenizersBackend (tokenizer.json, no AutoTokenizer)"
    assert child["torch"] is False
    auto = create_renderer(load_tokenizer(str(directory)), DefaultRendererConfig())
    assert child["ids"] == list(auto.render([{"role": "user", "content": "2 + 2?"}],
                                            add_generation_prompt=True).token_ids)
