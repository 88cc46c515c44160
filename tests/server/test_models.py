"""The model families people deploy, served right: a tiny model of each family
(testkit/warmgate_testkit/zoo.py: real config, model and tokenizer classes, random weights, a
tokenizer trained on a multilingual corpus), in both sentence-transformers layouts, served over
HTTP and compared with `SentenceTransformer(folder).encode` on English, Korean, Japanese, emoji,
mixed and long (truncated) texts. BERT and the RoBERTa family run both forward passes (padding-
free and transformers'); the others run transformers'. docs/models.md lists what each row
proves."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from support.models import (
    MIN_COSINE,
    build_telling_texts_apart,
    closest_pair,
    cosine,
    embed,
    reference,
    serve,
)
from support.server import QUICK_SETTLE

from warmgate_server.app import create_app
from warmgate_server.config import parse_config
from warmgate_testkit import zoo
from warmgate_testkit.process import wait_for_phase

SERVER_POOLING = {"lasttoken": "last"}


@pytest.fixture(scope="module")
def zoo_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("zoo")


def wrong_pooling(folder: Path, family: zoo.Family) -> np.ndarray:
    """sentence-transformers' vectors of the folder pooled as it does not say: with the
    prompt's tokens when it leaves them out, else cls for a mean model and mean otherwise."""
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(folder), device="cpu")
    pooling = model[1]
    if not family.include_prompt:
        pooling.include_prompt = True
    else:
        pooling.pooling_mode = "cls" if family.pooling != "cls" else "mean"
    return model.encode(zoo.TEXTS, convert_to_numpy=True)


ONNX_REFUSED = {"gemma3-dense": "Gemma3TextModel does not export to ONNX"}
"""Families torch's ONNX exporter cannot export: --backend onnxruntime refuses them."""


def _cases() -> list:
    """(family, layout, mode): mode is --packing auto or off, or "onnxruntime" (--backend
    onnxruntime, on the current layout only: the backend runs what the loader read)."""
    cases = []
    for name, family in zoo.FAMILIES.items():
        for layout in zoo.LAYOUTS:
            for packing in ("auto", "off") if family.packed else ("auto",):
                cases.append(pytest.param(name, layout, packing, id=f"{name}-{layout}-{packing}"))
        if name not in ONNX_REFUSED:
            cases.append(pytest.param(name, "current", "onnxruntime", id=f"{name}-onnxruntime"))
    return cases


@pytest.mark.parametrize(("name", "layout", "packing"), _cases())
async def test_each_family_serves_sentence_transformers_vectors(
    aiohttp_client, zoo_root: Path, report, name: str, layout: str, packing: str
) -> None:
    family = zoo.FAMILIES[name]
    # The comparison can fail: the texts' vectors are not alike, and a server that pooled
    # another way (or kept the prompt in the pooling) would be far from the reference.
    folder, expected = build_telling_texts_apart(name, layout, zoo_root)
    worst_wrong = cosine(wrong_pooling(folder, family), expected).min()
    assert worst_wrong < 0.999, f"{name}: another pooling gives the same vectors"

    flags = ("--backend", packing) if packing == "onnxruntime" else ("--packing", packing)
    client, ready = await serve(aiohttp_client, folder, *flags)
    assert ready["phase"] == "ready", ready.get("error")
    settings = ready["model_settings"]
    modes = (family.pooling,) if isinstance(family.pooling, str) else family.pooling
    assert settings["pooling"] == "+".join(SERVER_POOLING.get(m, m) for m in modes)
    assert settings["chosen_by"]["pooling"] == "1_Pooling/config.json"
    assert settings["normalize"] is family.normalize
    assert len(settings["modules"]) == len(family.dense)
    forward = ready["forward"]["pass"]
    assert forward == ("packed" if family.packed and packing == "auto" else "padded")
    backend = ready["forward"]["backend"]
    assert backend == ("onnxruntime" if packing == "onnxruntime" else "torch")
    if backend == "onnxruntime":
        forward = "onnxruntime"

    served = await embed(client, zoo.TEXTS)
    assert served.shape == expected.shape
    worst = cosine(served, expected)
    report(
        f"{name} {layout} {forward}: min cosine {worst.min():.7f} "
        f"(another pooling's: {worst_wrong:.4f}; texts' closest pair {closest_pair(expected):.4f})"
    )
    assert worst.min() >= MIN_COSINE, dict(zip(zoo.TEXTS, worst.round(6), strict=True))
    if family.normalize:
        np.testing.assert_allclose(np.linalg.norm(served, axis=1), 1.0, atol=1e-4)
    for prompt_name in sorted(family.prompts):
        got = await embed(client, zoo.TEXTS[:4], prompt_name)
        want = reference(folder, zoo.TEXTS[:4], prompt_name)
        assert cosine(got, want).min() >= MIN_COSINE, prompt_name


