"""``ReferenceModel.from_gguf(..., num_layers=n)``: the embeddings and the first n layers only (how the first layers
of the 744B model fit one GPU), equal bit for bit to the full model's."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from glm5serve.reference import ReferenceModel
from glm5serve.tokenizer import tokenizer_from_gguf

PROMPTS = ["Hello", "The capital of France is", "def add(a, b):\n    return a + b"]  # dense and sparse (> topk 8)


@pytest.fixture(scope="module")
def full(tiny_checkpoint):
    return ReferenceModel.from_gguf(tiny_checkpoint, qa_kv_norm_eps="rms_norm_eps")


@pytest.mark.parametrize("n", [1, 2, 3])
def test_first_layers_equal_the_full_models_bit_for_bit(tiny_checkpoint, full, n):
    part = ReferenceModel.from_gguf(tiny_checkpoint, qa_kv_norm_eps="rms_norm_eps", num_layers=n)
    assert part.n_layers == n and not part.has_head and full.has_head
    kept = {k for k in full.w if k == "model.embed_tokens.weight" or
            (k.startswith("model.layers.") and int(k.split(".")[2]) < n)}
    assert set(part.w) == kept, "dequantized exactly the embeddings and blocks 0..n-1"
    for k in kept:
        assert torch.equal(part.w[k], full.w[k]) and part.w[k].dtype == full.w[k].dtype, k
    tok = tokenizer_from_gguf(tiny_checkpoint)
    for text in PROMPTS:
        ids = tok.encode(text)
        _, want = full.forward(ids, capture=True)
        logits, got = part.forward(ids, capture=True)
        assert logits is None and len(got) == n + 1
        for i, (a, b) in enumerate(zip(got, want[:n + 1])):
            assert torch.equal(a, b), f"{text!r}: hidden state {i} differs"


def test_partial_model_needs_capture_and_a_layer_count_in_range(tiny_checkpoint, full):
    part = ReferenceModel.from_gguf(tiny_checkpoint, num_layers=1)
    with pytest.raises(ValueError, match="capture=True"):
        part.forward([1, 2, 3])
    for n in (0, full.n_layers + 1):
        with pytest.raises(ValueError, match="num_layers must be in"):
            ReferenceModel.from_gguf(tiny_checkpoint, num_layers=n)


def test_num_layers_may_be_any_integer_but_not_a_bool_or_float(tiny_checkpoint):
    """np.int64(1) was refused as 'num_layers must be in 1..3, not 1' (fresh-user finding)."""
    part = ReferenceModel.from_gguf(tiny_checkpoint, num_layers=np.int64(1))
    assert part.n_layers == 1 and type(part.n_layers) is int and not part.has_head
    assert set(part.w) == set(ReferenceModel.from_gguf(tiny_checkpoint, num_layers=1).w)
    for n in (1.0, np.float64(1.0), np.True_, "1"):
        with pytest.raises(ValueError, match="^num_layers must be in 1..3, not "):
            ReferenceModel.from_gguf(tiny_checkpoint, num_layers=n)
