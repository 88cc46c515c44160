"""The BERT tokenizer read straight from tokenizer.json encodes exactly as transformers'
AutoTokenizer does, and folders where the two could differ go through transformers."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from warmgate_server.tokenizer import BertTokenizer
from warmgate_testkit import zoo

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


def assert_encodes_as(direct, reference, texts: list[str]) -> list[list[int]]:
    """The direct tokenizer gives transformers' ids, special-token masks, offsets, decoding,
    special token ids, limit, input names, size and added tokens (with their flags) on `texts`;
    returns the ids."""
    ours = direct(texts, return_special_tokens_mask=True, return_offsets_mapping=True)
    theirs = reference(
        texts, return_special_tokens_mask=True, return_offsets_mapping=True, verbose=False
    )
    assert ours["input_ids"] == theirs["input_ids"]
    assert ours["special_tokens_mask"] == theirs["special_tokens_mask"]
    assert ours["offset_mapping"] == [list(map(tuple, row)) for row in theirs["offset_mapping"]]
    assert direct.batch_decode(ours["input_ids"]) == reference.batch_decode(
        theirs["input_ids"], skip_special_tokens=True
    )
    assert direct.convert_ids_to_tokens(ours["input_ids"][3]) == reference.convert_ids_to_tokens(
        theirs["input_ids"][3]
    )
    for name in ("pad_token_id", "cls_token_id", "model_max_length", "model_input_names"):
        assert getattr(direct, name) == getattr(reference, name), name
    assert len(direct) == len(reference)
    assert repr(sorted(direct._tokenizer.get_added_tokens_decoder().items())) == repr(
        sorted(reference.backend_tokenizer.get_added_tokens_decoder().items())
    )
    return ours["input_ids"]


WORDPIECE_TEXTS = [*TEXTS, "<s> </s> <mask> <pad> look special", "a<mask>b <mask> c", "   <mask>",
                   "<S> </S> <MASK> <Pad> in upper case"]  # fmt: skip


@pytest.mark.parametrize("layout", zoo.LAYOUTS)
@pytest.mark.parametrize(
    ("family", "name"), [("distilbert", "DistilBertTokenizer"), ("mpnet", "MPNetTokenizer")]
)
def test_distilbert_and_mpnet_tokenizers_encode_and_decode_as_transformers(
    tmp_path: Path, layout: str, family: str, name: str
) -> None:
    """DistilBERT's tokenizer (msmarco-distilbert, distiluse) is BERT's whose model takes no
    token type ids; MPNet's (all-mpnet-base-v2) a WordPiece vocabulary that transformers 5
    rebuilds with `<s> ... </s>` and a `<mask>` that takes the space before it. Read without
    transformers, each gives transformers' ids, masks, offsets and decoding, and input names
    without token types (neither model takes them)."""
    from transformers import AutoTokenizer

    from warmgate_server.tokenizer import load_fast

    folder = zoo.build(family, layout, tmp_path)
    direct, reference = load_fast(folder), AutoTokenizer.from_pretrained(str(folder))
    assert type(direct).__name__ == type(reference).__name__ == name
    ids = assert_encodes_as(direct, reference, WORDPIECE_TEXTS)
    # The test can fail: the texts are not all unknown pieces.
    assert len({tuple(row) for row in ids}) >= len(WORDPIECE_TEXTS) - 2
    assert direct.model_input_names == ["input_ids", "attention_mask"]


@pytest.mark.parametrize(
    ("name", "change", "reason"),
    [
        ("tokenizer.json", lambda d: d["model"].update(type="BPE"), "is not WordPiece"),
        (
            "tokenizer_config.json",
            lambda d: d.update(added_tokens_decoder={"999": {"content": "<new>"}}),
            "'<new>' is not in the vocabulary",
        ),
        ("tokenizer_config.json", lambda d: d.update(mask_token="<m>"), "'<m>' is not in the"),
        ("special_tokens_map.json", lambda d: d.update(pad_token="[UNK]"), "pad_token differs"),
    ],
)
def test_mpnet_folders_transformers_could_build_otherwise_are_refused(
    tmp_path, name, change, reason
) -> None:
    from warmgate_server.tokenizer import load_fast

    folder = zoo.build("mpnet", "current", tmp_path / "zoo")
    if name == "special_tokens_map.json" and not (folder / name).exists():
        (folder / name).write_text(json.dumps({"pad_token": "<pad>"}))
    with pytest.raises(ValueError, match=reason):
        load_fast(rewrite(folder, tmp_path, name, change))


def rewrite(folder, tmp_path, name, change):
    """A copy of `folder` whose JSON file `name` `change` (a function) has changed."""
    copy = tmp_path / "model"
    shutil.copytree(folder, copy)
    path = copy / name
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))
    return copy


def copy_with(minilm_dir, tmp_path, **config_changes):
    def change(config):
        config.update(config_changes)

    return rewrite(minilm_dir, tmp_path, "tokenizer_config.json", change)


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"do_lower_case": False}, "lowercase differs"),
        ({"strip_accents": True}, "strip_accents differs"),
        ({"tokenizer_class": "XLMRobertaTokenizer"}, "is not one of BertTokenizer"),
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


# XLM-RoBERTa: the tokenizer transformers 5 rebuilds from tokenizer.json's parts, built the same
# way without it (bge-m3, multilingual-e5, KURE). Texts with what SentencePiece's normalization
# and the Metaspace split act on: full-width letters, runs of spaces, tabs, <mask> after a space.
XLMR_TEXTS = [
    *TEXTS,
    # full-width letters, digits and a hyphen; a ligature; circled digits
    "\uff46\uff55\uff4c\uff4c\uff0d\uff57\uff49\uff44\uff54\uff48"
    " \uff21\uff22\uff23 \uff11\uff12\uff13"
    " and \ufb01 ligatures \u2460\u2461",
    "샘플 문장입니다   with  runs of\tspaces\u3000and an ideographic one",
    "query: 東京の天気はどうですか <mask> and<mask>here </s> <s>",
    "Ceci est une phrase en français, avec des accents: é è ê ë.",
]


@pytest.fixture(scope="module")
def xlmr(tmp_path_factory):
    """The zoo's XLM-R model in both layouts, and a copy of it with a hub-style tokenizer."""
    from warmgate_testkit import zoo

    root = tmp_path_factory.mktemp("xlmr-tokenizers")
    folders = {layout: zoo.build("xlm-roberta-mean", layout, root) for layout in zoo.LAYOUTS}
    hub = root / "sentencepiece"
    zoo.write_hub_xlmr_tokenizer(hub)
    folders["sentencepiece"] = hub
    return folders