async def test_gemma_in_float16_is_refused_and_auto_takes_bfloat16_on_a_gpu(
    aiohttp_client, zoo_root: Path
) -> None:
    """Gemma 3's activations overflow float16 (EmbeddingGemma's model card: bfloat16 or
    float32): `--dtype float16` fails the load with the way out, so the pod never serves
    vectors of infinities; `auto` takes bfloat16 for it on a GPU, float16 for the others."""
    import torch

    from warmgate_server.loading import _pick_dtype

    folder = zoo.build("gemma3-dense", "current", zoo_root)
    _client, ready = await serve(aiohttp_client, folder, "--dtype", "float16")
    assert ready["phase"] == "failed"
    assert "overflow float16" in ready["error"], ready["error"]
    assert "use --dtype bfloat16 or float32" in ready["error"], ready["error"]
    gpu, cpu = torch.device("cuda"), torch.device("cpu")
    assert _pick_dtype("auto", gpu, "gemma3_text") == torch.bfloat16
    assert _pick_dtype("auto", gpu, "qwen3") == torch.float16
    assert _pick_dtype("auto", cpu, "gemma3_text") == torch.float32


async def test_onnxruntime_refuses_a_model_it_cannot_export(aiohttp_client, zoo_root: Path) -> None:
    """--backend onnxruntime exports the model during warmup; a model torch's exporter cannot
    export fails the warmup with the exporter's reason and the way out (--backend torch), so
    the pod never turns Ready."""
    folder = zoo.build("gemma3-dense", "current", zoo_root)
    _client, ready = await serve(aiohttp_client, folder, "--backend", "onnxruntime")
    assert ready["phase"] == "failed"
    assert ONNX_REFUSED["gemma3-dense"] in ready["error"], ready["error"]
    assert "use --backend torch" in ready["error"], ready["error"]
    assert ready["warmed_shapes"] == []


async def test_onnxruntime_serves_through_onnx_runtime_with_the_warmup_off(
    aiohttp_client, zoo_root: Path
) -> None:
    """With --no-warmup there is no warmup to export in: the export still happens before
    /ready, so the backend that serves is the one /ready names."""
    folder, expected = build_telling_texts_apart("xlm-roberta-mean", "current", zoo_root)
    flags = ("--backend", "onnxruntime", "--no-warmup")
    client, ready = await serve(aiohttp_client, folder, *flags)
    assert ready["phase"] == "ready", ready.get("error")
    assert ready["forward"]["onnxruntime"]["session_threads"], ready["forward"]
    assert cosine(await embed(client, zoo.TEXTS), expected).min() >= MIN_COSINE


@pytest.mark.parametrize("builtin_type", [None, "bert"])
async def test_custom_code_is_refused_without_trust_remote_code_and_served_with_it(
    aiohttp_client, zoo_root: Path, builtin_type: str | None
) -> None:
    """A folder whose config.json points at its own modeling code (auto_map) is refused with a
    message naming spec.model.trustRemoteCode while the field is unset; set to false, it is
    refused too when its model_type names a class transformers ships (as
    jina-embeddings-v2's says bert) that cannot hold its weights (that class would load with
    random weights), naming the missing weights. With the field true, the folder's own code
    serves sentence-transformers' (trust_remote_code=True) vectors."""
    from sentence_transformers import SentenceTransformer

    folder = zoo.build_custom_code(zoo_root, builtin_type)
    _client, refused = await serve(aiohttp_client, folder)
    assert refused["phase"] == "failed"
    error = refused["error"]
    assert "spec.model.trustRemoteCode" in error and "--trust-remote-code" in error, error
    assert "config.json auto_map AutoModel: modeling_tiny.TinyEmbedderModel" in error, error
    assert "is unset: decide" in error, error
    _client, refused = await serve(aiohttp_client, folder, "--no-trust-remote-code")
    assert refused["phase"] == "failed"
    error = refused["error"]
    assert "transformers' own class for it cannot serve it" in error, error
    if builtin_type is not None:
        assert "missing" in error, error

    client, ready = await serve(aiohttp_client, folder, "--trust-remote-code")
    assert ready["phase"] == "ready", ready.get("error")
    assert ready["forward"]["pass"] == "padded"
    expected = SentenceTransformer(str(folder), device="cpu", trust_remote_code=True).encode(
        zoo.TEXTS
    )
    assert cosine(await embed(client, zoo.TEXTS), expected).min() >= MIN_COSINE


