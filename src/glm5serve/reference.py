"""GLM-5 (``glm-dsa``) reference engine: the whole forward pass in plain PyTorch, from a GGUF file.

An oracle that shares no code with vLLM or its GGUF plugin: weights are dequantized with glm5serve's own
dequantizers and the model is written out op by op after transformers'
``models/glm_moe_dsa/modeling_glm_moe_dsa.py``, with the papers' notation in comments (DeepSeek-V2 for MLA,
DeepSeek-V3 for the router, DeepSeek-V3.2 for the DSA indexer). One sequence at a time, no batching, CPU or GPU.

Per layer (pre-norm residual blocks)::

    h = h + MLA_DSA(RMSNorm(h))          # MLA attention over the keys the DSA indexer selects
    h = h + FFN(RMSNorm(h))              # dense SwiGLU (first layers) or MoE (sigmoid router + shared expert)
    logits = lm_head(RMSNorm(h))

Deliberate choices, all selectable:

* ``qa_kv_norm_eps`` (default ``1e-6``): epsilon of ``q_a_layernorm`` and ``kv_a_layernorm``. transformers hard-codes
  1e-6 for these two norms (as does DeepSeek's own ``inference/model.py``); llama.cpp (``glm-dsa.cpp``,
  ``build_norm(..., LLM_NORM_RMS)``) and vLLM (``deepseek_v2.py``) use ``rms_norm_eps`` (1e-5 for GLM-5). The default
  follows transformers, the model authors' reference; pass ``qa_kv_norm_eps=cfg.rms_norm_eps`` (or ``"rms_norm_eps"``)
  to reproduce llama.cpp and vLLM.
* ``mla`` (default ``"expanded"``): ``"expanded"`` decompresses the cached latent into per-head keys and values with
  ``kv_b_proj`` (transformers' form); ``"absorbed"`` folds ``W_UK`` into the query and ``W_UV`` into the output and
  attends over the latent directly (llama.cpp's and vLLM's decode form). Equal up to float rounding.
* ``sparse`` (default True): DSA top-k selection on; ``False`` gives plain causal attention (the indexer is skipped).
* DSA on CPU in llama.cpp: its glm-dsa graph applies the indexer's top-k on every backend (``build_attn`` with
  ``top_k`` rebuilds the KQ mask from ``ggml_top_k``), so llama.cpp is compared on sparse prompts too
  (``tests/unit/test_llamacpp_oracle.py``). ``indexer_types`` ``"shared"`` layers reuse the previous layer's
  selection (GLM-5.2), as in transformers and llama.cpp.
* DSA ties: the indexer keeps the ``min(index_topk, t+1)`` best causal keys of query ``t``; equal scores are broken
  towards the lower position (a stable sort). transformers (``torch.topk``) and llama.cpp (``std::partial_sort``)
  leave tie order unspecified, so only inputs without a tie at the selection boundary are comparable.
* Numerics otherwise as transformers in fp32. In bf16 the indexer's ``k_norm`` LayerNorm runs in fp32 (transformers
  runs ``nn.LayerNorm`` in the model dtype); routed-expert outputs are summed in a different order.
"""
from __future__ import annotations

import math
import operator
import os
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import torch
import torch.nn.functional as F

from glm5serve.errors import GGUFModelError

MLA_MODES = ("expanded", "absorbed")
#: transformers ``GlmMoeDsaAttention``: ``GlmMoeDsaRMSNorm(q_lora_rank)`` / ``(kv_lora_rank)`` with the default eps
HF_QA_KV_NORM_EPS = 1e-6
#: transformers ``GlmMoeDsaIndexer.k_norm = nn.LayerNorm(index_head_dim, eps=1e-6)`` (with bias)
INDEXER_K_NORM_EPS = 1e-6
#: weights kept in fp32 whatever the compute dtype, as transformers does (``_keep_in_fp32_modules``) and the GGUF
#: stores them (router, its bias and the indexer head weights feed top-k choices)
FP32_SUFFIXES = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias", "indexer.weights_proj.weight")
#: dtypes :meth:`ReferenceModel.from_gguf` loads weights in (float8 types load, then torch cannot promote them)
COMPUTE_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def upcast(x: torch.Tensor) -> torch.Tensor:
    """``x`` in fp32, or in its own dtype if wider (fp64 runs stay fp64 throughout)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, computed in fp32 and cast back (transformers ``GlmMoeDsaRMSNorm``)."""
    xf = upcast(x)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """LayerNorm (with bias) over the last dim in fp32, cast back to ``x.dtype`` (the indexer's ``k_norm``)."""
    return F.layer_norm(upcast(x), x.shape[-1:], upcast(weight), upcast(bias), eps).to(x.dtype)


