"""The model's module chain (head.py) on its own, without a model: every pooling mode, a
concatenation of two, a prompt left out of the pooling, and Dense and Normalize modules after
it, on random token states in both layouts the forward passes hand it (padded and packed),
against sentence-transformers' own Pooling, Dense and Normalize modules."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from warmgate_server.head import Head
from warmgate_server.model_folder import ST_MODES, DenseModule, NormalizeModule

HIDDEN = 16
LENGTHS = [5, 9, 3]
CPU = torch.device("cpu")
ST_NAME = {server: st for st, server in ST_MODES.items()}


def token_states() -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded (inputs, 9, HIDDEN) states, and their attention mask."""
    generator = torch.Generator().manual_seed(0)
    states = torch.randn(len(LENGTHS), max(LENGTHS), HIDDEN, generator=generator)
    mask = torch.zeros(len(LENGTHS), max(LENGTHS), dtype=torch.int64)
    for row, length in enumerate(LENGTHS):
        mask[row, :length] = 1
    return states, mask


def served(head: Head, states: torch.Tensor, mask: torch.Tensor, prompt: int) -> list[torch.Tensor]:
    """What the head makes of the states in the padded layout and in the packed one."""
    pool_mask = mask.clone()
    pool_mask[:, :prompt] = 0
    packed = torch.cat([states[row, :length] for row, length in enumerate(LENGTHS)])
    lengths = np.array(LENGTHS)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    pool_from = np.full(len(LENGTHS), prompt) if prompt else None
    return [head.padded(states, pool_mask), head.packed(packed, starts, lengths, pool_from)]


def sentence_transformers_pooling(modes: tuple[str, ...], prompt: int) -> torch.Tensor:
    from sentence_transformers.sentence_transformer.modules import Pooling

    states, mask = token_states()
    pooling = Pooling(HIDDEN, pooling_mode=[ST_NAME[mode] for mode in modes])
    features = {"token_embeddings": states, "attention_mask": mask}
    if prompt:
        pooling.include_prompt = False
        features["prompt_length"] = prompt
    return pooling(features)["sentence_embedding"]


@pytest.mark.parametrize("prompt", [0, 2])
@pytest.mark.parametrize("modes", [(mode,) for mode in ST_NAME] + [("cls", "mean")])
def test_pooling_equals_sentence_transformers(modes: tuple[str, ...], prompt: int) -> None:
    expected = sentence_transformers_pooling(modes, prompt)
    head = Head(modes, (), HIDDEN, CPU)
    for got in served(head, *token_states(), prompt):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def dense(folder: Path, name: str, weight: torch.Tensor, bias: torch.Tensor | None, activation):
    (folder / name).mkdir()
    state = {"linear.weight": weight} | ({} if bias is None else {"linear.bias": bias})
    save_file(state, str(folder / name / "model.safetensors"))
    out_features, in_features = weight.shape
    return DenseModule(
        name,
        in_features,
        out_features,
        bias is not None,
        f"torch.nn.modules.{activation}",
        weights=folder / name / "model.safetensors",
    )


def test_dense_and_normalize_modules_follow_the_pooling_in_order(tmp_path: Path) -> None:
    """cls+mean pooled (2 x 16 wide), a Dense to 8 with tanh, a Normalize, a Dense to 4
    without bias or activation: the chain of a model whose modules.json lists them so."""
    from sentence_transformers.sentence_transformer.modules import Dense, Normalize

    generator = torch.Generator().manual_seed(1)
    first_weight, first_bias = torch.randn(8, 2 * HIDDEN, generator=generator), torch.randn(8)
    second_weight = torch.randn(4, 8, generator=generator)
    steps = (
        dense(tmp_path, "2_Dense", first_weight, first_bias, "activation.Tanh"),
        NormalizeModule("3_Normalize"),
        dense(tmp_path, "4_Dense", second_weight, None, "linear.Identity"),
    )
    head = Head(("cls", "mean"), steps, HIDDEN, CPU)
    assert head.output_size == 4

    reference = [
        Dense(2 * HIDDEN, 8, init_weight=first_weight, init_bias=first_bias),
        Normalize(),
        Dense(8, 4, bias=False, activation_function=torch.nn.Identity(), init_weight=second_weight),
    ]
    features = {"sentence_embedding": sentence_transformers_pooling(("cls", "mean"), 0)}
    with torch.inference_mode():
        for module in reference:
            features = module(features)
    for got in served(head, *token_states(), prompt=0):
        torch.testing.assert_close(got, features["sentence_embedding"], atol=1e-5, rtol=1e-5)
