"""``glm5serve generate``: text from the GGUF's own tokenizer and the reference engine, through the real CLI."""
from __future__ import annotations

import re

import pytest
import torch

from glm5serve.cli import main
from glm5serve.reference import ReferenceModel
from glm5serve.tokenizer import tokenizer_from_gguf

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def expected(tiny_checkpoint):
    """Greedy ids and their log-softmax rows, computed with a full forward over prompt + generated ids."""
    tok = tokenizer_from_gguf(tiny_checkpoint)
    model = ReferenceModel.from_gguf(tiny_checkpoint)
    ids = tok.encode(PROMPT)
    new = model.generate(ids, 6, stop_ids=[tok.eos_token_id])
    logprobs = torch.log_softmax(model.forward(ids + new)[len(ids) - 1: len(ids) - 1 + len(new)], dim=-1)
    return tok, new, logprobs


def test_generate_prints_prompt_and_greedy_continuation(tiny_checkpoint, expected, capsys):
    tok, new, _ = expected
    assert main(["generate", str(tiny_checkpoint), "--prompt", PROMPT, "--max-tokens", "6"]) == 0
    out = capsys.readouterr().out
    assert out == PROMPT + tok.decode(new, skip_special_tokens=True) + "\n"


def test_logprobs_lines(tiny_checkpoint, expected, capsys):
    tok, new, logprobs = expected
    assert main(["generate", str(tiny_checkpoint), "--prompt", PROMPT, "--max-tokens", "6", "--logprobs", "3"]) == 0
    lines = capsys.readouterr().out.splitlines()[1:]
    assert len(lines) == len(new)
    for n, (line, t, lp) in enumerate(zip(lines, new, logprobs)):
        m = re.fullmatch(rf"\[{n}\] (\d+) '.*' (-?\d+\.\d+) \| top-3: (.*)", line)
        assert m, line
        assert int(m[1]) == t and abs(float(m[2]) - float(lp[t])) < 1e-4
        top = [int(i) for i in re.findall(r"(?:^|, )(\d+) '", m[3])]
        assert top == torch.topk(lp, 3).indices.tolist()
        assert top[0] == t  # greedy picks the most likely token


def test_default_model_is_the_embedded_checkpoint(capsys):
    assert main(["generate", "--prompt", "Hi", "--max-tokens", "2"]) == 0
    assert capsys.readouterr().out.startswith("Hi")


def test_bad_model_is_one_line_exit_2(tmp_path, capsys):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"not a gguf file at all")
    assert main(["generate", str(bad), "--prompt", "Hi"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"glm5serve generate: {bad}") and err.count("\n") == 1
