"""The padding-free pass's variable-length attention (the GPU's path), checked on the CPU.

torch's varlen (flash) attention runs on CUDA only; here a reference implementation with the
same signature (each input's attention on its own, by plain scaled_dot_product_attention) stands
in for it, so what warmgate does around it (the rows' token offsets, the packed layout, the
reshapes, padding rows) is checked against the CPU's padded-keys pass and sentence-transformers.
"""

from __future__ import annotations

import itertools

import numpy as np
import torch
import torch.nn.functional as F
from support.server import pooled

from warmgate_server.packed import PackedBert

TEXTS = [
    "hi",
    "A man is eating food.",
    "Kubernetes readiness gates keep a pod out of the endpoints until a condition turns true.",
]


def reference_varlen(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k):
    """varlen_attn's contract: (tokens, heads, head) packed inputs, int32 offsets."""
    assert cu_seq_q.dtype == torch.int32 and torch.equal(cu_seq_q, cu_seq_k)
    bounds = cu_seq_q.tolist()
    assert max(b - a for a, b in itertools.pairwise(bounds)) <= max_q == max_k
    out = torch.empty_like(q)
    for start, stop in itertools.pairwise(bounds):
        part = [t[start:stop].transpose(0, 1) for t in (q, k, v)]  # (heads, n, head)
        out[start:stop] = F.scaled_dot_product_attention(*part).transpose(0, 1)
    return out


def test_variable_length_attention_gives_the_padded_passs_vectors(
    minilm_dir, loaded_minilm, sentence_transformer
) -> None:
    padded_keys = PackedBert.from_folder(minilm_dir, torch.float32)
    varlen = PackedBert.from_folder(minilm_dir, torch.float32)
    assert varlen.varlen is None  # on a CPU the padded-keys path is the real one
    varlen.varlen = reference_varlen
    token_lists = loaded_minilm.tokenizer(TEXTS)["input_ids"]
    with torch.inference_mode():
        for pooling in ("mean", "cls", "last", "none"):
            expected = pooled(padded_keys, token_lists, 32, 4, pooling)  # 4 rows: one padding row
            got = pooled(varlen, token_lists, 32, 4, pooling)
            torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4)
        vectors = pooled(varlen, token_lists, 32, 3, "mean").numpy()
    reference = sentence_transformer.encode(TEXTS, convert_to_numpy=True)
    cosine = (vectors * reference).sum(1) / (
        np.linalg.norm(vectors, axis=1) * np.linalg.norm(reference, axis=1)
    )
    assert cosine.min() >= 0.99999


def test_onednn_linear_layers_give_mkls_states(minilm_dir, loaded_minilm, monkeypatch) -> None:
    """On a CPU in fp32 the linear layers run through oneDNN on reordered weights, the GELU
    fused; WARMGATE_ONEDNN=0 keeps torch's plain linear (MKL). Both give the same states, in
    the padding-free pass and the static (padded) one."""
    onednn = PackedBert.from_folder(minilm_dir, torch.float32)
    monkeypatch.setenv("WARMGATE_ONEDNN", "0")
    plain = PackedBert.from_folder(minilm_dir, torch.float32)
    assert onednn.onednn and not plain.onednn
    token_lists = loaded_minilm.tokenizer(TEXTS)["input_ids"]
    ids = torch.zeros(3, 32, dtype=torch.int64)
    mask = torch.zeros(3, 32, dtype=torch.int64)
    for row, tokens in enumerate(token_lists):
        ids[row, : len(tokens)] = torch.tensor(tokens)
        mask[row, : len(tokens)] = 1
    with torch.inference_mode():
        for pooling in ("mean", "cls"):
            expected = pooled(plain, token_lists, 32, 4, pooling)
            torch.testing.assert_close(
                pooled(onednn, token_lists, 32, 4, pooling), expected, atol=2e-5, rtol=1e-4
            )
        states = onednn.dense(ids, mask)[mask.bool()]
        torch.testing.assert_close(
            states, plain.dense(ids, mask)[mask.bool()], atol=2e-5, rtol=1e-4
        )