@pytest.mark.parametrize("kind", ["current", "hub", "sentencepiece"])
def test_xlm_roberta_tokenizer_encodes_and_decodes_as_transformers(xlmr, kind) -> None:
    """The zoo's XLM-R tokenizer in both layouts, and one as the hub's models carry it (a
    SentencePiece model with its NFKC character map, converted by transformers 4)."""
    from transformers import AutoTokenizer

    from warmgate_server.tokenizer import XLMRobertaTokenizer, load_fast

    folder = xlmr[kind]
    direct, reference = load_fast(folder), AutoTokenizer.from_pretrained(str(folder))
    assert isinstance(direct, XLMRobertaTokenizer)
    ids = assert_encodes_as(direct, reference, XLMR_TEXTS)
    # The test can fail: the texts are not all unknown pieces, and the normalization acts.
    assert len({tuple(row) for row in ids}) == len(XLMR_TEXTS) - 1  # "" == "   "
    if kind == "sentencepiece":  # NFKC: full-width letters become ASCII ones
        first = direct(["\uff46\uff55\uff4c\uff4c"])["input_ids"][0]
        assert first == direct(["full"])["input_ids"][0]


@pytest.mark.parametrize(
    ("name", "change", "reason"),
    [
        ("tokenizer.json", lambda d: d["model"]["vocab"].insert(0, ["<x>", 0.0]), "first pieces"),
        ("tokenizer.json", lambda d: d["model"].update(type="BPE"), "is not Unigram"),
        (
            "tokenizer_config.json",
            lambda d: d["added_tokens_decoder"].update({"999": {"content": "<new>"}}),
            "'<new>' is not a",
        ),
        ("special_tokens_map.json", lambda d: d.update(pad_token="<unk>"), "pad_token differs"),
    ],
)
def test_xlm_roberta_folders_transformers_could_build_otherwise_are_refused(
    xlmr, tmp_path, name, change, reason
) -> None:
    from warmgate_server.tokenizer import load_fast

    with pytest.raises(ValueError, match=reason):
        load_fast(rewrite(xlmr["sentencepiece"], tmp_path, name, change))


