"""The padding-free pass's variable-length attention (the GPU's path), checked on the CPU.

torch's varlen (flash) attention runs on CUDA only; here a reference implementation with the
same signature (each input's attention on its own, by plain scaled_dot_product_attention) stands
in for it, so what warmgate does around it (the rows' token offsets, the packed layout, the
reshapes, padding rows) is checked against the CPU's padded-keys pass and sentence-transformers.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from support.server import dense_pooled, padded_batch, pooled

from warmgate_server.models.bert import PackedBert
from warmgate_testkit import zoo

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
    # One linear kernel for both: each measures its own at load, and under load two
    # measurements can pick apart (the passes are compared here, not the kernels).
    padded_keys = PackedBert.from_folder(minilm_dir, torch.float32, linear_kernel="mkl")
    varlen = PackedBert.from_folder(minilm_dir, torch.float32, linear_kernel="mkl")
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


def test_onednn_linear_layers_give_mkls_states(minilm_dir, loaded_minilm) -> None:
    """On a CPU in fp32 the linear layers run through oneDNN on reordered weights, the GELU
    fused (--linear onednn), or torch's plain linear (MKL: --linear mkl, or the older
    WARMGATE_ONEDNN=0). Both give the same states, in the padding-free pass and the
    static (padded) one."""
    onednn = PackedBert.from_folder(minilm_dir, torch.float32, linear_kernel="onednn")
    plain = PackedBert.from_folder(minilm_dir, torch.float32, linear_kernel="mkl")
    # The server's older spelling, WARMGATE_ONEDNN=0, is --linear mkl (test_config.py).
    assert onednn.onednn and not plain.onednn
    assert onednn.kernels.names == ("onednn",) and plain.kernels.names == ("mkl",)
    token_lists = loaded_minilm.tokenizer(TEXTS)["input_ids"]
    ids, mask = padded_batch(token_lists, 3, 32)
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


def test_bfloat16_on_a_cpu_runs_onednn_too_and_gives_torchs_states(
    minilm_dir, loaded_minilm
) -> None:
    """bfloat16 on a CPU is measured at load as fp32 is, oneDNN on reordered weights against
    torch's own F.linear (`aten`: not MKL in bfloat16); both give the same states to bfloat16's
    rounding, and fp32's to its precision. A CPU where oneDNN has no bfloat16 kernels (no
    AVX512_BF16 or AMX) runs F.linear alone and says so, whatever --linear asks."""
    tokenizer = loaded_minilm.tokenizer
    token_lists = tokenizer(TEXTS)["input_ids"]
    auto = PackedBert.from_folder(minilm_dir, torch.bfloat16)
    report = auto.kernels.as_json()
    exact = PackedBert.from_folder(minilm_dir, torch.float32)
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        asked = PackedBert.from_folder(minilm_dir, torch.bfloat16, linear_kernel="onednn")
        for model in (auto, asked):
            assert model.kernels.as_json() == {
                "kernels": ["aten"],
                "chosen_by": "cpu, bfloat16: F.linear",
            }
        with torch.inference_mode():
            got = pooled(auto, token_lists, 32, 4, "mean").float()
            want = pooled(exact, token_lists, 32, 4, "mean")
        assert F.cosine_similarity(got, want).min() >= 0.999
        return
    assert report["chosen_by"] == "measured" and set(report["measured_ms"]) == {"onednn", "aten"}
    onednn = PackedBert.from_folder(minilm_dir, torch.bfloat16, linear_kernel="onednn")
    plain = PackedBert.from_folder(minilm_dir, torch.bfloat16, linear_kernel="aten")
    assert onednn.kernels.names == ("onednn",) and plain.kernels.names == ("aten",)
    with torch.inference_mode():
        want = pooled(exact, token_lists, 32, 4, "mean")
        for model in (onednn, plain):
            got = pooled(model, token_lists, 32, 4, "mean").float()
            assert F.cosine_similarity(got, want).min() >= 0.999
        assert (
            F.cosine_similarity(
                pooled(onednn, token_lists, 32, 4, "mean").float(),
                pooled(plain, token_lists, 32, 4, "mean").float(),
            ).min()
            >= 0.9995
        )


def test_inputs_of_one_length_skip_the_padding_and_give_the_same_states(
    minilm_dir, loaded_minilm
) -> None:
    """On a CPU, a lone input or inputs all of one length run attention on the packed tokens'
    own layout (no scatter into a padded layout, no mask): the states are the padded-keys
    pass's (the same inputs beside a longer one) and transformers' BertModel's."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(str(minilm_dir)).eval()
    packed = PackedBert.from_folder(minilm_dir, torch.float32)
    tokenizer = loaded_minilm.tokenizer
    lone = tokenizer(["A man is eating food."])["input_ids"]
    alike = tokenizer(["a b c d", "e f g h", "i j k l"])["input_ids"]
    assert len({len(ids) for ids in alike}) == 1
    longer = tokenizer(["a sentence longer than the others, padded to"])["input_ids"]
    with torch.inference_mode():
        for batch in (lone, alike):
            states, starts, lengths = packed.encode(batch, 32, len(batch))
            # The same inputs beside a longer one take the padded-keys route.
            mixed, mixed_starts, _ = packed.encode([*batch, *longer], 32, len(batch) + 1)
            for row, ids in enumerate(batch):
                got = states[starts[row] : starts[row] + lengths[row]]
                beside = mixed[mixed_starts[row] : mixed_starts[row] + len(ids)]
                torch.testing.assert_close(got, beside, atol=2e-5, rtol=1e-4)
                want = model(torch.tensor([ids])).last_hidden_state[0]
                torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def test_the_faster_kernel_is_measured_at_load_and_each_pass_takes_its_own(
    minilm_dir, loaded_minilm, monkeypatch
) -> None:
    """At load both kernels are timed on the model's own matrices at a lone input's, a
    batch's and the plan's largest pass's token counts; when each wins some (as on an AVX2
    EPYC: oneDNN for a lone input, MKL for batches; on an Ice Lake Xeon oneDNN up to a few
    hundred tokens, MKL for thousands) and the weights are small, both are kept and a pass
    takes the one for its token count. The measurement is replaced here to make each win
    some; the states are transformers' either way."""
    from transformers import AutoModel

    from warmgate_server.models import linear

    auto = PackedBert.from_folder(minilm_dir, torch.float32)  # the real measurement
    report = auto.kernels.as_json()
    assert report["chosen_by"] == "measured", report
    assert set(report["measured_ms"]) == {"onednn", "mkl"}
    assert set(report["measured_ms"]["mkl"]) == {str(linear.SMALL_ROWS), str(linear.LARGE_ROWS)}
    planned = PackedBert.from_folder(minilm_dir, torch.float32, largest_rows=1800)
    assert set(planned.kernels.as_json()["measured_ms"]["mkl"]) == {"16", "256", "1800"}
    capped = PackedBert.from_folder(minilm_dir, torch.float32, largest_rows=16384)
    assert set(capped.kernels.as_json()["measured_ms"]["mkl"]) == {"16", "256", "2048"}

    def split(kernels, rows, plain):
        return {"onednn": {16: 1.0, 256: 10.0}, "mkl": {16: 2.0, 256: 5.0}}

    monkeypatch.setattr(linear, "measure", split)
    both = PackedBert.from_folder(minilm_dir, torch.float32)
    assert both.kernels.names == ("onednn", "mkl")
    assert both.kernels.for_rows(10).name == "onednn"
    assert both.kernels.for_rows(300).name == "mkl"

    def large_passes(kernels, rows, plain):  # the Ice Lake's form: a near tie goes to MKL
        return {
            "onednn": {16: 1.0, 256: 10.0, 2048: 100.0},
            "mkl": {16: 2.0, 256: 12.0, 2048: 97.0},
        }

    monkeypatch.setattr(linear, "measure", large_passes)
    stepped = PackedBert.from_folder(minilm_dir, torch.float32, largest_rows=16384)
    assert stepped.kernels.as_json()["from_tokens"] == {"0": "onednn", "724": "mkl"}
    assert [stepped.kernels.for_rows(rows).name for rows in (1, 300, 723, 724, 5000)] == [
        "onednn",
        "onednn",
        "onednn",
        "mkl",
        "mkl",
    ]
    monkeypatch.setattr(linear, "BOTH_LIMIT", 1)  # weights too big for two copies
    one = PackedBert.from_folder(minilm_dir, torch.float32, largest_rows=16384)
    assert one.kernels.names == ("mkl",) and "one copy" in one.kernels.chosen_by
    monkeypatch.setattr(linear, "measure", split)
    one = PackedBert.from_folder(minilm_dir, torch.float32)
    assert one.kernels.names == ("mkl",) and "one copy" in one.kernels.chosen_by

    model = AutoModel.from_pretrained(str(minilm_dir)).eval()
    tokenizer = loaded_minilm.tokenizer
    lone = tokenizer(["A man is eating food."])["input_ids"]
    batch = tokenizer(["A man is eating food. " * 8] * 12)["input_ids"]
    with torch.inference_mode():
        for inputs in (lone, batch):
            states, starts, lengths = both.encode(inputs, 128, len(inputs))
            want = model(torch.tensor(inputs)).last_hidden_state
            for row in range(len(inputs)):
                got = states[starts[row] : starts[row] + lengths[row]]
                torch.testing.assert_close(got, want[row], atol=2e-5, rtol=1e-4)


