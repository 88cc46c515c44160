"""Model folders as the hub has them, beyond the zoo's two layouts: every pooling mode in
both of its forms, checkpoints in every form (pytorch_model.bin, shards, a task head left in),
and the refusals a user meets, each read from /ready over HTTP with its message. The reference
is always sentence-transformers on the same folder."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from support.models import MIN_COSINE, cosine, embed, reference, serve

from warmgate_server import checkpoint
from warmgate_server.model_folder import LEGACY_FLAGS
from warmgate_testkit import zoo


@pytest.fixture(scope="module")
def zoo_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("zoo")


def copy_of(source: Path, target: Path) -> Path:
    shutil.copytree(source, target)
    return target


def relative_error(served: np.ndarray, expected: np.ndarray) -> float:
    """The largest |served - expected| / |expected| over the rows: direction and length."""
    errors = np.linalg.norm(served - expected, axis=1) / np.linalg.norm(expected, axis=1)
    return float(errors.max())


def pooled_with_the_mean(folder: Path) -> np.ndarray:
    """The folder's vectors pooled with the mean: what a server that fell back would serve."""
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(folder), device="cpu")
    model[1].pooling_mode = "mean"
    return model.encode(zoo.TEXTS)


POOLINGS = [
    pytest.param("max", id="max"),
    pytest.param("mean_sqrt_len_tokens", id="mean_sqrt_len_tokens"),
    pytest.param(["cls", "mean"], id="cls+mean"),
    pytest.param(["max", "lasttoken"], id="max+lasttoken"),
]


@pytest.mark.parametrize("packing", ["auto", "off"])
@pytest.mark.parametrize("form", ["compact", "flags"])
@pytest.mark.parametrize("mode", POOLINGS)
async def test_every_pooling_in_either_form_serves_sentence_transformers_vectors(
    aiohttp_client, zoo_root: Path, tmp_path: Path, mode, form: str, packing: str
) -> None:
    """`{"pooling_mode": "max"}`, a list of modes (their vectors concatenated in its order),
    or the older boolean flags for the same modes: the served vectors are
    sentence-transformers' own, direction and length (no Normalize module: mean_sqrt_len
    differs from the mean only in length), on both forward passes."""
    modes = [mode] if isinstance(mode, str) else mode
    folder = copy_of(zoo.build("bert-mean", "current", zoo_root), tmp_path / "model")
    modules = json.loads((folder / "modules.json").read_text())
    (folder / "modules.json").write_text(json.dumps(modules[:2]))
    config_file = folder / "1_Pooling" / "config.json"
    config = json.loads(config_file.read_text())
    if form == "compact":
        config["pooling_mode"] = mode
    else:
        dimension = config.pop("embedding_dimension")
        del config["pooling_mode"]
        config = {"word_embedding_dimension": dimension, **config}
        config.update({flag: name in modes for flag, name in LEGACY_FLAGS.items()})
    config_file.write_text(json.dumps(config))
    expected = reference(folder, zoo.TEXTS)
    assert expected.shape[1] == 64 * len(modes)
    if len(modes) == 1:
        assert relative_error(pooled_with_the_mean(folder), expected) > 0.01

    client, ready = await serve(aiohttp_client, folder, "--packing", packing)
    assert ready["phase"] == "ready", ready.get("error")
    served_as = "+".join("last" if name == "lasttoken" else name for name in modes)
    assert ready["model_settings"]["pooling"] == served_as
    assert ready["model_settings"]["normalize"] is False
    served = await embed(client, zoo.TEXTS)
    assert served.shape == expected.shape
    assert cosine(served, expected).min() >= MIN_COSINE
    assert relative_error(served, expected) < 1e-3


def _save_pickled_shards(folder: Path, shards: int) -> None:
    """The folder's model.safetensors rewritten as `shards` pytorch_model-*.bin files and
    their index, as transformers wrote big checkpoints before safetensors."""
    import torch
    from safetensors.torch import load_file

    state = load_file(str(folder / "model.safetensors"))
    (folder / "model.safetensors").unlink()
    keys = sorted(state)
    weight_map = {}
    for index in range(shards):
        name = f"pytorch_model-{index + 1:05d}-of-{shards:05d}.bin"
        part = {key: state[key] for key in keys[index::shards]}
        torch.save(part, folder / name)
        weight_map.update(dict.fromkeys(part, name))
    index_file = folder / "pytorch_model.bin.index.json"
    index_file.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def _save_safetensors_shards(folder: Path) -> None:
    from transformers import AutoModel

    model = AutoModel.from_pretrained(str(folder))
    (folder / "model.safetensors").unlink()
    model.save_pretrained(folder, max_shard_size="100KB")
    assert len(list(folder.glob("model-*.safetensors"))) > 1


