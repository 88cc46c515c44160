"""The model's module chain after the transformer: pooling, then Dense and Normalize modules in
modules.json order, computed as sentence-transformers computes them (its Pooling and Dense
modules are the reference the tests compare with).

Two layouts of the same token states reach it:
- padded: (rows, seq_len, hidden) with a 0/1 mask, right-padded (transformers' forward pass, a
  CUDA graph's static batch; no host synchronisation, so a graph can capture it);
- packed: (tokens, hidden), the inputs' tokens one after another (warmgate's padding-free pass).

A pooling mask leaves out the tokens before `pool_from` of each input: the prompt of a model
whose Pooling says include_prompt: false. As in sentence-transformers, cls then takes the first
token after the prompt and weightedmean keeps the remaining tokens' position weights.

The final Normalize is not here: it is the request's `normalize` (TEI's field), on by default
when modules.json ends with one.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from .model_folder import DenseModule, ModelConfigError, NormalizeModule, Step


class _Dense:
    def __init__(self, module: DenseModule, device: torch.device) -> None:
        state = _load_state(module)
        expected = {"linear.weight"} | ({"linear.bias"} if module.bias else set())
        if module.residual and module.in_features != module.out_features:
            expected.add("residual.weight")
        missing, unused = sorted(expected - set(state)), sorted(set(state) - expected)
        if missing or unused:
            raise ModelConfigError(
                f"{module.path}: weights missing ({', '.join(missing) or 'none'}) or unused "
                f"({', '.join(unused) or 'none'}): the Dense module cannot be loaded exactly"
            )
        weight = state["linear.weight"]
        if tuple(weight.shape) != (module.out_features, module.in_features):
            raise ModelConfigError(
                f"{module.path}: linear.weight is {tuple(weight.shape)}, not "
                f"({module.out_features}, {module.in_features}) as its config.json says"
            )
        self.module = module
        self.weight = weight.float().to(device)
        self.bias = state["linear.bias"].float().to(device) if module.bias else None
        residual = state.get("residual.weight")
        self.residual = None if residual is None else residual.float().to(device)
        self.activation = _activation(module.activation)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = self.activation(F.linear(x, self.weight, self.bias))
        if self.module.residual:
            out = out + (x if self.residual is None else F.linear(x, self.residual))
        return out


def _load_state(module: DenseModule) -> dict[str, torch.Tensor]:
    assert module.weights is not None
    if module.weights.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(module.weights))
    state = torch.load(module.weights, map_location="cpu", weights_only=True)
    if not isinstance(state, dict):
        raise ModelConfigError(f"{module.weights} holds no state dict")
    return state


def _activation(path: str) -> torch.nn.Module:
    """An activation module by its import path, as sentence-transformers' Dense imports it (a
    path outside torch is custom code: model_folder.py refuses it without --trust-remote-code)."""
    module_path, _, name = path.rpartition(".")
    try:
        found = getattr(importlib.import_module(module_path), name)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ModelConfigError(f"activation_function {path!r} cannot be imported: {exc}") from None
    if not (isinstance(found, type) and issubclass(found, torch.nn.Module)):
        raise ModelConfigError(f"activation_function {path!r} is not a torch.nn.Module class")
    return found()


class Head:
    """Pooling `modes` over the token states, then `steps`; float32 out, on the states' device."""

    def __init__(
        self, modes: Sequence[str], steps: Sequence[Step], hidden: int, device: torch.device
    ) -> None:
        self.modes = tuple(modes)
        self.steps = tuple(steps)
        self.hidden = hidden
        width = hidden * len(self.modes)
        self._steps: list[_Dense | None] = []  # None: a Normalize
        for step in steps:
            if isinstance(step, NormalizeModule):
                self._steps.append(None)
                continue
            if step.in_features != width:
                raise ModelConfigError(
                    f"{step.path}: in_features {step.in_features}, but the pooling "
                    f"({'+'.join(self.modes)} of {hidden}) gives {width}"
                )
            self._steps.append(_Dense(step, device))
            width = step.out_features
        self.output_size = width

    def finish(self, pooled: torch.Tensor) -> torch.Tensor:
        for dense in self._steps:
            pooled = F.normalize(pooled, p=2, dim=-1) if dense is None else dense(pooled)
        return pooled

    def padded(self, states: torch.Tensor, pool_mask: torch.Tensor) -> torch.Tensor:
        """(rows, output) from right-padded (rows, seq_len, hidden) states and the 0/1 mask of
        the tokens to pool. No host synchronisation."""
        x = states.float()
        mask = pool_mask.to(x.dtype).unsqueeze(-1)
        rows, seq_len = pool_mask.shape
        arange = torch.arange(seq_len, device=x.device)
        out = []
        counts = mask.sum(dim=1)
        for mode in self.modes:
            if mode == "cls":
                first = pool_mask.to(torch.int32).argmax(dim=1)
                out.append(x[torch.arange(rows, device=x.device), first])
            elif mode == "last":
                flipped = pool_mask.to(torch.int32).flip(1).argmax(dim=1)
                last = seq_len - 1 - flipped
                any_token = pool_mask.sum(dim=1) > 0
                last = torch.where(any_token, last, torch.zeros_like(last))
                out.append(x[torch.arange(rows, device=x.device), last])
            elif mode == "max":
                out.append(x.masked_fill(mask == 0, float("-inf")).max(dim=1).values)
            elif mode in ("mean", "mean_sqrt_len_tokens"):
                total = (x * mask).sum(dim=1)
                divisor = counts.clamp(min=1e-9)
                out.append(total / (divisor if mode == "mean" else divisor.sqrt()))
            elif mode == "weightedmean":
                weights = mask * (arange + 1).to(x.dtype).view(1, -1, 1)
                out.append((x * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1e-9))
            else:
                raise ValueError(f"pooling {mode!r}")
        return self.finish(torch.cat(out, dim=-1))

    def packed(
        self,
        x: torch.Tensor,
        starts: np.ndarray,
        lengths: np.ndarray,
        pool_from: np.ndarray | None = None,
    ) -> torch.Tensor:
        """(inputs, output) from packed (tokens, hidden) states: input i's tokens are
        x[starts[i] : starts[i] + lengths[i]]; `pool_from[i]` of them are left out."""
        device = x.device
        count = len(lengths)
        skip = np.zeros(count, dtype=np.int64) if pool_from is None else pool_from
        row_of = np.repeat(np.arange(count), lengths)
        position = np.arange(int(lengths.sum())) - np.repeat(starts, lengths)
        keep = position >= skip[row_of]
        x = x.float()
        out = []
        kept_x = x if keep.all() else x[_on(device, np.flatnonzero(keep))]
        kept_rows = _on(device, row_of[keep])
        counts = _on(device, np.bincount(row_of[keep], minlength=count).astype(np.float32))
        some = lengths > skip
        for mode in self.modes:
            if mode == "cls":
                out.append(x[_on(device, starts + np.where(some, skip, 0))])
            elif mode == "last":
                out.append(x[_on(device, starts + np.where(some, lengths - 1, 0))])
            elif mode == "max":
                best = x.new_full((count, self.hidden), float("-inf"))
                index = kept_rows[:, None].expand(-1, self.hidden)
                out.append(best.scatter_reduce(0, index, kept_x, reduce="amax"))
            elif mode in ("mean", "mean_sqrt_len_tokens"):
                total = x.new_zeros(count, self.hidden).index_add_(0, kept_rows, kept_x)
                divisor = counts.clamp(min=1e-9)[:, None]
                out.append(total / (divisor if mode == "mean" else divisor.sqrt()))
            elif mode == "weightedmean":
                weights = _on(device, (position[keep] + 1).astype(np.float32))[:, None]
                total = x.new_zeros(count, self.hidden).index_add_(0, kept_rows, kept_x * weights)
                weight_sums = x.new_zeros(count, 1).index_add_(0, kept_rows, weights)
                out.append(total / weight_sums.clamp(min=1e-9))
            else:
                raise ValueError(f"pooling {mode!r}")
        return self.finish(torch.cat(out, dim=-1))


def _on(device: torch.device, array: np.ndarray) -> torch.Tensor:
    tensor = torch.from_numpy(np.ascontiguousarray(array))
    return tensor if device.type == "cpu" else tensor.to(device, non_blocking=True)
