"""llama.cpp as a second, independent oracle for the reference engine (the ``oracle`` extra: llama-cpp-python).

llama.cpp runs in a subprocess (it aborts the whole process on a failed assertion) on the tiny checkpoint with every
tensor F32 and an F32 KV cache, so neither side has quantization error. Its glm-dsa graph (``src/models/
glm-dsa.cpp``) uses ``rms_norm_eps`` (1e-5) for ``q_a_norm``/``kv_a_norm``, so the reference runs with
``qa_kv_norm_eps="rms_norm_eps"``. llama.cpp applies the DSA top-k on CPU too (``build_attn`` with ``top_k``: the
KQ mask is rebuilt from the indexer's ``ggml_top_k``), which ``test_llamacpp_applies_the_dsa_selection`` checks, so
prompts longer than ``index_topk`` are compared as well. Token ids are fed directly: no tokenizer is involved.
"""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from glm5serve.reference import ReferenceModel
from glm5serve.testing.compare import rel_err

pytest.importorskip("llama_cpp", reason="llama_cpp (llama-cpp-python, the oracle extra) is not installed")

N_NEW = 32
#: prompts as token ids: two no longer than index_topk (8), three longer (sparse attention)
PROMPTS = [[476, 296, 64], [46, 77, 363, 220, 84, 79, 274, 261],
           [476, 296, 64, 79, 276, 307, 305, 290, 81, 314, 363, 401]]

# Child process: evaluate each prompt with logits for every position, then decode N_NEW tokens greedily (argmax),
# one llama_decode per token through llama.cpp's own KV cache.
CHILD = r"""
import json, sys
import numpy as np
import llama_cpp

args = json.loads(sys.argv[1])
llm = llama_cpp.Llama(model_path=args["model"], n_ctx=args["n_ctx"], n_batch=args["n_ctx"], n_ubatch=args["n_ctx"],
                      logits_all=True, type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32,
                      flash_attn=False, n_threads=2, n_threads_batch=2, seed=0, verbose=False)
out = {}
for i, ids in enumerate(args["prompts"]):
    llm.reset()
    llm.eval(ids)
    gen = []
    for _ in range(args["n_new"]):
        gen.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
        if len(gen) < args["n_new"]:
            llm.eval([gen[-1]])
    out[f"logits{i}"] = np.array(llm.scores[: llm.n_tokens], dtype=np.float32)  # a copy: scores is a live view
    out[f"tokens{i}"] = np.asarray(gen, dtype=np.int64)
np.savez(args["out"], **out)
"""


def _run_llamacpp(path, prompts, n_new: int, n_ctx: int, workdir) -> list[tuple[torch.Tensor, list[int]]]:
    """llama.cpp (:data:`CHILD`, in a subprocess) on ``path``: per prompt, its logits (n_tokens, vocab) over prompt
    + generated[:-1] and its ``n_new`` greedy tokens."""
    out = workdir / "out.npz"
    args = dict(model=str(path), prompts=prompts, n_new=n_new, n_ctx=n_ctx, out=str(out))
    proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps(args)], capture_output=True, text=True,
                          timeout=600, cwd=workdir)
    assert proc.returncode == 0, f"llama.cpp exited with {proc.returncode}:\n{proc.stderr[-3000:]}"
    data = np.load(out)
    return [(torch.from_numpy(data[f"logits{i}"]), data[f"tokens{i}"].tolist()) for i in range(len(prompts))]


