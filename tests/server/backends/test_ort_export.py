"""--compile-cache: the ONNX export kept across restarts (ort.py), on a real (tiny, random)
BERT model exported by torch's exporter and opened by ONNX Runtime, in this process."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import torch
import transformers

from warmgate_server.backends import ort_export as ort


def tiny_bert(seed: int = 0) -> object:
    torch.manual_seed(seed)
    config = transformers.BertConfig(
        vocab_size=100,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
    )
    return transformers.BertModel(config).eval()


def hidden(model: ort.OrtModel) -> np.ndarray:
    ids = np.array([[2, 5, 7, 3, 0], [2, 9, 3, 0, 0]], dtype=np.int64)
    return model.run(ids, (ids != 0).astype(np.int64))


class Exports:
    """before_export's calls: one per real export."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self) -> None:
        self.count += 1


def test_a_restart_opens_the_stored_export_instead_of_exporting(tmp_path: Path) -> None:
    exports = Exports()
    model = tiny_bert()
    first = ort.export(model, True, 1, 0, tmp_path, exports)
    assert (first.cache, exports.count) == ("miss", 1)
    entry = Path(first.cache_path)
    assert entry.parent == tmp_path and (entry / "model.onnx").is_file()
    # The same weights loaded again (a restarted container): opened, not exported.
    second = ort.export(tiny_bert(), True, 1, 2, tmp_path, exports)
    assert (second.cache, second.cache_path, exports.count) == ("hit", str(entry), 1)
    assert second.thread_counts == (1, 2)
    np.testing.assert_array_equal(hidden(first), hidden(second))
    # Without a cache every start exports.
    assert ort.export(model, True, 1, 0, None, exports).cache == "off"
    assert exports.count == 2
    assert sorted(path.name for path in tmp_path.iterdir()) == [entry.name]


def test_the_key_follows_the_weights_the_configuration_and_the_inputs() -> None:
    names = ["input_ids", "attention_mask", "token_type_ids"]
    model = tiny_bert()
    key = ort.cache_key(model, names)
    assert ort.cache_key(tiny_bert(), names) == key  # the same model, loaded again
    assert ort.cache_key(tiny_bert(seed=1), names) != key  # other weights
    with torch.no_grad():
        changed = tiny_bert()
        changed.encoder.layer[0].output.dense.weight[0, 0] += 1e-6  # one weight, slightly
    assert ort.cache_key(changed, names) != key
    other = tiny_bert()
    other.config.layer_norm_eps = 1e-5  # the same weights, another graph
    assert ort.cache_key(other, names) != key
    assert ort.cache_key(model, names[:2]) != key
    # Where the folder is mounted is not part of the model.
    moved = tiny_bert()
    moved.config._name_or_path = "/somewhere/else"
    assert ort.cache_key(moved, names) == key


def test_a_broken_entry_is_exported_again_and_replaced(tmp_path: Path) -> None:
    exports = Exports()
    model = tiny_bert()
    entry = Path(ort.export(model, True, 1, 0, tmp_path, exports).cache_path)
    (entry / "model.onnx").write_bytes(b"not a model")
    again = ort.export(model, True, 1, 0, tmp_path, exports)
    assert (again.cache, again.cache_path, exports.count) == ("miss", str(entry), 2)
    assert ort.export(model, True, 1, 0, tmp_path, exports).cache == "hit"


def test_storing_deletes_long_unused_entries_and_abandoned_exports(tmp_path: Path) -> None:
    old = time.time() - (ort.CACHE_KEEP_DAYS + 1) * 86400
    stale, recent = tmp_path / "0", tmp_path / "1"
    abandoned, running = tmp_path / ".export-dead", tmp_path / ".export-running"
    for folder in (stale, recent, abandoned, running):
        folder.mkdir()
        (folder / "model.onnx").write_bytes(b"x")
    os.utime(stale, (old, old))
    hours_ago = time.time() - (ort.EXPORT_HOURS + 1) * 3600
    os.utime(abandoned, (hours_ago, hours_ago))
    stored = Path(ort.export(tiny_bert(), True, 1, 0, tmp_path).cache_path)
    left = sorted(path.name for path in tmp_path.iterdir())
    assert left == sorted([".export-running", "1", stored.name])


def test_a_cache_that_cannot_be_written_still_serves(tmp_path: Path) -> None:
    """A cache path that is not a folder (a mount gone wrong): the export runs from a
    temporary folder, is not kept, and serves."""
    cache = tmp_path / "compiled"
    cache.write_text("a file, not a folder")
    exports = Exports()
    model = ort.export(tiny_bert(), True, 1, 0, cache, exports)
    assert (model.cache, model.cache_path, exports.count) == ("unwritable", "", 1)
    assert hidden(model).shape == (2, 5, 32)
    assert cache.read_text() == "a file, not a folder"
