"""A sequence classifier's head on the padding-free pass (a cross-encoder: a re-ranker or a
classifier), as transformers computes it on the first token's state:

- BERT (`BertForSequenceClassification`): the pooler, tanh(pooler.dense(CLS)), then
  `classifier`;
- RoBERTa, XLM-R, CamemBERT (`RobertaForSequenceClassification`'s `RobertaClassificationHead`):
  `classifier.dense`, tanh, then `classifier.out_proj`;
- Qwen3 (`Qwen3ForSequenceClassification`: Qwen3-Reranker as its seq-cls
  conversion serves it, and TEI and vLLM too): `score` (no bias) of each input's last token
  that is not config.json's pad token, as transformers picks it.

Dropout is off at inference. Float32 out: the logits, before the folder's activation (ranking.py
applies it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from .bert import PackedBert
from .decoder import PackedDecoder


class SequenceClassifier:
    """The classification head of a packed encoder's checkpoint (BERT family, or a decoder's
    on its last token)."""

    def __init__(
        self,
        encoder: PackedBert | PackedDecoder,
        model_type: str | None,
        rows: torch.Tensor | None = None,
    ) -> None:
        """`rows`: a causal-LM re-ranker's score row (LogitScore's two LM-head rows'
        difference, loading.py), on its prompt's last token, in place of a `score` head."""
        self.last: int | None = None
        """Not None: the logits are the last token's (a decoder's), skipping this pad id
        (-1: none)."""
        if rows is not None:
            if not isinstance(encoder, PackedDecoder):
                raise ValueError("cannot run this model packed: LogitScore needs a decoder")
            self.layers = ((rows.float(), None),)
            self.last = -1  # the rendered prompt's own last token, whatever it is
            self.labels = 1
            return
        if isinstance(encoder, PackedDecoder):
            weight = encoder.task_head.get("score.weight")
            if set(encoder.task_head) != {"score.weight"} or weight is None:
                raise ValueError(
                    "cannot run this model packed: its classifier's weights are "
                    f"{', '.join(sorted(encoder.task_head)) or 'none'}, not score.weight"
                )
            self.layers = ((weight.float(), None),)
            self.last = encoder.pad_token_id if encoder.pad_token_id is not None else -1
            self.labels = int(weight.shape[0])
            return
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

    def __call__(
        self,
        states: torch.Tensor,
        starts: np.ndarray,
        batch: Sequence[Sequence[int]],
    ) -> torch.Tensor:
        """(inputs, labels) logits from the packed states: each input's first token's (BERT's
        family), or its last that is not the pad token (a decoder's)."""
        if self.last is not None:
            rows = [
                start + _last_not(tokens, self.last)
                for start, tokens in zip(starts.tolist(), batch, strict=True)
            ]
            index = torch.tensor(rows, dtype=torch.long, device=states.device)
            ((weight, _),) = self.layers
            return F.linear(states[index].float(), weight)
        first = torch.from_numpy(np.ascontiguousarray(starts)).to(states.device)
        x = states[first].float()
        (w1, b1), (w2, b2) = self.layers
        return F.linear(torch.tanh(F.linear(x, w1, b1)), w2, b2)


def _last_not(tokens: Sequence[int], pad: int) -> int:
    """The position of the last token that is not `pad` (0 where all are), as transformers'
    *ForSequenceClassification finds it on a right-padded row."""
    for position in range(len(tokens) - 1, -1, -1):
        if tokens[position] != pad:
            return position
    return 0


def _linear(
    state: Mapping[str, torch.Tensor], prefix: str, what: str
) -> tuple[torch.Tensor, torch.Tensor]:
    weight, bias = state.get(prefix + ".weight"), state.get(prefix + ".bias")
    if weight is None or bias is None:
        raise ValueError(f"cannot run this model packed: the checkpoint lacks {what} ({prefix})")
    return weight.float(), bias.float()