@pytest.mark.parametrize("packing", ["auto", "off"])
@pytest.mark.parametrize(
    ("name", "key", "extra"),
    [
        ("xlm-roberta-mean", "encoder.layer.1.attention.self.value.weight",
         "encoder.layer.7.output.dense.weight"),
        ("distilbert", "transformer.layer.1.attention.v_lin.weight",
         "transformer.layer.7.ffn.lin2.weight"),
        ("mpnet", "encoder.relative_attention_bias.weight",
         "encoder.layer.7.attention.attn.q.weight"),
        ("qwen3", "layers.1.self_attn.k_norm.weight", "layers.7.mlp.down_proj.weight"),
        ("gemma3-dense", "layers.1.pre_feedforward_layernorm.weight",
         "layers.7.mlp.up_proj.weight"),
    ],
)  # fmt: skip
async def test_weights_missing_or_unused_fail_the_load_with_their_names(
    aiohttp_client, zoo_root: Path, tmp_path: Path, packing: str, name: str, key: str, extra: str
) -> None:
    """A checkpoint that lacks a weight (it would be random) or holds one the architecture
    has no place for (another architecture's) fails to load, on both forward passes, with
    the key's name as the checkpoint names it (DistilBERT's and MPNet's own names, though the
    packed pass reads them as BERT's; MPNet's relative position bias among them; a Qwen3
    layer's key norm, a Gemma layer's norm before its MLP); /ready says failed, so the pod
    never turns Ready."""
    import shutil

    from safetensors.torch import load_file, save_file

    source = zoo.build(name, "current", zoo_root)
    for change, expected in (("drop", f"missing {key}"), ("add", extra)):
        folder = tmp_path / change
        shutil.copytree(source, folder)
        state = load_file(str(folder / "model.safetensors"))
        if change == "drop":
            del state[key]
        else:
            state[extra] = state[key].clone()
        save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
        _client, ready = await serve(aiohttp_client, folder, "--packing", packing)
        assert ready["phase"] == "failed", (change, packing)
        # What serving it would have done: random weights where one is missing, none random
        # where one is left over.
        outcome = "would be random" if change == "drop" else "would not be the model's"
        assert outcome in ready["error"], ready["error"]
        assert "random" not in ready["error"] or change == "drop", ready["error"]
        if packing == "off" or change == "add":
            assert expected in ready["error"], ready["error"]
        else:
            assert key in ready["error"], ready["error"]