def _save_with_task_head(folder: Path) -> None:
    """The checkpoint as its *ForMaskedLM model saves it: the base model's weights under its
    prefix (bert., roberta., distilbert., mpnet.) and an MLM head beside them (cls., lm_head.,
    vocab_transform. ...)."""
    from transformers import AutoModelForMaskedLM

    model = AutoModelForMaskedLM.from_pretrained(str(folder))
    (folder / "model.safetensors").unlink()
    model.save_pretrained(folder)


CHECKPOINTS = {
    "bin-shards": lambda folder: _save_pickled_shards(folder, 3),
    "safetensors-shards": _save_safetensors_shards,
    "mlm-head": _save_with_task_head,
}


@pytest.mark.parametrize("packing", ["auto", "off"])
@pytest.mark.parametrize("family", ["bert-cls-prompt", "xlm-roberta-cls", "distilbert", "mpnet"])
@pytest.mark.parametrize("form", list(CHECKPOINTS))
async def test_checkpoints_in_every_form_run_the_same_pass_and_vectors(
    aiohttp_client, zoo_root: Path, tmp_path: Path, form: str, family: str, packing: str
) -> None:
    """A checkpoint sharded (safetensors or pytorch_model.bin) or saved with its MLM head
    serves sentence-transformers' vectors, and a BERT-family one still runs the padding-free
    pass (a folder without model.safetensors used to fall back to the padded one)."""
    source = zoo.build(family, "current", zoo_root)
    expected = reference(source, zoo.TEXTS)
    folder = copy_of(source, tmp_path / "model")
    CHECKPOINTS[form](folder)
    keys = checkpoint.keys(folder)
    if form == "mlm-head":
        heads = ("cls.", "lm_head.", "vocab_transform.")
        assert any(key.startswith(heads) for key in keys), sorted(keys)
    else:
        assert not (folder / "model.safetensors").exists() and len(checkpoint.files(folder)) > 1
    assert cosine(reference(folder, zoo.TEXTS), expected).min() >= MIN_COSINE

    client, ready = await serve(aiohttp_client, folder, "--packing", packing)
    assert ready["phase"] == "ready", ready.get("error")
    assert ready["forward"]["pass"] == ("packed" if packing == "auto" else "padded")
    assert cosine(await embed(client, zoo.TEXTS), expected).min() >= MIN_COSINE


def _refused(ready: dict) -> str:
    assert ready["phase"] == "failed", ready
    assert ready["warmed_shapes"] == []
    return ready["error"]


async def test_a_custom_sentence_transformers_module_is_refused_even_with_trust_remote_code(
    aiohttp_client, zoo_root: Path, tmp_path: Path
) -> None:
    """modules.json types are matched by their full path: jina-embeddings-v3's
    `custom_st.Transformer` is not sentence-transformers' Transformer, and warmgate runs no
    sentence-transformers module of a folder's own, trusted or not."""
    folder = copy_of(zoo.build("bert-mean", "current", zoo_root), tmp_path / "model")
    modules = json.loads((folder / "modules.json").read_text())
    modules[0]["type"] = "custom_st.Transformer"
    (folder / "modules.json").write_text(json.dumps(modules))
    for flags in ((), ("--trust-remote-code",)):
        _client, ready = await serve(aiohttp_client, folder, *flags)
        error = _refused(ready)
        assert "modules.json lists 'custom_st.Transformer' (the root)" in error, error
        assert "Transformer, Pooling, Dense and Normalize modules only" in error, error