@pytest.fixture(scope="module")
def prompts():
    long = torch.randint(0, 480, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    return PROMPTS + [long]


@pytest.fixture(scope="module")
def llama(tiny_f32_checkpoint, prompts, tmp_path_factory):
    """llama.cpp's logits (n_tokens, vocab) over prompt + generated[:-1], and its N_NEW greedy tokens, per prompt."""
    return _run_llamacpp(tiny_f32_checkpoint, prompts, N_NEW, 256, tmp_path_factory.mktemp("llamacpp"))


@pytest.fixture(scope="module")
def ref(tiny_f32_checkpoint):
    return ReferenceModel.from_gguf(tiny_f32_checkpoint, qa_kv_norm_eps="rms_norm_eps")


def test_prompts_cover_dense_and_sparse(ref, prompts):
    assert [len(p) <= ref.index_topk for p in prompts] == [True, True, False, False]


@pytest.mark.parametrize("i", range(4))
def test_prefill_logits_match_reference(ref, llama, prompts, i):
    ids = prompts[i]
    logits, _ = llama[i]
    assert rel_err(logits[: len(ids)], ref.forward(ids)) <= 1e-4


@pytest.mark.parametrize("i", range(4))
def test_greedy_decoding_matches_reference(ref, llama, prompts, i):
    """Same 32 greedy tokens, and llama.cpp's logits at every decode step (its KV-cache path) match a full
    reference forward over prompt + generated tokens."""
    ids = prompts[i]
    logits, tokens = llama[i]
    assert ref.generate(ids, N_NEW) == tokens
    assert rel_err(logits, ref.forward(ids + tokens[:-1])) <= 1e-4


def test_llamacpp_applies_the_dsa_selection(ref, llama, prompts):
    """On long prompts llama.cpp matches the sparse reference and not the dense one: it applies the top-k on CPU."""
    logits, _ = llama[3]
    ids = prompts[3]
    ref.sparse = False
    try:
        dense = ref.forward(ids)
    finally:
        ref.sparse = True
    assert rel_err(logits[: len(ids)], dense) > 1e-2


def test_qa_kv_norm_eps_is_what_separates_transformers_from_llamacpp(tiny_f32_checkpoint, ref, llama, prompts):
    """With transformers' 1e-6 in q_a/kv_a norms the reference is an order of magnitude farther from llama.cpp."""
    hf_eps = ReferenceModel(ref.cfg, ref.w)  # default qa_kv_norm_eps = 1e-6
    for i in (0, 1):  # dense prompts: the eps cannot flip a top-k choice here
        ids = prompts[i]
        near = rel_err(llama[i][0][: len(ids)], ref.forward(ids))
        far = rel_err(llama[i][0][: len(ids)], hf_eps.forward(ids))
        assert far > 5 * near


def test_shared_indexer_layers_match_llamacpp(tmp_path):
    """GLM-5.2-style ``indexer_types`` (layer 1 reuses layer 0's top-k): llama.cpp reads the same metadata key."""
    from glm5serve.cache import cached_checkpoint

    path = cached_checkpoint("tiny", "f32", indexer_types=["full", "shared", "full"])
    model = ReferenceModel.from_gguf(path, qa_kv_norm_eps="rms_norm_eps")
    assert model.indexer_types == ["full", "shared", "full"]
    ids = torch.randint(0, 480, (30,), generator=torch.Generator().manual_seed(1)).tolist()
    [(logits, tokens)] = _run_llamacpp(path, [ids], 8, 256, tmp_path)
    assert model.generate(ids, 8) == tokens
    assert rel_err(logits, model.forward(ids + tokens[:-1])) <= 1e-4


def test_missing_rope_freq_base_is_read_as_llamacpp_reads_it(tiny_f32_checkpoint, ref, gguf_rewrite, tmp_path):
    """A GGUF without ``glm-dsa.rope.freq_base`` gets llama.cpp's default RoPE base (10000): the reference's logits
    on such a file match llama.cpp's. The checkpoints always write the key (1e6), so a wrong default in the config
    (1e6 for 10000 went through the whole suite) was never read; the RoPE base does change these logits."""
    path = gguf_rewrite(tiny_f32_checkpoint, tmp_path / "no-freq-base.gguf", drop_keys=("glm-dsa.rope.freq_base",))
    model = ReferenceModel.from_gguf(path, qa_kv_norm_eps="rms_norm_eps")
    assert ref.rope_theta == 1e6 and model.rope_theta == 10000.0
    ids = PROMPTS[1]
    [(expected, _)] = _run_llamacpp(path, [ids], 1, 64, tmp_path)
    got = model.forward(ids)
    assert rel_err(expected, got) <= 1e-4
    assert rel_err(expected, ref.forward(ids)) > 1e-3  # the base matters here: the default is what is checked


def test_softmax_gating_is_run_as_llamacpp_runs_it(tiny_f32_checkpoint, ref, prompts, gguf_rewrite, tmp_path):
    """``expert_gating_func`` 1 (softmax over the experts, then the same bias-chosen top-k and weights): the
    reference's greedy tokens and logits match llama.cpp's (``build_moe_ffn``) on a dense and a sparse prompt, and
    differ from sigmoid gating's, so the gating is what is compared. The reference refused such a file before."""
    from gguf import GGUFValueType

    path = gguf_rewrite(tiny_f32_checkpoint, tmp_path / "softmax.gguf",
                        set_keys={"glm-dsa.expert_gating_func": (1, GGUFValueType.UINT32)})
    model = ReferenceModel.from_gguf(path, qa_kv_norm_eps="rms_norm_eps")
    assert (ref.scoring_func, model.scoring_func) == ("sigmoid", "softmax")
    chosen = [prompts[1], prompts[3]]
    for ids, (logits, tokens) in zip(chosen, _run_llamacpp(path, chosen, 8, 128, tmp_path)):
        assert model.generate(ids, 8) == tokens
        full = ids + tokens[:-1]
        assert rel_err(logits, model.forward(full)) <= 1e-4
        assert rel_err(logits, ref.forward(full)) > 1e-2
