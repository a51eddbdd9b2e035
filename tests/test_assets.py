from __future__ import annotations

from pathlib import Path


def test_vocab_size_of_the_built_in_tokenizer(tmp_path: Path) -> None:
    from orchestrator.assets import tokenizer_dir, vocab_size
    from orchestrator.sim.vocab import SimVocab

    assert vocab_size(tokenizer_dir()) == SimVocab.load().size
    assert vocab_size(tmp_path) is None
