"""FlagEmbedding, the reference for bge-m3's outputs (tests/server/test_multi.py and the real
node's test in tests/e2e/test_router.py)."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
import types
from pathlib import Path


def flag_embedding_m3() -> type:
    """FlagEmbedding's BGEM3FlagModel (M3Embedder). FlagEmbedding 1.4.2's package __init__
    imports every model it has, its MiniCPM reranker among them, which needs a module
    transformers 5 no longer has (transformers.modeling_attn_mask_utils); so the packages above
    the M3 code are entered without their __init__. The M3 code itself is FlagEmbedding's,
    unchanged."""
    if "FlagEmbedding" not in sys.modules:  # entered once; later calls find the packages
        spec = importlib.util.find_spec("FlagEmbedding")
        assert spec is not None and spec.origin is not None, "FlagEmbedding is a test dependency"
        root = Path(spec.origin).parent
        for name in (
            "FlagEmbedding",
            "FlagEmbedding.inference",
            "FlagEmbedding.inference.embedder",
            "FlagEmbedding.inference.embedder.encoder_only",
        ):
            package = types.ModuleType(name)
            package.__path__ = [str(root.joinpath(*name.split(".")[1:]))]
            package.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
            sys.modules[name] = package
    from FlagEmbedding.inference.embedder.encoder_only.m3 import M3Embedder

    return M3Embedder