async def test_a_tokenizer_of_the_folders_own_code_needs_trust_remote_code(
    aiohttp_client, zoo_root: Path
) -> None:
    """tokenizer_config.json's auto_map names a tokenizer class in the folder: refused with
    the entry and the field; with the field, that code tokenizes (its vectors are not the
    plain tokenizer's) and the vectors are sentence-transformers' with trust_remote_code."""
    folder = zoo.build_custom_tokenizer(zoo_root)
    _client, refused = await serve(aiohttp_client, folder)
    error = _refused(refused)
    assert "tokenizer_config.json auto_map AutoTokenizer" in error, error
    assert "tokenization_tiny.TinyTokenizer" in error, error
    assert "spec.model.trustRemoteCode" in error, error
    _client, refused = await serve(aiohttp_client, folder, "--no-trust-remote-code")
    error = _refused(refused)
    assert "is false, but transformers' own class for it cannot serve it" in error, error
    assert "the tokenizer is the folder's own code" in error, error

    expected = reference(folder, zoo.TEXTS, trust_remote_code=True)
    plain = reference(zoo.build("bert-mean", "current", zoo_root), zoo.TEXTS)
    assert cosine(expected, plain).min() < 0.999  # the custom tokenizer changes the vectors
    client, ready = await serve(aiohttp_client, folder, "--trust-remote-code")
    assert ready["phase"] == "ready", ready.get("error")
    assert cosine(await embed(client, zoo.TEXTS), expected).min() >= MIN_COSINE


SWISH = """
import torch


class Swish(torch.nn.Module):
    def forward(self, x):
        return x * torch.sigmoid(1.5 * x)
"""


@pytest.mark.parametrize("activation", ["torch.nn.modules.activation.Tanh", "tiny_act.Swish"])
async def test_a_dense_activation_outside_torch_is_custom_code(
    aiohttp_client, zoo_root: Path, tmp_path: Path, monkeypatch, activation: str
) -> None:
    """A Dense module's activation is imported by its path, as sentence-transformers imports
    it: torch's own serve as they are; one outside torch is code the folder brings, refused
    without the field and served with it."""
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "tiny_act.py").write_text(SWISH)
    folder = copy_of(zoo.build("gemma3-dense", "current", zoo_root), tmp_path / "model")
    dense_config = folder / "2_Dense" / "config.json"
    config = json.loads(dense_config.read_text())
    config["activation_function"] = activation
    dense_config.write_text(json.dumps(config))
    expected = reference(folder, zoo.TEXTS, trust_remote_code=True)
    unchanged = reference(zoo.build("gemma3-dense", "current", zoo_root), zoo.TEXTS)
    assert cosine(expected, unchanged).min() < 0.999  # the activation is in the vectors

    if not activation.startswith("torch."):
        _client, refused = await serve(aiohttp_client, folder)
        error = _refused(refused)
        assert f"activation_function '{activation}' is custom code" in error, error
        assert "spec.model.trustRemoteCode" in error, error
    flags = () if activation.startswith("torch.") else ("--trust-remote-code",)
    client, ready = await serve(aiohttp_client, folder, *flags)
    assert ready["phase"] == "ready", ready.get("error")
    assert "Dense 64->256" in ready["model_settings"]["modules"][0]
    assert cosine(await embed(client, zoo.TEXTS), expected).min() >= MIN_COSINE


async def test_a_dense_module_whose_weights_do_not_fit_it_is_refused_with_their_names(
    aiohttp_client, zoo_root: Path, tmp_path: Path
) -> None:
    """A Dense module is loaded exactly or not at all, as the encoder is: a weight missing
    or left unused, or a matrix of another shape than its config.json says, is refused with
    the module's folder and the names, never served with random or dropped weights."""
    from safetensors.torch import load_file, save_file

    source = zoo.build("gemma3-dense", "current", zoo_root)
    state = load_file(str(source / "2_Dense" / "model.safetensors"))
    assert set(state) == {"linear.weight", "linear.bias"}
    cases = {
        "missing": ({"linear.weight": state["linear.weight"]}, {},
                    "2_Dense: weights missing (linear.bias) or unused (none)"),
        "unused": ({**state, "extra.weight": state["linear.bias"]}, {},
                   "2_Dense: weights missing (none) or unused (extra.weight)"),
        "shape": (state, {"out_features": 128},
                  "2_Dense: linear.weight is (256, 64), not (128, 64) as its config.json says"),
    }  # fmt: skip
    for name, (weights, config_change, expected) in cases.items():
        folder = copy_of(source, tmp_path / name)
        save_file({key: value.clone() for key, value in weights.items()},
                  str(folder / "2_Dense" / "model.safetensors"))  # fmt: skip
        config_file = folder / "2_Dense" / "config.json"
        config_file.write_text(json.dumps({**json.loads(config_file.read_text()), **config_change}))
        _client, ready = await serve(aiohttp_client, folder)
        error = _refused(ready)
        assert expected in error, (name, error)