# The packed families besides BERT, and where their position ids start.
FAMILY_OFFSETS = {"xlm-roberta-cls": 2, "roberta-bpe": 2, "roberta-wordpiece": 2, "camembert": 2,
                  "distilbert": 0}  # fmt: skip


@pytest.mark.parametrize("family", FAMILY_OFFSETS)
def test_the_gpus_passes_give_the_cpus_states_for_the_roberta_family_and_distilbert(
    tmp_path_factory: pytest.TempPathFactory, family: str
) -> None:
    """The RoBERTa family's position ids start at pad_token_id + 1, on every pass, and
    DistilBERT has no token type embeddings: the variable-length (flash) attention pass and
    the static pass a CUDA graph captures give the states of the CPU's padded-keys pass (which
    the zoo's tests hold to sentence-transformers), up to each input's longest allowed length
    and with a padding row."""
    from transformers import AutoTokenizer

    folder = zoo.build(family, "current", tmp_path_factory.mktemp("zoo"))
    # One linear kernel for both: each measures its own at load, and under load two
    # measurements can pick apart (the passes are compared here, not the kernels).
    padded_keys = PackedBert.from_folder(folder, torch.float32, linear_kernel="mkl")
    varlen = PackedBert.from_folder(folder, torch.float32, linear_kernel="mkl")
    varlen.varlen = reference_varlen
    assert padded_keys.offset == FAMILY_OFFSETS[family]  # RoBERTa's: pad_token_id 1, plus 1
    limit = padded_keys.max_positions
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    token_lists = [ids[:limit] for ids in tokenizer(zoo.TEXTS)["input_ids"]]
    assert max(map(len, token_lists)) == limit  # the long text runs at the limit itself
    rows = len(token_lists) + 1  # one padding row
    with torch.inference_mode():
        for pooling in ("mean", "cls", "none"):
            expected = pooled(padded_keys, token_lists, limit, rows, pooling)
            got = pooled(varlen, token_lists, limit, rows, pooling)
            torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4)
        ids, mask = padded_batch(token_lists, len(token_lists), limit, tokenizer.pad_token_id)
        for pooling in ("mean", "cls"):
            expected = pooled(padded_keys, token_lists, limit, len(token_lists), pooling)
            got = dense_pooled(padded_keys, ids, mask, pooling)
            torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4)


