"""The BERT tokenizer read straight from tokenizer.json encodes exactly as transformers'
AutoTokenizer does, and folders where the two could differ go through transformers."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from warmgate_server.tokenizer import BertTokenizer

TEXTS = [
    "hi",
    "",
    "   ",
    "A man is eating food.",
    "Héllo Wörld, ÇA VA? naïve café résumé",
    "東京は日本の首都です。北京是中国的首都。",
    "emoji 🤖🚀 and symbols ∑∫√ ≠ ≤ → ¥€£",
    "tabs\tnew\nlines\r\nand   spaces",
    "[CLS] [SEP] [MASK] [PAD] [UNK] look like special tokens",
    "unbelievably antidisestablishmentarianism supercalifragilisticexpialidocious",
    "Kubernetes readiness gates keep a pod out of the endpoints until a custom condition "
    "turns true. " * 40,  # far past the file's own 128-token truncation
    "control\x00chars\x07here",
    "don't won't it's O'Neil's 3.14159 1,000,000 user@example.com https://example.com/a?b=c",
]


@pytest.fixture(scope="module")
def both(minilm_dir):
    from transformers import AutoTokenizer

    return BertTokenizer.from_folder(minilm_dir), AutoTokenizer.from_pretrained(str(minilm_dir))


def test_same_ids_and_special_token_masks_as_transformers(both) -> None:
    direct, reference = both
    ours = direct(TEXTS, return_special_tokens_mask=True)
    theirs = reference(TEXTS, return_special_tokens_mask=True, verbose=False)
    assert ours["input_ids"] == theirs["input_ids"]
    assert ours["special_tokens_mask"] == theirs["special_tokens_mask"]
    assert len(ours["input_ids"][10]) > 128  # tokenizer.json's truncation is off, as there


def test_same_special_token_ids_limit_and_input_names_as_transformers(both) -> None:
    direct, reference = both
    assert (direct.pad_token_id, direct.cls_token_id) == (0, 101)
    assert (direct.pad_token_id, direct.cls_token_id) == (
        reference.pad_token_id,
        reference.cls_token_id,
    )
    assert direct.model_max_length == reference.model_max_length == 512
    assert direct.model_input_names == reference.model_input_names


def copy_with(minilm_dir, tmp_path, **config_changes):
    folder = tmp_path / "model"
    shutil.copytree(minilm_dir, folder)
    path = folder / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config.update(config_changes)
    path.write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"do_lower_case": False}, "lowercase differs"),
        ({"strip_accents": True}, "strip_accents differs"),
        ({"tokenizer_class": "XLMRobertaTokenizer"}, "is not BERT's"),
        ({"added_tokens_decoder": {"30522": {"content": "<new>"}}}, "'<new>' is not in"),
    ],
)
def test_folders_where_transformers_could_encode_otherwise_are_refused(
    minilm_dir, tmp_path, changes, reason
) -> None:
    with pytest.raises(ValueError, match=reason):
        BertTokenizer.from_folder(copy_with(minilm_dir, tmp_path, **changes))


def test_a_refused_folder_loads_through_transformers_and_still_matches(
    minilm_dir, tmp_path
) -> None:
    """The server falls back to AutoTokenizer, which rebuilds the normalizer from the config."""
    from transformers import AutoTokenizer

    from warmgate_server.config import parse_config
    from warmgate_server.loading import load_model

    folder = copy_with(minilm_dir, tmp_path, do_lower_case=False)
    loaded = load_model(parse_config(["--model", str(folder), "--device", "cpu"], environ={}))
    assert not isinstance(loaded.tokenizer, BertTokenizer)
    expected = AutoTokenizer.from_pretrained(str(folder))(["Hello World"])["input_ids"]
    assert loaded.tokenizer(["Hello World"])["input_ids"] == expected


def test_a_packed_bert_server_process_never_imports_transformers(minilm_dir) -> None:
    """What the direct tokenizer is for: loading MiniLM for serving on the CPU (packed forward
    pass, tokenizer.json) leaves transformers unimported, a second of CPU less per pod start."""
    script = (
        "import sys\n"
        "from warmgate_server.config import parse_config\n"
        "from warmgate_server.loading import load_model\n"
        "from warmgate_server.runner import ModelRunner\n"
        f"loaded = load_model(parse_config(['--model', {str(minilm_dir)!r}, '--device', 'cpu'],"
        " environ={}))\n"
        "runner = ModelRunner(loaded, 'mean', 128)\n"
        "assert runner.tokenize(['hello world'])[0][0] == 101\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'transformers'))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