async def test_custom_code_is_a_decision_unset_refuses_naming_both_choices_false_serves_builtin(
    aiohttp_client, zoo_root: Path, tmp_path: Path
) -> None:
    """config.json names custom code (auto_map) and a model type transformers ships whose
    class loads every weight of the checkpoint. Unset, the folder is refused with a message
    that names both choices (the issue's case: a subclass with the same weights was served as
    transformers' class without asking, and its own code's vectors differed); with
    --no-trust-remote-code that class serves it, as sentence-transformers without
    trust_remote_code loads it."""
    folder = copy_of(zoo.build("bert-mean", "current", zoo_root), tmp_path / "model")
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = {"AutoModel": "modeling_missing.NotShipped"}
    (folder / "config.json").write_text(json.dumps(config))
    _client, ready = await serve(aiohttp_client, folder)
    error = _refused(ready)
    assert "config.json auto_map AutoModel: modeling_missing.NotShipped" in error, error
    assert "spec.model.trustRemoteCode (--trust-remote-code) is unset" in error, error
    assert "true runs the model's own Python code" in error, error
    assert "false serves transformers' own class for its model type (bert)" in error, error
    assert "vectors may differ" in error, error
    expected = reference(folder, zoo.TEXTS)
    client, ready = await serve(aiohttp_client, folder, "--no-trust-remote-code")
    assert ready["phase"] == "ready", ready.get("error")
    assert ready["forward"]["pass"] == "padded"  # transformers' own BertModel
    assert cosine(await embed(client, zoo.TEXTS), expected).min() >= MIN_COSINE


async def test_custom_code_on_a_decoder_is_asked_and_false_serves_the_builtin_decoder(
    aiohttp_client, zoo_root: Path, tmp_path: Path, caplog
) -> None:
    """A decoder's checkpoint that transformers' own class loads exactly may still be
    served differently by it: gte-Qwen2's own code attends both ways, Qwen2Model causally,
    with the same weights. Unset, it is refused, asking; false serves the built-in decoder
    and the log says it attends causally where the author's code may not."""
    import logging

    folder = copy_of(zoo.build("qwen3", "current", zoo_root), tmp_path / "model")
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = {"AutoModel": "modeling_qwen.Qwen2Model"}
    (folder / "config.json").write_text(json.dumps(config))
    _client, ready = await serve(aiohttp_client, folder)
    error = _refused(ready)
    assert "config.json auto_map AutoModel: modeling_qwen.Qwen2Model" in error, error
    assert "is unset: decide" in error, error
    with caplog.at_level(logging.WARNING, logger="warmgate_server.loading"):
        _client, ready = await serve(aiohttp_client, folder, "--no-trust-remote-code")
    assert ready["phase"] == "ready", ready.get("error")
    warned = [r.getMessage() for r in caplog.records if "names custom code" in r.getMessage()]
    assert warned and "Qwen3Model" in warned[0] and "attends causally" in warned[0], warned


async def test_a_transformer_loaded_other_than_from_the_folders_root_is_refused(
    aiohttp_client, zoo_root: Path, tmp_path: Path
) -> None:
    """sentence-transformers can load its Transformer from a subfolder or with load
    arguments (model_args, tokenizer_args) that change the model or its tokenizer: warmgate
    applies neither, so it refuses them by name instead of serving the folder's root as is."""
    source = zoo.build("bert-mean", "current", zoo_root)
    folder = copy_of(source, tmp_path / "subfolder")
    modules = json.loads((folder / "modules.json").read_text())
    modules[0]["path"] = "0_Transformer"
    (folder / "modules.json").write_text(json.dumps(modules))
    _client, ready = await serve(aiohttp_client, folder)
    error = _refused(ready)
    assert "modules.json puts the Transformer in '0_Transformer'" in error, error

    folder = copy_of(source, tmp_path / "args")
    st_config = json.loads((folder / "sentence_bert_config.json").read_text())
    st_config["tokenizer_args"] = {"do_lower_case": False}
    (folder / "sentence_bert_config.json").write_text(json.dumps(st_config))
    _client, ready = await serve(aiohttp_client, folder)
    error = _refused(ready)
    assert "sentence_bert_config.json sets tokenizer_args" in error, error
    assert "this server does not apply it" in error, error