def rope_cos_sin(positions: torch.Tensor, dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, each (T, dim/2) fp32, of the angles ``position * theta^(-2i/dim)`` (RoFormer; transformers
    ``compute_default_rope_parameters`` with ``head_dim = qk_rope_head_dim``)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=positions.device) / dim))
    angles = positions.float()[:, None] * inv_freq[None, :]
    return angles.cos(), angles.sin()


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent pairs ``(x[2i], x[2i+1])`` of ``x`` (T, ..., dim) by angle i (ggml ``ROPE_TYPE_NORM``,
    DeepSeek's interleaved layout); ``cos``/``sin`` are (T, dim/2). The output keeps the interleaved layout.

    transformers' ``apply_rotary_pos_emb_interleave`` returns the same numbers de-interleaved (evens then odds);
    it applies that permutation to both q and k, so dot products agree.
    """
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[1],)
    cos, sin = cos.view(shape).to(x.dtype), sin.view(shape).to(x.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)


def swiglu(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """``down(silu(gate(x)) * up(x))``; weights in ``nn.Linear`` layout (out, in)."""
    return F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)


@dataclass
class KVCache:
    """Per-layer caches of one sequence, grown by concatenation.

    ``latent[i]`` (S, kv_lora_rank): the normalised MLA latent ``kv_a_layernorm(c_KV)``, which is also the value in
    absorbed form; ``k_rope[i]`` (S, qk_rope_head_dim): the shared rotated key part; ``index_k[i]``
    (S, index_head_dim): the indexer keys (None on ``"shared"`` indexer layers). ``length`` = S.
    """

    n_layers: int
    length: int = 0
    latent: list = field(init=False)
    k_rope: list = field(init=False)
    index_k: list = field(init=False)

    def __post_init__(self):
        self.latent, self.k_rope, self.index_k = ([None] * self.n_layers for _ in range(3))

    def append(self, kind: str, layer: int, new: torch.Tensor) -> torch.Tensor:
        """Append ``new`` (T, d) to cache ``kind`` of ``layer`` and return the whole (S, d)."""
        store = getattr(self, kind)
        store[layer] = new if store[layer] is None else torch.cat([store[layer], new])
        return store[layer]


def _check_num_layers(num_layers: int, cfg) -> int:
    """``num_layers`` as an int in 1..num_hidden_layers: any integer (``np.int64`` too), never a bool or a float."""
    try:
        n = None if isinstance(num_layers, bool) else operator.index(num_layers)
    except TypeError:
        n = None
    if n is None or not 1 <= n <= cfg.num_hidden_layers:
        raise ValueError(f"num_layers must be in 1..{cfg.num_hidden_layers}, not {num_layers}")
    return n


def _is_seed(seed) -> bool:
    """An integer (not a bool) in 0..2**32-1."""
    try:
        return not isinstance(seed, bool) and 0 <= operator.index(seed) < 2**32
    except TypeError:
        return False


def _in_first_layers(hf_name: str, num_layers: int) -> bool:
    """Whether HF parameter ``hf_name`` belongs to a partial model: the embeddings or blocks ``0..num_layers-1``."""
    if hf_name == "model.embed_tokens.weight":
        return True
    prefix, _, rest = hf_name.partition("model.layers.")
    return prefix == "" and rest != "" and int(rest.split(".", 1)[0]) < num_layers


class ReferenceModel:
    """GLM-5 forward pass over a dict of HF-named weights (``nn.Linear`` layout, transformers-5 names, fused
    ``mlp.experts.gate_up_proj`` (E, 2I, H) and ``mlp.experts.down_proj`` (E, H, I)).

    ``cfg`` is a transformers ``GlmMoeDsaConfig``. Options (see the module docstring): ``mla`` ("expanded" or
    "absorbed"), ``qa_kv_norm_eps`` (float, or "rms_norm_eps"), ``sparse``. They are plain attributes and may be
    changed between calls. ``num_layers`` (default: all): the model holds only the embeddings and the first
    ``num_layers`` decoder layers, no final norm or ``lm_head`` (see :meth:`from_gguf`). The compute dtype is that
    of the weights; norms, softmax, router and indexer scores run in fp32 as in transformers (fp64 for fp64
    weights); logits and captured states are fp32 (fp64 for fp64 weights, which the metamorphic tests use to tell
    logic errors from rounding).
    """

    def __init__(self, cfg, weights: dict[str, torch.Tensor], *, mla: str = "expanded",
                 qa_kv_norm_eps: float | str = HF_QA_KV_NORM_EPS, sparse: bool = True,
                 num_layers: int | None = None):
        if mla not in MLA_MODES:
            raise ValueError(f"mla must be one of {MLA_MODES}, not {mla!r}")
        rope = getattr(cfg, "rope_parameters", None) or {}
        if rope.get("rope_type", "default") != "default":
            raise NotImplementedError(f"rope_type {rope['rope_type']!r}: only GLM-5's default RoPE is implemented")
        self.cfg, self.w = cfg, weights
        self.mla, self.sparse = mla, sparse
        self.qa_kv_norm_eps = float(cfg.rms_norm_eps if qa_kv_norm_eps == "rms_norm_eps" else qa_kv_norm_eps)
        if not (math.isfinite(self.qa_kv_norm_eps) and self.qa_kv_norm_eps > 0):  # NaN logits otherwise
            raise ValueError(f"qa_kv_norm_eps must be a positive finite number, not {qa_kv_norm_eps!r}")
        self.n_layers = cfg.num_hidden_layers if num_layers is None else _check_num_layers(num_layers, cfg)
        #: False for a partial model (``num_layers`` given): no final norm or output head, hidden states only
        self.has_head = num_layers is None
        self.n_heads, self.nope, self.rope, self.v_dim = (
            cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim)
        self.kv_lora = cfg.kv_lora_rank
        self.rope_theta = float(rope.get("rope_theta", 10000.0))
        self.scale = (self.nope + self.rope) ** -0.5
        self.index_heads, self.index_dim, self.index_topk = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
        self.indexer_types = list(getattr(cfg, "indexer_types", None) or ["full"] * self.n_layers)
        self.mlp_types = list(getattr(cfg, "mlp_layer_types", None) or
                              ["dense" if i < cfg.first_k_dense_replace else "sparse" for i in range(self.n_layers)])
        self.top_k, self.n_group, self.topk_group = cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group
        self.norm_topk_prob, self.routed_scaling_factor = cfg.norm_topk_prob, float(cfg.routed_scaling_factor)
        self.scoring_func = getattr(cfg, "scoring_func", "sigmoid")
        if self.scoring_func not in ("sigmoid", "softmax"):
            raise ValueError(f"scoring_func must be sigmoid or softmax, not {self.scoring_func!r}")
        self.rms_eps = cfg.rms_norm_eps
        emb = weights["model.embed_tokens.weight"]
        self.dtype, self.device = emb.dtype, emb.device

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_gguf(cls, path: str | os.PathLike, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                  num_layers: int | None = None, **options) -> "ReferenceModel":
        """Load a GLM-5 GGUF (one file or any shard of a split set) with glm5serve's dequantizers.

        Every tensor of the main model is checked against :func:`glm5serve.schema.expected_tensors` (presence,
        shape, quant type), dequantized to fp32, re-fused into the HF parameter (``attn_k_b``+``attn_v_b`` →
        ``kv_b_proj`` by :func:`~glm5serve.schema.merge_kv_b`, ``ffn_gate_exps``+``ffn_up_exps`` →
        ``experts.gate_up_proj``), then cast to ``dtype`` on ``device`` (router and indexer head weights: at least
        fp32).
        The MTP block is checked likewise and then ignored, as llama.cpp's glm-dsa graph does. ``options`` go to
        the constructor. Raises GGUFModelError (one line naming file and tensor) for any bad input, a weight that
        dequantizes to NaN or Inf included.

        ``num_layers`` (1 ≤ n ≤ ``num_hidden_layers``): every tensor is still checked, but only ``token_embd`` and
        blocks ``0..n-1`` are dequantized, so the first layers of the 744B model fit one GPU (GLM-5: ~3.8 GB of
        fp32 embeddings + ~1.5 GB per dense layer). The result has no output head: call ``forward(ids,
        capture=True)``, whose hidden states equal the full model's first ``n + 1`` bit for bit. ValueError if
        ``n`` is not an integer in range (a numpy integer will do; a bool or a float will not), or ``dtype`` is not
        one of :data:`COMPUTE_DTYPES` (float32, float64, bfloat16, float16).
        """
        from glm5serve.config import config_from_metadata
        from glm5serve.dequant import dequantize_tensor, zero_refused
        from glm5serve.gguf_file import GGUFModel
        from glm5serve.schema import expected_tensors, hf_to_gguf, merge_gate_up, merge_kv_b
        from glm5serve.synthetic import refuse_synthetic

        if dtype not in COMPUTE_DTYPES:  # int or float8 weights would load, then fail in the first matmul
            raise ValueError(f"dtype must be torch.float32, float64, bfloat16 or float16, not {dtype!r}")
        gguf = GGUFModel(path)
        refuse_synthetic(gguf)  # a header from synthetic-gguf has no tensor data to read
        cfg = config_from_metadata(gguf)
        for spec in expected_tensors(cfg):
            if spec.gguf_name not in gguf:
                if spec.required:
                    raise GGUFModelError("required tensor is missing", file=str(gguf.path), tensor=spec.gguf_name)
                continue
            info = gguf.conform(spec.gguf_name, spec.shape)  # llama.cpp's padded-ne equivalence, else refused
            if (why := spec.check_type(info.qtype)) is not None:
                raise GGUFModelError(why, file=info.file, tensor=info.name)
        if num_layers is not None:
            num_layers = _check_num_layers(num_layers, cfg)
        weights: dict[str, torch.Tensor] = {}
        for hf_name, parts in hf_to_gguf(cfg).items():
            if any(p not in gguf for p in parts):  # optional (e.g. indexer of a "shared" layer), checked above
                continue
            if num_layers is not None and not _in_first_layers(hf_name, num_layers):
                continue
            ts = [dequantize_tensor(gguf[p], dtype=torch.float32) for p in parts]
            for p, t in zip(parts, ts):  # a NaN/Inf weight (e.g. a NaN fp16 block scale) would make garbage text
                if not bool(t.isfinite().all()):
                    raise GGUFModelError("non-finite values after dequantization (NaN/Inf)", file=gguf[p].file,
                                         tensor=p)
                if (why := zero_refused(p, t.shape)) and not bool(t.any()):  # so would zeros (an unfilled download)
                    raise GGUFModelError(f"every value {why}", file=gguf[p].file, tensor=p)
            if hf_name.endswith("kv_b_proj.weight"):
                w = merge_kv_b(*ts)
            elif hf_name.endswith("experts.gate_up_proj"):
                w = merge_gate_up(*ts)
            else:
                (w,) = ts
            keep32 = hf_name.endswith(FP32_SUFFIXES)
            weights[hf_name] = w.to(device=device, dtype=torch.promote_types(dtype, torch.float32) if keep32 else dtype)
            del ts, w
        return cls(cfg, weights, num_layers=num_layers, **options)

    # ------------------------------------------------------------------ layers
    def _p(self, i: int, name: str) -> torch.Tensor:
        return self.w[f"model.layers.{i}.{name}"]

    def index_mask(self, i: int, x: torch.Tensor, q_resid: torch.Tensor, cos, sin, causal: torch.Tensor,
                   cache: KVCache | None) -> torch.Tensor:
        """DSA lightning indexer of layer ``i``: the (T, S) bool mask of the keys each query attends to.

        ``x`` (T, H) is the normed layer input, ``q_resid`` (T, q_lora_rank) the normed query latent, ``causal``
        (T, S) bool. ``q_I = wq_b(q_resid)`` (T, n, d), ``k_I = LayerNorm(wk(x))`` (S, d), RoPE on the first
        ``qk_rope_head_dim`` dims of both; ``score[t, s] = Σ_h w[t, h] · relu(q_I[t, h]·k_I[s] / √d)`` with
        ``w = weights_proj(x) / √n``; keep the top ``min(index_topk, t+1)`` causal keys (transformers
        ``GlmMoeDsaIndexer``; DeepSeek-V3.2 paper, eq. 1). Scores are fp32.
        """
        p, r = "self_attn.indexer.", self.rope
        T = x.shape[0]
        q = F.linear(q_resid, self._p(i, p + "wq_b.weight")).view(T, self.index_heads, self.index_dim)
        q = torch.cat([apply_rope_interleaved(q[..., :r], cos, sin), q[..., r:]], dim=-1)
        k = layer_norm(F.linear(x, self._p(i, p + "wk.weight")), self._p(i, p + "k_norm.weight"),
                       self._p(i, p + "k_norm.bias"), INDEXER_K_NORM_EPS)
        k = torch.cat([apply_rope_interleaved(k[:, :r], cos, sin), k[:, r:]], dim=-1)
        if cache is not None:
            k = cache.append("index_k", i, k)
        scores = F.relu(torch.matmul(upcast(q), upcast(k).T) * self.index_dim ** -0.5)  # (T, n, S)
        w = F.linear(upcast(x), upcast(self._p(i, p + "weights_proj.weight"))) * self.index_heads ** -0.5  # (T, n)
        index_scores = torch.matmul(w.unsqueeze(1), scores).squeeze(1).masked_fill(~causal, float("-inf"))  # (T, S)
        k_sel = min(self.index_topk, index_scores.shape[-1])
        chosen = torch.sort(index_scores, dim=-1, descending=True, stable=True).indices[:, :k_sel]
        return torch.zeros_like(causal).scatter_(1, chosen, True) & causal

    def attention(self, i: int, x: torch.Tensor, positions: torch.Tensor, cos, sin, cache: KVCache | None,
                  prev_mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """MLA + DSA attention of layer ``i`` on the normed input ``x`` (T, H) at ``positions`` (T,).

        Returns the attention output (T, H) and the (T, S) key mask used (handed to the next layer, which reuses it
        when its ``indexer_types`` entry is ``"shared"``). Latent ``c = RMSNorm(kv_a(x)[:kv_lora])``, per-head
        ``k_nope = W_UK c``, ``v = W_UV c`` (``kv_b_proj`` = [W_UK; W_UV] per head); score scale
        ``(qk_nope+qk_rope)^-0.5`` (DeepSeek-V2 paper, sec. 2.1; transformers ``GlmMoeDsaAttention``).
        """
        a = "self_attn."
        T, nh, nope, r = x.shape[0], self.n_heads, self.nope, self.rope
        q_resid = rms_norm(F.linear(x, self._p(i, a + "q_a_proj.weight")), self._p(i, a + "q_a_layernorm.weight"),
                           self.qa_kv_norm_eps)
        q = F.linear(q_resid, self._p(i, a + "q_b_proj.weight")).view(T, nh, nope + r)
        q_nope, q_pe = q[..., :nope], apply_rope_interleaved(q[..., nope:], cos, sin)
        kv = F.linear(x, self._p(i, a + "kv_a_proj_with_mqa.weight"))
        latent = rms_norm(kv[:, :self.kv_lora], self._p(i, a + "kv_a_layernorm.weight"), self.qa_kv_norm_eps)
        k_pe = apply_rope_interleaved(kv[:, self.kv_lora:], cos, sin)
        if cache is not None:
            latent, k_pe = cache.append("latent", i, latent), cache.append("k_rope", i, k_pe)
        S = latent.shape[0]
        causal = torch.arange(S, device=x.device)[None, :] <= positions[:, None]  # (T, S)
        if not self.sparse:
            mask = causal
        elif self.indexer_types[i] == "shared":
            if prev_mask is None:
                raise ValueError(f"layer {i} shares the indexer of a previous layer, but none precedes it")
            mask = prev_mask
        else:
            mask = self.index_mask(i, x, q_resid, cos, sin, causal, cache)

        kv_b = self._p(i, a + "kv_b_proj.weight").view(nh, nope + self.v_dim, self.kv_lora)
        if self.mla == "expanded":
            kv_full = F.linear(latent, self._p(i, a + "kv_b_proj.weight")).view(S, nh, nope + self.v_dim)
            k = torch.cat([kv_full[..., :nope], k_pe[:, None, :].expand(S, nh, r)], dim=-1)  # (S, nh, nope+r)
            v = kv_full[..., nope:]
            scores = torch.matmul(torch.cat([q_nope, q_pe], -1).transpose(0, 1), k.permute(1, 2, 0)) * self.scale
        else:
            q_abs = torch.matmul(q_nope.transpose(0, 1), kv_b[:, :nope])  # (nh, T, kv_lora) = W_UKᵀ q_nope
            scores = (torch.matmul(q_abs, latent.T) + torch.matmul(q_pe.transpose(0, 1), k_pe.T)) * self.scale
        probs = torch.softmax(upcast(scores.masked_fill(~mask, float("-inf"))), dim=-1).to(x.dtype)  # (nh, T, S)
        if self.mla == "expanded":
            out = torch.matmul(probs, v.transpose(0, 1))  # (nh, T, v)
        else:
            out = torch.matmul(torch.matmul(probs, latent), kv_b[:, nope:].transpose(1, 2))  # W_UV (P c)
        out = out.transpose(0, 1).reshape(T, nh * self.v_dim)
        return F.linear(out, self._p(i, a + "o_proj.weight")), mask

    def router_scores(self, i: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(scores ``s``, choice scores ``s + e_score_correction_bias``), both (T, E) fp32 (fp64 for fp64 weights),
        of MoE layer ``i`` on its normed input ``x`` (T, H): ``s = sigmoid(x·W_gᵀ)`` (GLM-5), or the softmax over
        the experts where ``scoring_func`` is ``softmax`` (``expert_gating_func`` 1, as llama.cpp's
        ``build_moe_ffn`` and vLLM's ``grouped_topk`` run it)."""
        logits = F.linear(upcast(x), upcast(self._p(i, "mlp.gate.weight")))
        scores = logits.softmax(-1) if self.scoring_func == "softmax" else logits.sigmoid()
        return scores, scores + upcast(self._p(i, "mlp.gate.e_score_correction_bias"))

    def router(self, i: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Router of MoE layer ``i``: (weights (T, k) fp32, expert ids (T, k)).

        Experts chosen by top-k of the choice scores ``s + e_score_correction_bias`` (:meth:`router_scores`; within
        the best ``topk_group`` of ``n_group`` groups, each scored by its top-2 sum); weights are the chosen ``s``
        (bias not included), normalised to sum 1 if ``norm_topk_prob``, times ``routed_scaling_factor``
        (transformers ``GlmMoeDsaTopkRouter``; DeepSeek-V3 "noaux_tc").
        """
        scores, choice = self.router_scores(i, x)
        E = choice.shape[-1]
        if self.n_group > 1:
            grouped = choice.view(-1, self.n_group, E // self.n_group)
            best_groups = grouped.topk(2, dim=-1).values.sum(-1).topk(self.topk_group, dim=-1).indices
            keep = torch.zeros_like(grouped[..., 0], dtype=torch.bool).scatter_(1, best_groups, True)
            choice = grouped.masked_fill(~keep[..., None], float("-inf")).view(-1, E)
        ids = choice.topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * self.routed_scaling_factor, ids

    def routed_experts(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """Σ_k weight_k · SwiGLU_{expert_k}(x) over the routed experts of MoE layer ``i``; ``x`` (T, H) → (T, H)."""
        weights, ids = self.router(i, x)
        gate_up, down = self._p(i, "mlp.experts.gate_up_proj"), self._p(i, "mlp.experts.down_proj")
        out = torch.zeros_like(x)
        for e in ids.unique().tolist():
            tok, slot = (ids == e).nonzero(as_tuple=True)
            g, u = F.linear(x[tok], gate_up[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(g) * u, down[e])
            out.index_add_(0, tok, (y * weights[tok, slot, None]).to(x.dtype))
        return out

    def ffn(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """Feed-forward of layer ``i`` on the normed input ``x`` (T, H): dense SwiGLU, or routed + shared experts."""
        if self.mlp_types[i] == "dense":
            return swiglu(x, self._p(i, "mlp.gate_proj.weight"), self._p(i, "mlp.up_proj.weight"),
                          self._p(i, "mlp.down_proj.weight"))
        s = "mlp.shared_experts."
        shared = swiglu(x, self._p(i, s + "gate_proj.weight"), self._p(i, s + "up_proj.weight"),
                        self._p(i, s + "down_proj.weight"))
        return self.routed_experts(i, x) + shared

    # ------------------------------------------------------------------ model
    @torch.inference_mode()
    def forward(self, input_ids, cache: KVCache | None = None, *, capture: bool = False):
        """Logits (T, vocab) fp32 (fp64 for fp64 weights) for every position of ``input_ids`` (LongTensor or
        ints, shape (T,)).

        With a ``cache``, the tokens continue the cached sequence (positions start at ``cache.length``) and the
        cache is extended. With ``capture=True`` returns ``(logits, hidden)``, ``hidden`` a list of
        ``num_hidden_layers + 1`` fp32 (T, H) tensors: the embeddings, then the residual stream after each layer
        (what a forward hook on transformers' ``GlmMoeDsaDecoderLayer`` returns), for locating a divergence.
        A partial model (``has_head`` False) has ``n_layers + 1`` of them, no logits (``(None, hidden)``) and
        needs ``capture=True`` (ValueError otherwise). ValueError too for no ids, ids that are not one integer
        sequence (a batch, floats) or ids outside the vocabulary.
        """
        if not self.has_head and not capture:
            raise ValueError(f"this model holds only its first {self.n_layers} layers and no output head: "
                             "call it with capture=True for the hidden states")
        ids = torch.as_tensor(input_ids, device=self.device)
        if ids.numel() == 0:  # as_tensor([]) is float32: the dtype message below would mislead
            raise ValueError("input_ids holds no token: a forward pass needs at least one")
        if ids.dim() != 1 or ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise ValueError(f"input_ids must be one sequence of integer token ids, shape (T,), not "
                             f"{tuple(ids.shape)} {ids.dtype}")
        ids = ids.long()
        vocab = self.w["model.embed_tokens.weight"].shape[0]
        if ids.numel() and not (0 <= int(ids.min()) and int(ids.max()) < vocab):  # else an IndexError naming nothing
            bad = int(ids.min()) if int(ids.min()) < 0 else int(ids.max())
            raise ValueError(f"token id {bad} is outside the vocabulary (0..{vocab - 1})")
        start = cache.length if cache is not None else 0
        positions = torch.arange(start, start + ids.numel(), device=self.device)
        cos, sin = rope_cos_sin(positions, self.rope, self.rope_theta)
        h = F.embedding(ids, self.w["model.embed_tokens.weight"])
        hidden = [upcast(h)] if capture else None
        mask = None
        for i in range(self.n_layers):
            attn, mask = self.attention(i, rms_norm(h, self._p(i, "input_layernorm.weight"), self.rms_eps),
                                        positions, cos, sin, cache, mask)
            h = h + attn
            h = h + self.ffn(i, rms_norm(h, self._p(i, "post_attention_layernorm.weight"), self.rms_eps))
            if capture:
                hidden.append(upcast(h))
        if cache is not None:
            cache.length += ids.numel()
        if not self.has_head:
            return None, hidden
        h = rms_norm(h, self.w["model.norm.weight"], self.rms_eps)
        logits = upcast(F.linear(h, self.w["lm_head.weight"]))
        return (logits, hidden) if capture else logits

    __call__ = forward

    def new_cache(self) -> KVCache:
        """An empty :class:`KVCache` for one sequence."""
        return KVCache(self.n_layers)

    @torch.inference_mode()
    def stream(self, prompt_ids: Sequence[int], max_new_tokens: int, *, greedy: bool = True,
               temperature: float = 1.0, seed: int = 0, stop_ids: Sequence[int] = ()
               ) -> Iterator[tuple[int, torch.Tensor]]:
        """Yield ``(token_id, logprobs)`` for up to ``max_new_tokens`` new tokens, ``logprobs`` the (vocab,) fp32
        log-softmax the token was drawn from (before temperature). Prefill once, then one token per step
        through the KV cache. Greedy = argmax (lowest id on ties); otherwise sampling at ``temperature`` with a
        ``torch.Generator`` seeded by ``seed``; a temperature below 1e-5 is greedy, as in vLLM (``_SAMPLING_EPS``,
        vllm/sampling_params.py), where logits / temperature would overflow. Stops after yielding a token in
        ``stop_ids``. Raises ValueError for an empty prompt, a negative ``max_new_tokens``, a prompt plus
        ``max_new_tokens`` past the context length (``max_position_embeddings``, as vLLM refuses a request past
        ``max_model_len``) or, when sampling, a temperature that is not finite > 0 or a ``seed`` outside
        0..2**32-1 (llama.cpp's ``uint32_t`` seed; torch's CPU generator keeps only the low 32 bits, so larger seeds
        would repeat smaller ones' samples).
        """
        if len(prompt_ids) == 0:
            raise ValueError("the prompt must hold at least one token")
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, not {max_new_tokens}")
        n_ctx = self.cfg.max_position_embeddings
        if len(prompt_ids) + max_new_tokens > n_ctx:
            raise ValueError(f"a prompt of {len(prompt_ids)} tokens + max_new_tokens {max_new_tokens} exceeds the "
                             f"context length of {n_ctx} tokens")
        if not greedy and not (math.isfinite(temperature) and temperature > 0):  # -1 would invert the distribution
            raise ValueError(f"sampling needs a finite temperature > 0, not {temperature}")
        if not greedy and not _is_seed(seed):
            raise ValueError(f"seed must be an integer in 0..2**32-1, not {seed!r}")
        greedy = greedy or temperature < 1e-5
        cache = self.new_cache()
        gen = None if greedy else torch.Generator(device=self.device).manual_seed(operator.index(seed))
        logits = self.forward(list(prompt_ids), cache)[-1]
        for n in range(max_new_tokens):
            logprobs = torch.log_softmax(logits, dim=-1)
            if greedy:
                tok = int(logits.argmax())
            else:
                tok = int(torch.multinomial(torch.softmax(logits / temperature, dim=-1), 1, generator=gen))
            yield tok, logprobs
            if tok in stop_ids or n + 1 == max_new_tokens:
                return
            logits = self.forward([tok], cache)[-1]

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, greedy: bool = True, **kwargs) -> list[int]:
        """The new token ids (at most ``max_new_tokens``) continuing ``prompt_ids``; see :meth:`stream`."""
        return [tok for tok, _ in self.stream(prompt_ids, max_new_tokens, greedy=greedy, **kwargs)]