@pytest.mark.parametrize(
    ("name", "limit"),
    [("xlm-roberta-cls", 64), ("camembert", 64), ("roberta-bpe", 128),
     ("roberta-wordpiece", 128), ("mpnet", 128), ("distilbert", 128)],
)  # fmt: skip
async def test_a_limit_from_the_position_embeddings_holds_with_their_offset(
    aiohttp_client, zoo_root: Path, tmp_path: Path, name: str, limit: int
) -> None:
    """XLM-R's position ids start at pad_token_id + 1: a model of 66 position embeddings and
    no other stated limit holds 64 tokens. An input of exactly 64 runs on both forward passes;
    65 is refused with a 4xx, or cut to 64 when truncating (it used to be an IndexError).
    CamemBERT, RoBERTa (both tokenizers) and MPNet count their positions the same way (130
    position embeddings hold 128 tokens); DistilBERT's start at 0, as BERT's (128 hold
    128)."""
    import shutil

    from transformers import AutoTokenizer

    folder = tmp_path / name
    shutil.copytree(zoo.build(name, "current", zoo_root), folder)
    tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    tokenizer_config.pop("model_max_length", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    ids = tokenizer(zoo.TEXTS[-1])["input_ids"]
    assert len(ids) > limit + 6
    exact = [*ids[: limit - 1], ids[-1]]  # <s>, limit - 2 tokens of text, </s>
    over = [*ids[:limit], ids[-1]]
    from sentence_transformers import SentenceTransformer

    reference_model = SentenceTransformer(str(folder), device="cpu")
    reference_model.max_seq_length = limit
    expected = reference_model.encode(zoo.TEXTS[-1:])
    buckets = ["--sequence-buckets", "16,32,64,128", "--warmup-batch-sizes", "1,2"]
    for packing in ("auto", "off"):
        # The OpenAI route takes the model's own ids here (the ids of exactly `limit` tokens).
        argv = [
            "--model", str(folder), "--device", "cpu", "--packing", packing,
            "--openai-token-ids", "model", *buckets,
        ]  # fmt: skip
        app = create_app(parse_config(argv, environ={}), settle_rule=QUICK_SETTLE)
        client = await aiohttp_client(app)
        ready = await wait_for_phase(client, {"ready", "failed"})
        assert ready["phase"] == "ready", ready.get("error")
        settings = ready["model_settings"]
        assert settings["max_input_length"] == limit
        assert "max_position_embeddings" in settings["chosen_by"]["max_input_length"]
        fits = await client.post("/v1/embeddings", json={"input": [exact]})
        assert fits.status == 200, await fits.text()
        too_long = await client.post("/v1/embeddings", json={"input": [over]})
        assert 400 <= too_long.status < 500
        assert f"above the limit of {limit}" in (await too_long.json())["error"]["message"]
        cut = await client.post("/embed", json={"inputs": zoo.TEXTS[-1], "truncate": True})
        assert cut.status == 200, await cut.text()
        # Cut to the limit, the text is `exact`; both are sentence-transformers' vector of the
        # text at max_seq_length `limit`.
        at_limit = np.array([(await fits.json())["data"][0]["embedding"]])
        assert cosine(np.array(await cut.json()), at_limit).min() >= MIN_COSINE
        assert cosine(at_limit, expected).min() >= MIN_COSINE
        refused = await client.post("/embed", json={"inputs": zoo.TEXTS[-1]})
        assert 400 <= refused.status < 500


@pytest.mark.slow
@pytest.mark.parametrize("name", list(zoo.FAMILIES))
def test_a_real_server_process_serves_each_family_to_the_openai_sdk(
    zoo_root: Path, name: str
) -> None:
    """`python -m warmgate_server` on the family's folder in the older hub layout (weights in
    pytorch_model.bin), asked by the OpenAI SDK at its defaults (a pooled client, base64
    vectors): sentence-transformers' vectors, the same pass as in-process."""
    from openai import OpenAI

    from warmgate_testkit.process import ServerProcess

    family = zoo.FAMILIES[name]
    folder, expected = build_telling_texts_apart(name, "hub", zoo_root)
    args = ["--model", str(folder), "--served-model-name", name, "--device", "cpu"]
    args += ["--sequence-buckets", "16,32,64", "--warmup-batch-sizes", "1,8", "--auto-truncate"]
    with ServerProcess(args) as server:
        ready = server.wait_ready(300)
        assert ready["forward"]["pass"] == ("packed" if family.packed else "padded")
        client = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        answer = client.embeddings.create(model=name, input=zoo.TEXTS)
        client.close()
    served = np.array([item.embedding for item in answer.data], dtype=np.float32)
    assert cosine(served, expected).min() >= MIN_COSINE


async def test_an_extra_tensor_inside_a_layer_is_named_on_the_packed_pass(
    aiohttp_client, zoo_root: Path, tmp_path: Path
) -> None:
    """A tensor the architecture has no place for, inside one of its own layers: the packed
    pass names it (it counted the layer's weights and said only how many there were)."""
    import shutil

    from safetensors.torch import load_file, save_file

    folder = tmp_path / "extra"
    shutil.copytree(zoo.build("xlm-roberta-mean", "current", zoo_root), folder)
    state = load_file(str(folder / "model.safetensors"))
    key = next(k for k in state if k.endswith("layer.0.attention.self.value.weight"))
    extra = key.replace("attention.self.value.weight", "attention.self.gate.weight")
    state[extra] = state[key].clone()
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    _client, ready = await serve(aiohttp_client, folder)
    assert ready["phase"] == "failed"
    error = ready["error"]
    assert "does not use" in error and "attention.self.gate.weight" in error, error
    assert "padding-free pass" in error and "would not be the model's" in error, error
