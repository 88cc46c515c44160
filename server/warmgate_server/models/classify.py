"""A sequence classifier's head on the padding-free pass (a cross-encoder: a re-ranker or a
classifier), as transformers computes it on the first token's state:

- BERT (`BertForSequenceClassification`): the pooler, tanh(pooler.dense(CLS)), then
  `classifier`;
- RoBERTa, XLM-R, CamemBERT (`RobertaForSequenceClassification`'s `RobertaClassificationHead`):
  `classifier.dense`, tanh, then `classifier.out_proj`.

Dropout is off at inference. Float32 out: the logits, before the folder's activation (ranking.py
applies it).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch
import torch.nn.functional as F

from .bert import PackedBert


class SequenceClassifier:
    """The classification head of a packed BERT-family encoder's checkpoint."""

    def __init__(self, encoder: PackedBert, model_type: str | None) -> None:
        head, pooler = encoder.task_head, encoder.pooler
        if model_type == "bert":
            self.layers = (
                _linear(pooler, "pooler.dense", "the pooler"),
                _linear(head, "classifier", "the classifier"),
            )
        elif model_type in ("roberta", "xlm-roberta", "camembert"):
            self.layers = (
                _linear(head, "classifier.dense", "the classification head"),
                _linear(head, "classifier.out_proj", "the classification head"),
            )
        else:
            raise ValueError(f"cannot run this model packed: a {model_type} classifier's head")
        expected = (
            {"classifier.weight", "classifier.bias"}
            if model_type == "bert"
            else {
                f"classifier.{name}.{kind}"
                for name in ("dense", "out_proj")
                for kind in ("weight", "bias")
            }
        )
        if set(head) != expected:
            raise ValueError(
                "cannot run this model packed: its classifier's weights are "
                f"{', '.join(sorted(head)) or 'none'}, not {', '.join(sorted(expected))}"
            )
        self.labels = int(self.layers[1][0].shape[0])

    def __call__(self, states: torch.Tensor, starts: np.ndarray) -> torch.Tensor:
        """(inputs, labels) logits from the packed states and each input's first token."""
        first = torch.from_numpy(np.ascontiguousarray(starts)).to(states.device)
        x = states[first].float()
        (w1, b1), (w2, b2) = self.layers
        return F.linear(torch.tanh(F.linear(x, w1, b1)), w2, b2)


def _linear(
    state: Mapping[str, torch.Tensor], prefix: str, what: str
) -> tuple[torch.Tensor, torch.Tensor]:
    weight, bias = state.get(prefix + ".weight"), state.get(prefix + ".bias")
    if weight is None or bias is None:
        raise ValueError(f"cannot run this model packed: the checkpoint lacks {what} ({prefix})")
    return weight.float(), bias.float()
