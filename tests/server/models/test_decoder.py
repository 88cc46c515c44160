"""The decoders' padding-free passes (decoder.py) against transformers: Qwen3-Embedding's
against Qwen3Model, EmbeddingGemma's against Gemma3TextModel (bidirectional, sliding and full
layers). The token states of every pass, for inputs of mixed lengths, of one length and alone,
up to inputs longer than the zoo's warmup buckets (and than Gemma's window); checkpoints saved
as a causal LM and configs in the hub's older form; and the configurations the pass leaves to
transformers. The served vectors against sentence-transformers are test_models.py's (the zoo's
qwen3 and gemma3-dense rows run packed)."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from support.server import dense_pooled, padded_batch, pooled

from warmgate_server.models.decoder import PackedDecoder, supports_config
from warmgate_testkit import zoo

CLOSE = {"atol": 2e-5, "rtol": 1e-4}
LONG = 200
"""Tokens of the longest input: far past the zoo's buckets, inside its 256 positions."""


def token_lists(folder: Path) -> list[list[int]]:
    """The zoo's texts as Qwen3-Embedding's tokenizer encodes them (each ends with
    <|endoftext|>, the token last-token pooling takes), the longest cut to LONG tokens."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    lists = [
        ids if len(ids) <= LONG else ids[: LONG - 1] + ids[-1:]
        for ids in tokenizer(zoo.TEXTS)["input_ids"]
    ]
    assert max(map(len, lists)) == LONG and min(map(len, lists)) < 8
    return lists


def expected_states(model, batch: list[list[int]], side: str) -> list[torch.Tensor]:
    """transformers' states of each input's tokens, the batch padded on `side` (the tokenizer
    of Qwen3-Embedding pads on the left; warmgate's static pass on the right)."""
    seq_len = max(map(len, batch))
    ids = torch.zeros(len(batch), seq_len, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, tokens in enumerate(batch):
        where = slice(seq_len - len(tokens), None) if side == "left" else slice(0, len(tokens))
        ids[row, where] = torch.tensor(tokens)
        mask[row, where] = 1
    states = model(input_ids=ids, attention_mask=mask).last_hidden_state
    return [
        states[row, seq_len - len(tokens) :] if side == "left" else states[row, : len(tokens)]
        for row, tokens in enumerate(batch)
    ]


def assert_every_pass_gives(
    model, packed: PackedDecoder, lists: list[list[int]], seq_len: int, pooling: str
) -> None:
    """The packed pass on `lists` (mixed lengths), on its longest twice (one length) and on
    its first alone, and the static pass on the same batches right-padded, give `model`'s
    states whether it is padded on the left or the right; both pool alike."""
    longest = max(lists, key=len)
    batches = {"mixed": lists, "one length": [longest, longest[::-1]], "alone": lists[:1]}
    with torch.inference_mode():
        for what, batch in batches.items():
            states, starts, lengths = packed.encode(batch, seq_len, len(batch))
            ids, mask = padded_batch(batch, len(batch), max(map(len, batch)))
            dense = packed.dense(ids, mask)
            for side in ("left", "right"):
                want = expected_states(model, batch, side)
                for row, (start, length) in enumerate(zip(starts, lengths, strict=True)):
                    got = states[start : start + length]
                    torch.testing.assert_close(got, want[row], **CLOSE, msg=f"{what} {side}")
                    torch.testing.assert_close(dense[row, :length], want[row], **CLOSE)
            vectors = pooled(packed, batch, seq_len, len(batch), pooling)
            torch.testing.assert_close(vectors, dense_pooled(packed, ids, mask, pooling), **CLOSE)


@pytest.mark.parametrize("layout", zoo.LAYOUTS)
def test_every_pass_gives_qwen3models_states(
    tmp_path_factory: pytest.TempPathFactory, layout: str
) -> None:
    """Grouped-query attention (4 query heads, 2 key/value heads), q/k norms, RoPE and the
    causal mask: the packed pass (mixed lengths up to LONG tokens, one length, a lone input)
    and the static pass a CUDA graph captures give transformers' states, whether transformers
    pads on the left (as sentence-transformers runs Qwen3-Embedding: RoPE depends only on the
    distance between tokens) or on the right."""
    from transformers import AutoModel

    folder = zoo.build("qwen3", layout, tmp_path_factory.mktemp("zoo"))
    model = AutoModel.from_pretrained(str(folder)).eval()
    packed = PackedDecoder.from_folder(folder, torch.float32)
    assert (packed.heads, packed.kv_heads) == (4, 2)
    # last-token pooling, as the server pools: each input's <|endoftext|>
    assert_every_pass_gives(model, packed, token_lists(folder), LONG, "last")


WINDOWS: list[tuple[int, int]] = []
"""The windows reference_varlen was called with."""


def reference_varlen(
    q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1),
    enable_gqa=False,
):  # fmt: skip
    """torch's varlen_attn contract with a window (keys to the left, to the right of each
    query; -1: all) and grouped key/value heads: (tokens, heads, head) packed inputs, int32
    offsets; each input attends on its own."""
    assert enable_gqa
    assert cu_seq_q.dtype == torch.int32 and torch.equal(cu_seq_q, cu_seq_k)
    WINDOWS.append(window_size)
    bounds = cu_seq_q.tolist()
    assert max(b - a for a, b in itertools.pairwise(bounds)) <= max_q == max_k
    groups = q.shape[1] // k.shape[1]
    left, right = window_size
    out = torch.empty_like(q)
    for start, stop in itertools.pairwise(bounds):
        index = torch.arange(stop - start)
        ahead = index[None, :] - index[:, None]  # key - query
        allowed = torch.ones(len(index), len(index), dtype=torch.bool)
        if left >= 0:
            allowed &= -ahead <= left
        if right >= 0:
            allowed &= ahead <= right
        query = q[start:stop].transpose(0, 1)
        key, value = (t[start:stop].transpose(0, 1).repeat_interleave(groups, 0) for t in (k, v))
        out[start:stop] = F.scaled_dot_product_attention(
            query, key, value, attn_mask=allowed, scale=scale
        ).transpose(0, 1)
    return out


@pytest.mark.parametrize("model", ["qwen3", "gemma"])
def test_the_gpus_variable_length_pass_gives_the_cpus_states(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch, model: str
) -> None:
    """On a CUDA device in half precision both decoders attend with torch's variable-length
    flash attention on the packed tokens (grouped key/value heads; causal for Qwen3, both ways
    for Gemma, within the window on its sliding layers, with its score scale): with a
    reference implementation of its contract standing in for the kernel, that pass, at the
    planned rows with a padding row, gives the CPU pass's states and pooled vectors. A
    varlen_attn without windows (an older torch) is not used."""
    from warmgate_server.models import packing as packed_module

    root = tmp_path_factory.mktemp("zoo")
    if model == "qwen3":
        folder = zoo.build("qwen3", "current", root)
        lists, seq_len, windows = token_lists(folder), LONG, {(-1, 0)}
    else:
        folder = gemma(root / "gemma")
        lists, seq_len, windows = GEMMA_BATCH, 64, {(4, 4), (-1, -1)}
    # One linear kernel for both: each measures its own at load, and under load two
    # measurements can pick apart (the passes are compared here, not the kernels).
    padded_keys = PackedDecoder.from_folder(folder, torch.float32, linear_kernel="mkl")
    assert padded_keys.varlen is None  # on a CPU the padded-keys path is the real one
    monkeypatch.setattr(packed_module, "varlen_attention", lambda *_args: reference_varlen)
    varlen = PackedDecoder.from_folder(folder, torch.float32, linear_kernel="mkl")
    assert varlen.varlen is reference_varlen
    rows = len(lists) + 1  # one padding row
    WINDOWS.clear()
    with torch.inference_mode():
        for pooling in ("last", "mean", "none"):
            expected = pooled(padded_keys, lists, seq_len, rows, pooling)
            got = pooled(varlen, lists, seq_len, rows, pooling)
            torch.testing.assert_close(got, expected, **CLOSE)
    assert set(WINDOWS) == windows

    def older(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k):
        raise AssertionError("not called")

    monkeypatch.setattr(packed_module, "varlen_attention", lambda *_args: older)
    assert PackedDecoder.from_folder(folder, torch.float32).varlen is None


def test_attention_biases_and_a_causal_lm_checkpoint(tmp_path: Path) -> None:
    """A Qwen3 with attention biases (attention_bias: true), saved as Qwen3ForCausalLM (the
    base model's weights under `model.`, an `lm_head` no embedding reads), with config.json in
    transformers 5's form (rope_parameters) and in the hub's older one (rope_theta and
    rope_scaling, as Qwen3-Embedding's), loads into the packed pass and gives the states
    transformers' AutoModel gives for it; a RoPE base other than the file's would not."""
    import json

    from transformers import AutoModel, Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=300, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=6, num_key_value_heads=3, head_dim=8,
                         attention_bias=True, max_position_embeddings=64,
                         rope_parameters={"rope_type": "default", "rope_theta": 500.0})  # fmt: skip
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).eval().save_pretrained(tmp_path)
    batch = [[5, 17, 200, 3], list(range(10, 60)), [42]]
    for form in ("current", "hub"):
        if form == "hub":
            saved = json.loads((tmp_path / "config.json").read_text())
            del saved["rope_parameters"]
            saved.update(rope_theta=500.0, rope_scaling=None)
            (tmp_path / "config.json").write_text(json.dumps(saved))
        model = AutoModel.from_pretrained(str(tmp_path)).eval()
        packed = PackedDecoder.from_folder(tmp_path, torch.float32)
        other_base = PackedDecoder.from_folder(tmp_path, torch.float32)
        other_base.rope = {kind: other_base._rope(10000.0) for kind in other_base.rope}
        with torch.inference_mode():
            states, starts, lengths = packed.encode(batch, 64, 3)
            wrong, _, _ = other_base.encode(batch, 64, 3)
            want = expected_states(model, batch, "right")
        for row, (start, length) in enumerate(zip(starts, lengths, strict=True)):
            torch.testing.assert_close(states[start : start + length], want[row], **CLOSE)
        assert (wrong[starts[1] : starts[1] + lengths[1]] - want[1]).abs().max() > 1e-3, form


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 0},
         "sliding-window attention"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}},
         "RoPE type 'yarn' is not the default"),
        ({"rope_parameters": None, "rope_theta": 1e6,
          "rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "RoPE scaling"),
        ({"hidden_act": "gelu"}, "activation 'gelu' is not silu"),
        ({"layer_types": ["full_attention", "sliding_attention"]}, "layer types"),
    ],
)  # fmt: skip
def test_what_the_packed_pass_does_not_run_is_named(change: dict, why: str) -> None:
    """Configurations whose attention or rotation the packed pass does not compute are left to
    transformers' pass (packing auto) with the reason, never run approximately."""
    base = {"model_type": "qwen3", "hidden_size": 64, "num_attention_heads": 4,
            "num_hidden_layers": 2, "intermediate_size": 128,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}  # fmt: skip
    assert supports_config(base) is None
    assert supports_config({**base, "rope_parameters": None, "rope_theta": 1e6}) is None
    reason = supports_config({**base, **change})
    assert reason is not None and why in reason, reason


