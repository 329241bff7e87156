"""``benchmarks/structured.py``: its synthetic tokenizer and constraint (cheap), and its ``--tiny`` run (long)."""

import json

import numpy as np
import pytest

from benchmarks import structured
from m3_engine.structured_outputs import StructuredOutputsBackend, StructuredOutputsParams, bitmask_width
from m3_engine.tiny_model import EOS_ID
from m3_engine.tokenizer import Tokenizer

pytest.importorskip("xgrammar")


def test_the_constraint_keeps_random_rows_generating(tmp_path):
    """The synthetic tokenizer has the asked vocabulary with eos at the model's id, and a random walk
    through the benchmark's schema may not stop within 200 tokens (every row stays constrained)."""
    vocab = 700
    structured.write_tokenizer(tmp_path, vocab)
    tokenizer = Tokenizer(tmp_path)
    assert tokenizer.backend.get_vocab_size() == vocab and tokenizer.backend.token_to_id("</s>") == EOS_ID
    grammar = StructuredOutputsBackend(tokenizer, vocab_size=vocab).grammar(
        StructuredOutputsParams(json=structured.SCHEMA), stop_token_ids=[EOS_ID])
    rng, mask = np.random.default_rng(0), np.zeros((1, bitmask_width(vocab)), np.int32)
    for _ in range(200):
        grammar.fill(mask, 0)
        allowed = np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little")[:vocab])
        assert EOS_ID not in allowed and len(allowed) > 0
        grammar.accept(int(rng.choice(allowed)))


@pytest.mark.long   # ~2 min of interpreted model steps: not in `make test`
def test_tiny_run_writes_every_field(tmp_path):
    result = structured.main(["--tiny", "--frameworks", "torch", "--batch", "2", "--new-tokens", "3",
                              "--prompt-len", "4", "--out", str(tmp_path)])
    [json_file] = tmp_path.glob("*-cpu-tiny-structured.json")
    saved = json.loads(json_file.read_text())
    assert saved == json.loads(json.dumps(result)) and saved["copy_bandwidth"] > 0
    rows = saved["results"]["torch"]["rows"]
    assert [row["async_scheduling"] for row in rows] == [False, True]
    assert all(row["fill_ms_per_step"] > 0 and row["finished_early"] == 0 for row in rows)
    profile = saved["results"]["torch"]["profile"]
    assert sorted(profile) == ["masked", "plain"] and all(p["host_us_per_step"] > 0 and p["host_top"]
                                                          for p in profile.values())
    assert "| torch | True |" in json_file.with_suffix(".md").read_text()