def test_mpnet_attends_with_its_relative_position_bias_on_every_pass(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch
) -> None:
    """MPNet (all-mpnet-base-v2) adds a relative position bias to every layer's attention
    scores: the padding-free pass (inputs of mixed lengths, then of one length, which skip the
    padding) and the static pass a CUDA graph captures give transformers' MPNetModel states
    up to the position limit, where distances reach the logarithmic buckets. The bias is what
    makes them: without it the states are far off. It cannot go through flash attention, so
    MPNet never takes the variable-length path where BERT would."""
    from transformers import AutoModel, AutoTokenizer

    from warmgate_server.models import packing as packed_module

    folder = zoo.build("mpnet", "current", tmp_path_factory.mktemp("zoo"))
    model = AutoModel.from_pretrained(str(folder)).eval()
    packed = PackedBert.from_folder(folder, torch.float32)
    assert packed.offset == 2 and packed.token_type is None
    limit = packed.max_positions
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    token_lists = [ids[:limit] for ids in tokenizer(zoo.TEXTS)["input_ids"]]
    assert max(map(len, token_lists)) == limit > 16 * 2  # distances past the exact buckets
    same_length = [token_lists[-1]] * 2
    unbiased = PackedBert.from_folder(folder, torch.float32)
    unbiased.relative_bias = torch.zeros_like(unbiased.relative_bias)
    with torch.inference_mode():
        for batch in (token_lists, same_length):
            ids, mask = padded_batch(batch, len(batch), limit, tokenizer.pad_token_id)
            want = model(input_ids=ids, attention_mask=mask).last_hidden_state
            states, starts, lengths = packed.encode(batch, limit, len(batch))
            wrong, _, _ = unbiased.encode(batch, limit, len(batch))
            dense = packed.dense(ids, mask)
            for row, (start, length) in enumerate(zip(starts, lengths, strict=True)):
                expected = want[row, :length]
                torch.testing.assert_close(states[start : start + length], expected, **CLOSE)
                torch.testing.assert_close(dense[row, :length], expected, **CLOSE)
                assert (wrong[start : start + length] - expected).abs().max() > 0.05

    monkeypatch.setattr(packed_module, "varlen_attention", lambda *_args: reference_varlen)
    assert PackedBert.from_folder(folder, torch.float32).varlen is None
    bert = zoo.build("bert-mean", "current", tmp_path_factory.mktemp("zoo"))
    assert PackedBert.from_folder(bert, torch.float32).varlen is reference_varlen