def gemma(folder: Path, **changes) -> Path:
    """A random bidirectional Gemma 3 (EmbeddingGemma's architecture) saved in `folder`: a
    sliding layer, a full one, a sliding one; the window 8 in config.json (transformers reads
    it as 5: keys at most 4 positions away); its norms away from zero (they scale by 1 + w)."""
    from transformers import Gemma3TextConfig, Gemma3TextModel

    settings = dict(vocab_size=300, hidden_size=48, intermediate_size=96, num_hidden_layers=3,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                    max_position_embeddings=128, sliding_window=8,
                    layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                    use_bidirectional_attention=True, query_pre_attn_scalar=24,
                    initializer_range=0.5)  # fmt: skip
    settings.update(changes)
    torch.manual_seed(0)
    model = Gemma3TextModel(Gemma3TextConfig(**settings)).eval()
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if "norm" in name:
                weight.normal_(0, 0.3)
    model.save_pretrained(folder)
    return folder


GEMMA_BATCH = [list(range(5, 5 + n)) for n in (3, 17, 9, 40, 1, 4)]


@pytest.mark.parametrize("form", ["current", "hub"])
def test_every_pass_gives_gemma3textmodels_states(tmp_path: Path, form: str) -> None:
    """EmbeddingGemma's layer: Gemma's (1 + w) RMSNorms before and after each sublayer, the
    scaled embeddings, query_pre_attn_scalar, GELU (tanh), attention both ways, and sliding
    layers that see only the keys within the window, each layer type with its own RoPE base.
    The packed pass (mixed lengths up to 40 tokens, eight times the window; one length; a lone
    input) and the static pass give transformers' states, padded on either side. `hub`: the
    config.json form the hub's EmbeddingGemma has (transformers 4.56: rope_theta and
    rope_local_base_freq, sliding_window_pattern rather than layer_types)."""
    import json

    from transformers import AutoModel

    folder = gemma(tmp_path / "gemma")
    if form == "hub":
        config = json.loads((folder / "config.json").read_text())
        del config["rope_parameters"], config["layer_types"]
        config.update(rope_theta=1_000_000.0, rope_local_base_freq=10_000.0,
                      rope_scaling=None, sliding_window_pattern=2)  # fmt: skip
        (folder / "config.json").write_text(json.dumps(config))
    model = AutoModel.from_pretrained(str(folder)).eval()
    packed = PackedDecoder.from_folder(folder, torch.float32)
    assert packed.kinds == ["sliding_attention", "full_attention", "sliding_attention"]
    assert packed.window == model.config.sliding_window == 5
    assert_every_pass_gives(model, packed, GEMMA_BATCH, 64, "mean")


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"use_bidirectional_attention": False}, "a causal Gemma 3"),
        ({"attn_logit_softcapping": 50.0}, "attention logit soft-capping"),
        ({"hidden_activation": "gelu"}, "activation 'gelu' is not gelu_pytorch_tanh"),
        ({"rope_parameters": {
            "full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}},
         "RoPE type 'linear' is not the default"),
    ],
)  # fmt: skip
def test_what_the_packed_pass_does_not_run_of_gemma_is_named(change: dict, why: str) -> None:
    """Gemma 3 configurations the packed pass does not compute (a causal one, soft-capped
    scores, another activation, scaled RoPE: Gemma 3's own 4B and up) are left to
    transformers' pass with the reason."""
    base = {"model_type": "gemma3_text", "hidden_size": 64, "num_attention_heads": 4,
            "num_hidden_layers": 6, "intermediate_size": 128, "sliding_window": 512,
            "hidden_activation": "gelu_pytorch_tanh", "use_bidirectional_attention": True,
            "query_pre_attn_scalar": 256, "attn_logit_softcapping": None}  # fmt: skip
    assert supports_config(base) is None
    reason = supports_config({**base, **change})
    assert reason is not None and why in reason, reason