@pytest.mark.parametrize(
    "family", ["bert", "xlm-roberta", "roberta-wordpiece", "distilbert", "mpnet"]
)
def test_a_packed_server_process_never_imports_transformers(
    minilm_dir, xlmr, tmp_path: Path, family: str
) -> None:
    """What the direct tokenizers are for: loading MiniLM, an XLM-R model (bge-m3's and
    multilingual-e5's path), a RoBERTa with KLUE's WordPiece tokenizer (ko-sroberta's), a
    DistilBERT (msmarco-distilbert's) or an MPNet (all-mpnet's) for serving on the CPU (packed
    forward pass, tokenizer.json) leaves transformers unimported: a second or more of CPU less
    per pod start
    (more for a 250,000-piece XLM-R tokenizer, which transformers rebuilds from a Python
    list)."""
    own = {"distilbert": "DistilBertTokenizer", "mpnet": "MPNetTokenizer"}
    if family in ("roberta-wordpiece", *own):
        folder = zoo.build(family, "current", tmp_path)
        name = own.get(family, "BertTokenizer")
    else:
        folder, name = {
            "bert": (minilm_dir, "BertTokenizer"),
            "xlm-roberta": (xlmr["current"], "XLMRobertaTokenizer"),
        }[family]
    script = (
        "import sys\n"
        "from warmgate_server.config import parse_config\n"
        "from warmgate_server.loading import load_model\n"
        "from warmgate_server.runner import ModelRunner\n"
        f"loaded = load_model(parse_config(['--model', {str(folder)!r}, '--device', 'cpu'],"
        " environ={}))\n"
        "assert loaded.packed is not None\n"
        "runner = ModelRunner(loaded, 'mean', 64)\n"
        "assert runner.tokenize(['hello world'])[0][0] == loaded.cls_token_id\n"
        "print(type(loaded.tokenizer).__name__)\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'transformers'))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[-3:-1] == [name, "[]"]


def _hub_config(folder: Path, variant: str) -> None:
    """Rewrite `folder`'s tokenizer files as hub folders carry them, with flags that differ
    from what each class builds from a token's text. "legacy": a config written before
    transformers 4.34 (no added_tokens_decoder; `<mask>` in its `{"content": ...}` form, as
    all-mpnet-base-v2's and multilingual-e5's configs have it; a special_tokens_map.json), and
    tokenizer.json's `<mask>` stripping on its left, not normalized, and a word of the
    vocabulary among its added tokens; "decoder-flags": an
    added_tokens_decoder whose special tokens are normalized, and a word of the vocabulary
    added as a token; "decoder-without-mask": an added_tokens_decoder that does not list the
    `<mask>` of the config's `{"content": ...}` form."""
    config_file, file_json = folder / "tokenizer_config.json", folder / "tokenizer.json"
    config, spec = json.loads(config_file.read_text()), json.loads(file_json.read_text())
    mask = {"content": "<mask>", "single_word": False, "lstrip": True, "rstrip": False,
            "normalized": True}  # fmt: skip
    vocab = spec["model"]["vocab"]
    pieces = vocab if isinstance(vocab, dict) else {p: i for i, (p, _s) in enumerate(vocab)}
    flags = {"lstrip": False, "rstrip": False, "single_word": False, "normalized": True}
    if variant == "legacy":
        config.pop("added_tokens_decoder", None)
        config_mask = {**mask, "lstrip": False}  # the file's (below) is what counts
        config["mask_token"] = {**config_mask, "__type": "AddedToken"}
        names = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token")
        special_map = {name: config[name] for name in names if isinstance(config.get(name), str)}
        (folder / "special_tokens_map.json").write_text(
            json.dumps({**special_map, "mask_token": config_mask})
        )
        for entry in spec["added_tokens"]:
            if entry["content"] == "<mask>":
                entry.update(lstrip=True, normalized=False)
        word = next(piece for piece in pieces if piece.isalpha() and len(piece) > 3)
        spec["added_tokens"].append({"id": pieces[word], "content": word, **flags,
                                     "special": False})  # fmt: skip
        file_json.write_text(json.dumps(spec))
    elif variant == "decoder-flags":
        word = next(piece for piece in pieces if piece.isalpha() and len(piece) > 3)
        config["added_tokens_decoder"] = {
            str(pieces[config["bos_token"]]): {**flags, "content": config["bos_token"],
                                               "special": True},
            str(pieces["<mask>"]): {**flags, "content": "<mask>", "lstrip": True, "special": True},
            str(pieces[word]): {**flags, "content": word, "special": False},
        }  # fmt: skip
    else:
        config["added_tokens_decoder"] = {
            str(pieces[config["bos_token"]]): {**flags, "content": config["bos_token"],
                                               "special": True},
        }  # fmt: skip
        config["mask_token"] = {**mask, "__type": "AddedToken"}
    config_file.write_text(json.dumps(config))


@pytest.mark.parametrize("variant", ["legacy", "decoder-flags", "decoder-without-mask"])
@pytest.mark.parametrize("family", ["mpnet", "xlm-roberta-mean"])
def test_hub_configs_special_tokens_are_added_as_transformers_adds_them(
    tmp_path: Path, family: str, variant: str
) -> None:
    """transformers 5 adds the tokens of the config's added_tokens_decoder with their flags, or,
    in a config without one, tokenizer.json's added tokens with theirs; a special token listed
    in neither, from the config (its `{"content": ...}` form with that form's flags). The
    direct tokenizers add the same tokens with the same flags, so a text with special tokens
    in upper case or full width, after a space or inside a word, gets transformers' ids and
    offsets."""
    from transformers import AutoTokenizer

    from warmgate_server.tokenizer import load_fast

    folder = zoo.build(family, "current", tmp_path)
    _hub_config(folder, variant)
    direct, reference = load_fast(folder), AutoTokenizer.from_pretrained(str(folder))
    texts = [*WORDPIECE_TEXTS, "a <MASK> b \uff1cmask\uff1e c <mask>", "x<mask>y <S>"]
    assert_encodes_as(direct, reference, texts)