CLOSE = {"atol": 1e-4, "rtol": 1e-4}
"""Two float32 passes of a tiny random model: their rounding through two layers reaches a few
1e-5 against float64 on these states (a CamemBERT's 4.2e-5 from transformers' pass once); a
wrong position id or relative bias moves them by a twentieth and more (`wrong` above)."""


@pytest.mark.parametrize(
    "family", [*(f for f, offset in FAMILY_OFFSETS.items() if offset), "mpnet"]
)
def test_a_padding_token_written_in_the_text_takes_transformers_positions(
    tmp_path_factory: pytest.TempPathFactory, family: str
) -> None:
    """A `<pad>` (`[PAD]`) written in the text is the padding id once tokenized; RoBERTa's and
    MPNet's position ids skip it (transformers' create_position_ids_from_input_ids): it takes
    position pad_token_id and the tokens after it go on from the count before it. The packed
    pass (mixed lengths, one length) and the static pass give transformers' states for such
    inputs, beside inputs without one."""
    from transformers import AutoModel, AutoTokenizer

    folder = zoo.build(family, "current", tmp_path_factory.mktemp("zoo"))
    model = AutoModel.from_pretrained(str(folder)).eval()
    packed = PackedBert.from_folder(folder, torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    pad = tokenizer.pad_token_id
    assert pad == packed.offset - 1
    texts = [
        f"the cat {tokenizer.pad_token} sat on the mat",
        "a dog ran",
        f"{tokenizer.pad_token} x",
    ]
    batch = tokenizer(texts)["input_ids"]
    assert all(pad in ids[1:-1] for ids in (batch[0], batch[2]))  # in the text, not padding
    with torch.inference_mode():
        for inputs in (batch, [batch[0], batch[0]]):
            seq_len = max(map(len, inputs))
            ids, mask = padded_batch(inputs, len(inputs), seq_len, pad)
            want = model(input_ids=ids, attention_mask=mask).last_hidden_state
            states, starts, lengths = packed.encode(inputs, seq_len, len(inputs))
            dense = packed.dense(ids, mask)
            for row, (start, length) in enumerate(zip(starts, lengths, strict=True)):
                torch.testing.assert_close(
                    states[start : start + length], want[row, :length], **CLOSE
                )
                torch.testing.assert_close(dense[row, :length], want[row, :length], **CLOSE)


def test_onednn_runs_at_a_bounded_set_of_row_counts_that_warmup_makes_in_advance(
    minilm_dir, loaded_minilm
) -> None:
    """oneDNN makes and keeps a primitive per row count, and a batch's row count is its real
    tokens: without a bound, a server's memory grew by 2.7 MiB at every new count (344 MiB
    over the counts 3 to 128), and the first request at a count paid the primitive (1.3-1.5x
    its steady time here). Row counts are padded up to a bounded set (at most 12.5% more
    above 32 rows), the states are MKL's for every count, and once warmup made the set up to
    128 rows, passes at every count add no more than their activations do."""
    from warmgate_contract.shapes import Shape
    from warmgate_server.memory import anonymous_bytes
    from warmgate_server.models import linear
    from warmgate_server.runner import ModelRunner

    padded = [linear.onednn_rows(rows) for rows in range(1, 16385)]
    assert padded[:9] == [4, 4, 4, 4, 8, 8, 8, 8, 12]
    assert all(rows <= got for rows, got in enumerate(padded, 1))
    assert all(got <= max(rows + 7, rows * 1.125) for rows, got in enumerate(padded, 1))
    assert len(set(padded[:128])) == 20 and len(set(padded)) <= 20 + 8 * 7
    assert [linear.onednn_rows(r) for r in (129, 1000, 16384)] == [144, 1024, 16384]

    onednn = PackedBert.from_folder(minilm_dir, torch.float32, linear_kernel="onednn")
    plain = PackedBert.from_folder(minilm_dir, torch.float32, linear_kernel="mkl")
    assert linear.warm(plain.kernels) == 0  # MKL makes nothing ahead
    split = linear.Kernels(((0, onednn.kernels.first), (64, plain.kernels.first)), "test")
    assert linear.warm(split) == 12  # 4, 8, ..., 32, 40, ..., 64: the counts below 64

    ids = loaded_minilm.tokenizer(["warm gate " * 80])["input_ids"][0]
    with torch.inference_mode():
        for count in range(1, 71):
            tokens = [ids[: count - 1] + ids[-1:]] if count > 1 else [ids[:1]]
            got, _, _ = onednn.encode(tokens, 128, 1)
            want, _, _ = plain.encode(tokens, 128, 1)
            assert got.shape == want.shape == (count, 384)
            torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)

    loaded_minilm.packed, kept = onednn, loaded_minilm.packed
    try:
        runner = ModelRunner(loaded_minilm, "mean", 256)
        assert runner.warm_kernels() == 20
        before = anonymous_bytes()
        for count in range(3, 129):
            runner.execute([ids[: count - 1] + ids[-1:]], Shape(1, 128), 0)
        grown = (anonymous_bytes() - before) / 2**20
    finally:
        loaded_minilm.packed = kept
    assert grown < 150, f"{grown:.0f} MiB"  # MKL's own passes here: 51 MiB
