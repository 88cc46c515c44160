"""A model zoo made offline, for the tests (tests/server/test_models.py) and benchmarks
(bench/server/bench_models.py): a tiny, randomly initialised model of each family people deploy,
with a real tokenizer of its family's class trained on a small multilingual corpus, saved the
way sentence-transformers saves it today and in the older hub layout.

No hub is reachable here, so the families are made, not downloaded: the architecture, the
tokenizer class and the sentence-transformers modules are the real ones (transformers' config
and model classes, sentence-transformers' Pooling, Dense and Normalize); only the sizes are tiny
and the weights random. The weights are drawn wider than transformers' default (std 0.02),
which gives nearly the same CLS vector for every text: the tests check that their reference
vectors differ, so a server that pooled wrongly could not pass by accident.

`build(family, layout, root)` returns the folder; `FAMILIES` names them all. `shaped(shape,
root)`: an XLM-R of a real model's size (random weights), for time and memory. `cross_encoder`:
a re-ranker or classifier of a family; `m3`: a bge-m3-shaped folder with its sparse and ColBERT
heads.
"""

from __future__ import annotations

import importlib
import itertools
import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

CORPUS = [
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The girl is carrying a baby.",
    "A man is riding a horse.",
    "A woman is playing violin.",
    "Two men pushed carts through the woods.",
    "Kubernetes readiness gates keep a pod out of the endpoints until a condition turns true.",
    "The first request of a cold process pays for lazy initialisation and kernel selection.",
    "Embedding servers must warm every shape before they report ready.",
    "샘플 문장입니다",
    "한국어 문장을 임베딩합니다. 검색 품질이 중요합니다.",
    "오늘 날씨가 정말 좋네요. 공원에 산책하러 갈까요?",
    "서울은 대한민국의 수도입니다.",
    "これは日本語の文です。",
    "東京は日本の首都です。検索エンジンで使います。",
    "今日はいい天気ですね。",
    "Ceci est une phrase en français, avec des accents: élève, garçon.",
    "Dies ist ein deutscher Satz über Straßenbahnen.",
    "Это предложение на русском языке.",
    "这是一个中文句子。",
    "Emoji travel too: 🚀🔥😀 and 👍🏽.",
    "Mixed: 한국어 and English and 日本語 in one line 🎉",
    "Numbers 12345 and symbols #$%&*() and URLs https://example.com/path?q=1",
]


def corpus() -> list[str]:
    """The training corpus: the sentences, lowercased copies and word-level fragments, so
    every family's trainer sees enough text to make a few hundred tokens."""
    lines = list(CORPUS)
    lines += [line.lower() for line in CORPUS]
    for line in CORPUS:
        words = line.split()
        lines += [" ".join(words[i : i + 3]) for i in range(0, len(words), 2)]
    return lines * 4


# Texts served and compared: English, Korean, Japanese, emoji, mixed, long (truncated).
TEXTS = [
    "hi",
    "A man is eating food.",
    "샘플 문장입니다",
    "한국어 문장을 임베딩합니다.",
    "これは日本語の文です。",
    "🚀🔥😀",
    "Mixed: 한국어 and English and 日本語 🎉",
    "Kubernetes readiness gates keep a pod out of the endpoints. " * 12,
]
VOCAB_SIZE = 600


def _trained(tokenizer: Any, trainer: Any) -> dict[str, Any]:
    """The model part of `tokenizer` trained on the corpus (tokenizer.json's "model")."""
    tokenizer.train_from_iterator(corpus(), trainer)
    return json.loads(tokenizer.to_str())["model"]


def _bpe_parts(model: dict[str, Any]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    return model["vocab"], merges


def _wordpiece(specials: list[str], lowercase: bool = True) -> dict[str, int]:
    """A WordPiece vocabulary of the corpus, the same in every process: BERT's normalizer and
    pre-tokenizer, then BPE merges (a word's first character as it is, the others "##"-
    prefixed), the most frequent pair first and ties by the pair's text. The tokenizers
    library's WordPieceTrainer does the same but breaks ties and numbers its tokens in its hash
    maps' order, which changes with every process: its models, and so a test's references and
    tolerances, differed between two runs of the same test (a raw score 3.6e-4 from
    CrossEncoder.predict's in one CI run, within 1e-4 in every other)."""
    from tokenizers import normalizers, pre_tokenizers

    normalizer = normalizers.BertNormalizer(lowercase=lowercase)
    pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    counts: dict[str, int] = {}
    for line in corpus():
        for word, _span in pre_tokenizer.pre_tokenize_str(normalizer.normalize_str(line)):
            counts[word] = counts.get(word, 0) + 1
    words = [[word[0], *("##" + char for char in word[1:])] for word in counts]
    frequency = list(counts.values())
    tokens = list(specials)
    characters = {symbol.removeprefix("##") for word in words for symbol in word}
    alphabet = characters | {"##" + char for char in characters}
    tokens += sorted(alphabet - set(tokens))
    known = set(tokens)
    while len(tokens) < VOCAB_SIZE:
        pairs: dict[tuple[str, str], int] = {}
        for word, count in zip(words, frequency, strict=True):
            for pair in itertools.pairwise(word):
                pairs[pair] = pairs.get(pair, 0) + count
        if not pairs:
            break
        first, second = min(pairs, key=lambda pair: (-pairs[pair], pair))
        merged = first + second[2:]
        for word in words:
            at = 0
            while at < len(word) - 1:
                if word[at] == first and word[at + 1] == second:
                    word[at : at + 2] = [merged]
                at += 1
        if merged not in known:
            known.add(merged)
            tokens.append(merged)
    return {token: index for index, token in enumerate(tokens)}


def _sentencepiece_unigram(normalization: str) -> tuple[bytes, Any]:
    """A SentencePiece Unigram model of the corpus (its serialized proto and a processor),
    with `normalization` (SentencePiece's rule name), unknown at id 0 and no other specials;
    one thread, so the same in every process."""
    import tempfile

    import sentencepiece

    with tempfile.TemporaryDirectory() as scratch:
        text = Path(scratch) / "corpus.txt"
        text.write_text("\n".join(corpus()))
        sentencepiece.SentencePieceTrainer.train(
            input=str(text), model_prefix=f"{scratch}/sp", vocab_size=VOCAB_SIZE // 2,
            hard_vocab_limit=False, model_type="unigram", normalization_rule_name=normalization,
            character_coverage=1.0, bos_id=-1, eos_id=-1, pad_id=-1, unk_id=0, minloglevel=2,
            num_threads=1,
        )  # fmt: skip
        proto = Path(f"{scratch}/sp.model").read_bytes()
        return proto, sentencepiece.SentencePieceProcessor(model_file=f"{scratch}/sp.model")


def _unigram(specials: list[str]) -> list[tuple[str, float]]:
    """A Unigram vocabulary of the corpus (pieces and their log probabilities, specials first
    at 0), trained by SentencePiece on whitespace-split text with no normalization, as the
    Metaspace pre-tokenizer splits it. SentencePiece's trainer gives the same pieces and scores
    in every process; the tokenizers library's UnigramTrainer numbers the characters it adds
    at the end in its hash map's order, which changes with every process."""
    _proto, processor = _sentencepiece_unigram("identity")
    pieces = [
        (processor.id_to_piece(index), float(processor.get_score(index)))
        for index in range(1, processor.get_piece_size())  # 0 is SentencePiece's <unk>
    ]
    return [*((piece, 0.0) for piece in specials), *(p for p in pieces if p[0] not in specials)]


def _byte_bpe(specials: list[str]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    return _bpe_parts(_trained(tokenizer, trainer))


def _metaspace_bpe(specials: list[str]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Gemma's kind: SentencePiece-style BPE on ▁-joined text with byte fallback."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(byte_fallback=True))
    tokenizer.normalizer = normalizers.Replace(" ", "▁")
    tokenizer.pre_tokenizer = pre_tokenizers.Split("▁", behavior="merged_with_next")
    byte_tokens = [f"<0x{value:02X}>" for value in range(256)]
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE + 256, special_tokens=specials + byte_tokens
    )
    return _bpe_parts(_trained(tokenizer, trainer))


def _tokenizer_bert(cls_name: str = "BertTokenizer") -> Any:
    import transformers

    vocab = _wordpiece(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"])
    return getattr(transformers, cls_name)(vocab=vocab)


def _tokenizer_klue() -> Any:
    """KLUE's (klue/roberta-base, under jhgan/ko-sroberta-multitask): a BERT WordPiece
    tokenizer for a RoBERTa model, its specials ordered as RoBERTa's ([PAD] is 1)."""
    from transformers import BertTokenizer

    return BertTokenizer(vocab=_wordpiece(["[CLS]", "[PAD]", "[SEP]", "[UNK]", "[MASK]"]))


def _tokenizer_mpnet() -> Any:
    from transformers import MPNetTokenizer

    vocab = _wordpiece(["<s>", "<pad>", "</s>", "[UNK]", "<mask>"])
    return MPNetTokenizer(vocab=vocab, unk_token="[UNK]")


def _tokenizer_xlmr() -> Any:
    from transformers import XLMRobertaTokenizer

    return XLMRobertaTokenizer(vocab=_unigram(["<s>", "<pad>", "</s>", "<unk>", "<mask>"]))


def _tokenizer_camembert() -> Any:
    """CamemBERT's: SentencePiece Unigram with fairseq's unused pieces first, as camembert-base
    has them (<s> and </s> are later pieces than their NOTUSED twins)."""
    from transformers import CamembertTokenizer

    specials = ["<s>NOTUSED", "<pad>", "</s>NOTUSED", "<unk>", "<unk>NOTUSED", "<s>", "</s>"]
    return CamembertTokenizer(vocab=_unigram([*specials, "<mask>"]))


def _tokenizer_roberta() -> Any:
    from transformers import RobertaTokenizer

    vocab, merges = _byte_bpe(["<s>", "<pad>", "</s>", "<unk>", "<mask>"])
    return RobertaTokenizer(vocab=vocab, merges=merges)


def _tokenizer_modernbert() -> Any:
    """ModernBERT's: byte-level BPE in a PreTrainedTokenizerFast with [CLS] ... [SEP]."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    vocab, merges = _byte_bpe(specials)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B [SEP]",
        special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="[PAD]",
        unk_token="[UNK]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
        model_input_names=["input_ids", "attention_mask"],
    )


def _tokenizer_qwen3() -> Any:
    """Qwen3-Embedding's: byte-level BPE whose post-processor appends <|endoftext|>, the token
    the model was trained to pool; left padding."""
    from tokenizers import processors
    from transformers import Qwen2Tokenizer

    vocab, merges = _byte_bpe(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=merges)
    eos = vocab["<|endoftext|>"]
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="$A <|endoftext|>",
        pair="$A <|endoftext|> $B:1 <|endoftext|>:1",
        special_tokens=[("<|endoftext|>", eos)],
    )
    tokenizer.padding_side = "left"
    return tokenizer


def _tokenizer_gemma() -> Any:
    """EmbeddingGemma's: BPE with byte fallback, <bos> ... <eos>."""
    from tokenizers import processors
    from transformers import GemmaTokenizer

    vocab, merges = _metaspace_bpe(["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"])
    tokenizer = GemmaTokenizer(vocab=vocab, merges=merges)
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<bos> $A <eos>",
        pair="<bos> $A <eos> $B <eos>",
        special_tokens=[("<bos>", vocab["<bos>"]), ("<eos>", vocab["<eos>"])],
    )
    return tokenizer


_SMALL = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 128,
}


def _config(cls_name: str, tokenizer: Any, **extra: Any) -> Any:
    import transformers

    values = {**_SMALL, "vocab_size": len(tokenizer), "initializer_range": 0.5, **extra}
    if tokenizer.pad_token_id is not None:
        values.setdefault("pad_token_id", tokenizer.pad_token_id)
    return getattr(transformers, cls_name)(**values)


@dataclass(frozen=True)
class Family:
    """One family: its tokenizer, its config and model classes, its sentence-transformers
    modules (pooling, Dense layers, Normalize) and prompts."""

    name: str
    tokenizer: Callable[[], Any]
    config: Callable[[Any], Any]
    pooling: str | tuple[str, ...] = "mean"
    dense: tuple[tuple[int, str], ...] = ()
    """(out_features, activation class path) per Dense module, in order."""
    normalize: bool = True
    prompts: dict[str, str] = field(default_factory=dict)
    default_prompt_name: str | None = None
    include_prompt: bool = True
    packed: bool = False
    """Runs warmgate's padding-free pass (else transformers' own forward)."""
    max_seq_length: int = 64
    hub_models: tuple[str, ...] = ()
    """Popular hub ids of this family (docs/models.md)."""


def _bert(tokenizer: Any) -> Any:
    return _config("BertConfig", tokenizer, max_position_embeddings=128)


def _xlmr(tokenizer: Any) -> Any:
    # 66 positions: 64 usable after the pad_token_id + 1 offset, as 514 are for 512.
    return _config("XLMRobertaConfig", tokenizer, max_position_embeddings=66, type_vocab_size=1)


def _camembert(tokenizer: Any) -> Any:
    return _config("CamembertConfig", tokenizer, max_position_embeddings=66, type_vocab_size=1)


def _roberta(tokenizer: Any) -> Any:
    return _config("RobertaConfig", tokenizer, max_position_embeddings=130, type_vocab_size=1)


def _distilbert(tokenizer: Any) -> Any:
    import transformers

    return transformers.DistilBertConfig(
        vocab_size=len(tokenizer),
        dim=64,
        n_layers=2,
        n_heads=4,
        hidden_dim=128,
        max_position_embeddings=128,
        initializer_range=0.5,
        pad_token_id=tokenizer.pad_token_id,
    )


def _mpnet(tokenizer: Any) -> Any:
    return _config("MPNetConfig", tokenizer, max_position_embeddings=130)


def _modernbert(tokenizer: Any) -> Any:
    return _config(
        "ModernBertConfig",
        tokenizer,
        max_position_embeddings=128,
        global_attn_every_n_layers=2,
        local_attention=16,
        bos_token_id=tokenizer.cls_token_id,
        eos_token_id=tokenizer.sep_token_id,
        cls_token_id=tokenizer.cls_token_id,
        sep_token_id=tokenizer.sep_token_id,
    )


def _qwen3(tokenizer: Any) -> Any:
    return _config(
        "Qwen3Config",
        tokenizer,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )


def _gemma3(tokenizer: Any) -> Any:
    return _config(
        "Gemma3TextConfig",
        tokenizer,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        sliding_window=16,
        use_bidirectional_attention=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )


IDENTITY = "torch.nn.modules.linear.Identity"
TANH = "torch.nn.modules.activation.Tanh"
QWEN_PROMPT = "Instruct: Given a web search query, retrieve relevant passages\nQuery:"

FAMILIES: dict[str, Family] = {
    family.name: family
    for family in (
        Family(
            "bert-mean",
            _tokenizer_bert,
            _bert,
            packed=True,
            hub_models=("sentence-transformers/all-MiniLM-L6-v2", "intfloat/multilingual-e5-small"),
        ),
        Family(
            "bert-cls-prompt",
            _tokenizer_bert,
            _bert,
            pooling="cls",
            prompts={"query": "Represent this sentence for searching relevant passages: "},
            default_prompt_name="query",
            packed=True,
            hub_models=("BAAI/bge-small-en-v1.5", "mixedbread-ai/mxbai-embed-large-v1"),
        ),
        Family(
            "bert-no-prompt-pooling",
            _tokenizer_bert,
            _bert,
            pooling="weightedmean",
            prompts={"query": "Represent the question for retrieving supporting documents: "},
            default_prompt_name="query",
            include_prompt=False,
            packed=True,
            hub_models=("hkunlp/instructor-base (include_prompt: false)",),
        ),
        Family(
            "xlm-roberta-cls",
            _tokenizer_xlmr,
            _xlmr,
            pooling="cls",
            packed=True,
            hub_models=("BAAI/bge-m3", "nlpai-lab/KURE-v1", "dragonkue/BGE-m3-ko"),
        ),
        Family(
            "xlm-roberta-mean",
            _tokenizer_xlmr,
            _xlmr,
            prompts={"query": "query: ", "passage": "passage: "},
            packed=True,
            hub_models=("intfloat/multilingual-e5-base", "intfloat/multilingual-e5-large"),
        ),
        Family(
            "roberta-bpe",
            _tokenizer_roberta,
            _roberta,
            packed=True,
            hub_models=("ibm-granite/granite-embedding-125m-english", "FacebookAI/roberta-base"),
        ),
        Family(
            "roberta-wordpiece",
            _tokenizer_klue,
            _roberta,
            packed=True,
            hub_models=("jhgan/ko-sroberta-multitask", "klue/roberta-base"),
        ),
        Family(
            "camembert",
            _tokenizer_camembert,
            _camembert,
            packed=True,
            hub_models=(
                "dangvantuan/sentence-camembert-base",
                "Lajavaness/sentence-camembert-large",
            ),
        ),
        Family(
            "distilbert",
            lambda: _tokenizer_bert("DistilBertTokenizer"),
            _distilbert,
            packed=True,
            hub_models=(
                "sentence-transformers/msmarco-distilbert-base-v4",
                "sentence-transformers/distiluse-base-multilingual-cased-v2",
            ),
        ),
        Family(
            "mpnet",
            _tokenizer_mpnet,
            _mpnet,
            packed=True,
            hub_models=(
                "sentence-transformers/all-mpnet-base-v2",
                "sentence-transformers/multi-qa-mpnet-base-dot-v1",
            ),
        ),
        Family(
            "modernbert",
            _tokenizer_modernbert,
            _modernbert,
            pooling="cls",
            hub_models=("Alibaba-NLP/gte-modernbert-base",),
        ),
        Family(
            "qwen3",
            _tokenizer_qwen3,
            _qwen3,
            pooling="lasttoken",
            prompts={"query": QWEN_PROMPT, "document": ""},
            packed=True,
            hub_models=("Qwen/Qwen3-Embedding-0.6B", "Qwen/Qwen3-Embedding-4B"),
        ),
        Family(
            "gemma3-dense",
            _tokenizer_gemma,
            _gemma3,
            dense=((256, IDENTITY), (64, IDENTITY)),
            packed=True,
            prompts={"query": "task: search result | query: ", "document": "title: none | text: "},
            hub_models=("google/embeddinggemma-300m",),
        ),
    )
}
LAYOUTS = ("current", "hub")
"""current: as the installed sentence-transformers saves; hub: the older layout (module types
under sentence_transformers.models, boolean pooling flags, max_seq_length in
sentence_bert_config.json, the model's and Dense modules' weights in pytorch_model.bin)."""


def save_transformer(family: Family, folder: Path, seed: int = 0) -> Any:
    """The family's tokenizer and randomly initialised model, saved by transformers."""
    import torch
    import transformers

    torch.manual_seed(seed)
    tokenizer = family.tokenizer()
    config = family.config(tokenizer)
    model = transformers.AutoModel.from_config(config)
    model.eval()
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.model_max_length = family.max_seq_length
    tokenizer.save_pretrained(folder)
    return model


def _sentence_transformer(family: Family, transformer_folder: Path, seed: int) -> Any:
    import torch
    from sentence_transformers import SentenceTransformer, models

    transformer = models.Transformer(str(transformer_folder))
    transformer.max_seq_length = family.max_seq_length
    hidden = transformer.get_embedding_dimension()
    modules: list[Any] = [
        transformer,
        models.Pooling(hidden, pooling_mode=family.pooling, include_prompt=family.include_prompt),
    ]
    width = modules[1].get_embedding_dimension()
    torch.manual_seed(seed + 1)
    for out_features, activation in family.dense:
        module_path, _, name = activation.rpartition(".")
        activation_class = getattr(importlib.import_module(module_path), name)
        dense = models.Dense(width, out_features, activation_function=activation_class())
        torch.nn.init.normal_(dense.linear.weight, std=0.3)
        modules.append(dense)
        width = out_features
    if family.normalize:
        modules.append(models.Normalize())
    return SentenceTransformer(
        modules=modules,
        prompts=family.prompts or None,
        default_prompt_name=family.default_prompt_name,
        device="cpu",
    )


def build(name: str, layout: str, root: Path, seed: int = 0) -> Path:
    """The family `name` saved in `layout` under `root` (made once; later calls reuse it)."""
    family = FAMILIES[name]
    folder = root / f"{name}-{layout}"
    if (folder / "modules.json").is_file():
        return folder
    scratch = root / f".{name}-{layout}-transformer"
    save_transformer(family, scratch, seed)
    model = _sentence_transformer(family, scratch, seed)
    model.save(str(folder))
    shutil.rmtree(scratch)
    if name == "qwen3":  # as Qwen3-Embedding's tokenizer_config.json says
        tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
        tokenizer_config["padding_side"] = "left"
        (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    if layout == "hub":
        to_hub_layout(folder, family)
    return folder


CLASSIFIER_STD = 0.5
"""The spread of a cross-encoder's classifier weights: wide enough that scores differ between
pairs (at least 1e-3 apart here), not so wide that a sigmoid saturates or float32's rounding
through the layers nears a test's tolerance (logits of a few units)."""

CROSS_ENCODER_ACTIVATIONS = {
    "sigmoid": "torch.nn.modules.activation.Sigmoid",
    "identity": "torch.nn.modules.linear.Identity",
}


def cross_encoder(
    family_name: str,
    root: Path,
    num_labels: int = 1,
    activation: str | None = "sigmoid",
    seed: int = 0,
) -> Path:
    """A sentence-transformers CrossEncoder of the family (its tokenizer and architecture, a
    `*ForSequenceClassification` with `num_labels` labels, random weights), saved as
    sentence-transformers saves one today, with `activation` (CROSS_ENCODER_ACTIVATIONS; None:
    the model's default, Sigmoid for one label and Identity for more). The classifier is drawn
    wide, so scores differ between pairs. Made once under `root`."""
    import torch
    import transformers
    from sentence_transformers import CrossEncoder

    family = FAMILIES[family_name]
    folder = root / f"cross-{family_name}-{num_labels}-{activation}-{seed}"
    if (folder / "config.json").is_file():
        return folder
    torch.manual_seed(seed)
    tokenizer = family.tokenizer()
    config = family.config(tokenizer)
    config.num_labels = num_labels
    if num_labels > 1:
        config.id2label = {index: f"label_{index}" for index in range(num_labels)}
        config.label2id = {label: index for index, label in config.id2label.items()}
    model = transformers.AutoModelForSequenceClassification.from_config(config).eval()
    for name, weight in model.named_parameters():
        if name.startswith("classifier") and name.endswith("weight"):
            torch.nn.init.normal_(weight, std=CLASSIFIER_STD)
    scratch = root / f".{folder.name}-transformer"
    model.save_pretrained(scratch)
    tokenizer.model_max_length = family.max_seq_length
    tokenizer.save_pretrained(scratch)
    activation_fn = None
    if activation is not None:
        module_path, _, name = CROSS_ENCODER_ACTIVATIONS[activation].rpartition(".")
        activation_fn = getattr(importlib.import_module(module_path), name)()
    encoder = CrossEncoder(
        str(scratch), device="cpu", max_length=family.max_seq_length, activation_fn=activation_fn
    )
    encoder.save(str(folder))
    shutil.rmtree(scratch)
    return folder


QWEN3_RERANKER_TEMPLATE = (
    '{%- set instruction = messages | selectattr("role", "eq", "system") '
    '| map(attribute="content") | first | default("Given a web search query, retrieve relevant '
    'passages that answer the query") -%}\n'
    '{%- set query = messages | selectattr("role", "eq", "query") | map(attribute="content") '
    "| first -%}\n"
    '{%- set document = messages | selectattr("role", "eq", "document") '
    '| map(attribute="content") | first -%}\n'
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query "
    'and the Instruct provided. Note that the answer can only be "yes" or "no".<|im_end|>\n'
    "<|im_start|>user\n<Instruct>: {{ instruction }}\n<Query>: {{ query }}\n"
    "<Document>: {{ document }}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
)
"""Qwen3-Reranker's prompt as its sentence-transformers folder's chat template renders a
(query, document) pair: the instruction from a system message (the model's prompt), else its
default."""


def causal_reranker(root: Path, seed: int = 0, prompt: str | None = None) -> Path:
    """A re-ranker in Qwen3-Reranker's own form, as sentence-transformers 6 loads and saves it: a
    Qwen3ForCausalLM (tied embeddings, random weights) whose tokenizer has "yes" and "no" and
    the chat template QWEN3_RERANKER_TEMPLATE, then LogitScore (the last token's "yes" logit
    less its "no" logit) and a sigmoid. `prompt`: the instruction, as the folder's default
    prompt (a system message before each pair). Made once under `root`."""
    import torch
    import transformers
    from sentence_transformers import CrossEncoder

    folder = root / f"causal-reranker-{seed}-{'prompt' if prompt else 'default'}"
    if (folder / "config.json").is_file():
        return folder
    torch.manual_seed(seed)
    family = FAMILIES["qwen3"]
    tokenizer = family.tokenizer()
    tokenizer.backend_tokenizer.post_processor = None  # the reranker's appends no token
    tokenizer.add_tokens([word for word in ("yes", "no") if word not in tokenizer.get_vocab()])
    tokenizer.chat_template = QWEN3_RERANKER_TEMPLATE
    tokenizer.model_max_length = 512
    config = family.config(tokenizer)
    config.architectures = ["Qwen3ForCausalLM"]
    config.vocab_size = len(tokenizer)
    config.max_position_embeddings = 1024
    config.tie_word_embeddings = True
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    scratch = root / f".{folder.name}-transformer"
    model.save_pretrained(scratch)
    tokenizer.save_pretrained(scratch)
    prompts = {"instruction": prompt} if prompt else None
    encoder = CrossEncoder(
        str(scratch),
        device="cpu",
        prompts=prompts,
        default_prompt_name="instruction" if prompt else None,
    )
    encoder.save(str(folder))
    shutil.rmtree(scratch)
    return folder


def m3(root: Path, seed: int = 0) -> Path:
    """A bge-m3-shaped folder: the zoo's XLM-R of CLS pooling (bge-m3's family) saved in the
    hub's layout as BAAI/bge-m3's is, with FlagEmbedding's two heads beside the encoder:
    `sparse_linear.pt` (hidden -> 1) and `colbert_linear.pt` (hidden -> hidden), state dicts of
    torch Linears as FlagEmbedding saves them (write_m3_heads). Made once under `root`."""
    folder = root / f"bge-m3-tiny-{seed}"
    if (folder / "colbert_linear.pt").is_file():
        return folder
    encoder = build("xlm-roberta-cls", "hub", root / f".m3-{seed}", seed)
    scratch = root / f".{folder.name}"
    shutil.copytree(encoder, scratch)
    write_m3_heads(scratch, seed)
    scratch.rename(folder)
    return folder


def write_m3_heads(folder: Path, seed: int = 0) -> None:
    """FlagEmbedding's two heads for the encoder in `folder` (its config.json's hidden_size),
    seeded: `sparse_linear.pt` (hidden -> 1, drawn so that some tokens weigh nothing and the
    rest differ) and `colbert_linear.pt` (hidden -> hidden), torch Linears' state dicts."""
    import torch

    hidden = json.loads((folder / "config.json").read_text())["hidden_size"]
    torch.manual_seed(seed + 17)
    sparse, colbert = torch.nn.Linear(hidden, 1), torch.nn.Linear(hidden, hidden)
    torch.nn.init.normal_(sparse.weight, std=0.5)
    torch.nn.init.normal_(colbert.weight, std=0.3)
    torch.save(sparse.state_dict(), folder / "sparse_linear.pt")
    torch.save(colbert.state_dict(), folder / "colbert_linear.pt")


def splade(
    family_name: str,
    root: Path,
    pooling: str = "max",
    activation: str = "relu",
    seed: int = 0,
    legacy: bool = False,
) -> Path:
    """A sentence-transformers SparseEncoder of the family (its tokenizer, its `*ForMaskedLM`
    architecture, random weights): a Transformer of transformer_task fill-mask (`legacy`: the
    MLMTransformer module of sentence-transformers 5, as the hub's SPLADE folders have it), then
    SpladePooling with `pooling` (max or sum) and `activation` (relu or log1p_relu), saved as
    sentence-transformers saves one (the decoder tied to the word embeddings, as SPLADE
    checkpoints are). The MLM head's bias is drawn below zero, so each text weighs some ids and
    not others. Made once under `root`."""
    import torch
    import transformers
    from sentence_transformers import SparseEncoder
    from sentence_transformers.base.modules import Transformer
    from sentence_transformers.sparse_encoder.modules import MLMTransformer, SpladePooling

    family = FAMILIES[family_name]
    form = "-legacy" * legacy
    folder = root / f"splade-{family_name}-{pooling}-{activation}-{seed}{form}"
    if (folder / "modules.json").is_file():
        return folder
    torch.manual_seed(seed)
    tokenizer = family.tokenizer()
    model = transformers.AutoModelForMaskedLM.from_config(family.config(tokenizer)).eval()
    bias = next(value for name, value in model.named_parameters() if name.endswith("bias")
                and value.shape[0] == len(tokenizer) and "embeddings" not in name)  # fmt: skip
    with torch.no_grad():
        bias.copy_(torch.randn(len(tokenizer)) * 2.0 - 4.0)
    scratch = root / f".{folder.name}-transformer"
    model.save_pretrained(scratch)
    tokenizer.model_max_length = family.max_seq_length
    tokenizer.save_pretrained(scratch)
    if legacy:
        transformer = MLMTransformer(str(scratch), max_seq_length=family.max_seq_length)
    else:
        transformer = Transformer(
            str(scratch), max_seq_length=family.max_seq_length, transformer_task="fill-mask"
        )
    encoder = SparseEncoder(modules=[transformer, SpladePooling(pooling, activation)], device="cpu")
    encoder.save(str(folder))
    shutil.rmtree(scratch)
    return folder


XLMR_SHAPES = {
    "e5-base": {"num_hidden_layers": 12, "hidden_size": 768, "num_attention_heads": 12,
                "intermediate_size": 3072, "max_position_embeddings": 514},
    "bge-m3": {"num_hidden_layers": 24, "hidden_size": 1024, "num_attention_heads": 16,
               "intermediate_size": 4096, "max_position_embeddings": 8194},
}  # fmt: skip
"""XLM-R models of multilingual-e5-base's and bge-m3's sizes (their layers, widths and 250,002
tokens of vocabulary, random weights): what the benchmarks and the real node's wake test time."""
XLMR_POOLING = {"e5-base": "mean", "bge-m3": "cls"}


SHAPED_ROOT = Path(os.environ.get("WARMGATE_BENCH_MODELS", "~/.cache/warmgate/bench-models"))
"""Where `shaped` keeps its folders by default (outside any checkout: they are GiBs)."""


def shaped(shape: str, root: Path | None = None) -> Path:
    """The XLM-R of `shape` (XLMR_SHAPES) as a sentence-transformers folder in the hub layout,
    under `root` (SHAPED_ROOT by default; made once, about 20 s and 1.1 GiB for e5-base; later
    calls reuse it)."""
    import torch
    from sentence_transformers import SentenceTransformer, models
    from transformers import XLMRobertaConfig, XLMRobertaModel

    folder = (root or SHAPED_ROOT).expanduser() / f"xlm-roberta-{shape}"
    family = replace(FAMILIES["xlm-roberta-mean"], max_seq_length=512)
    if (folder / "modules.json").is_file():
        if "sentence_transformers.models." not in (folder / "modules.json").read_text():
            to_hub_layout(folder, family)
        return folder
    scratch = folder.with_name(folder.name + ".transformer")
    tokenizer = FAMILIES["xlm-roberta-mean"].tokenizer()
    tokenizer.model_max_length = XLMR_SHAPES[shape]["max_position_embeddings"] - 2
    torch.manual_seed(0)
    config = XLMRobertaConfig(
        vocab_size=250_002, type_vocab_size=1, pad_token_id=1, **XLMR_SHAPES[shape]
    )
    XLMRobertaModel(config, add_pooling_layer=False).eval().save_pretrained(scratch)
    tokenizer.save_pretrained(scratch)
    transformer = models.Transformer(str(scratch))
    transformer.max_seq_length = 512
    pooling = models.Pooling(config.hidden_size, pooling_mode=XLMR_POOLING[shape])
    model = SentenceTransformer(modules=[transformer, pooling, models.Normalize()], device="cpu")
    model.save(str(folder))
    shutil.rmtree(scratch)
    to_hub_layout(folder, family)
    return folder


_OLD_TYPES = {
    "Transformer": "sentence_transformers.models.Transformer",
    "Pooling": "sentence_transformers.models.Pooling",
    "Dense": "sentence_transformers.models.Dense",
    "Normalize": "sentence_transformers.models.Normalize",
}
_OLD_FLAGS = {
    "cls": "pooling_mode_cls_token",
    "max": "pooling_mode_max_tokens",
    "mean": "pooling_mode_mean_tokens",
    "mean_sqrt_len_tokens": "pooling_mode_mean_sqrt_len_tokens",
    "weightedmean": "pooling_mode_weightedmean_tokens",
    "lasttoken": "pooling_mode_lasttoken",
}


def _to_pickled(folder: Path) -> None:
    """The folder's model.safetensors rewritten as pytorch_model.bin, as older saves have it."""
    import torch
    from safetensors.torch import load_file

    weights = load_file(str(folder / "model.safetensors"))
    torch.save(weights, folder / "pytorch_model.bin")
    (folder / "model.safetensors").unlink()


def to_hub_layout(folder: Path, family: Family) -> None:
    """Rewrite a current save as the older hub layout, which sentence-transformers still reads."""
    _to_pickled(folder)
    modules = json.loads((folder / "modules.json").read_text())
    for module in modules:
        kind = module["type"].rsplit(".", 1)[-1]
        module["type"] = _OLD_TYPES[kind]
        path = folder / module["path"]
        if kind == "Pooling":
            config = json.loads((path / "config.json").read_text())
            modes = config.pop("pooling_mode")
            modes = (modes,) if isinstance(modes, str) else tuple(modes)
            old = {"word_embedding_dimension": config.pop("embedding_dimension")}
            old.update({flag: mode in modes for mode, flag in _OLD_FLAGS.items()})
            old["include_prompt"] = config.get("include_prompt", True)
            (path / "config.json").write_text(json.dumps(old, indent=2))
        elif kind == "Dense":
            _to_pickled(path)
            config = json.loads((path / "config.json").read_text())
            for key in ("module_input_name", "module_output_name"):
                config.pop(key, None)
            (path / "config.json").write_text(json.dumps(config, indent=2))
    (folder / "modules.json").write_text(json.dumps(modules, indent=2))
    (folder / "sentence_bert_config.json").write_text(
        json.dumps({"max_seq_length": family.max_seq_length, "do_lower_case": False})
    )


CUSTOM_CONFIG = """
from transformers import PretrainedConfig


class TinyEmbedderConfig(PretrainedConfig):
    model_type = "tiny-embedder"

    def __init__(self, vocab_size=600, hidden_size=64, pad_token_id=0, **kwargs):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        super().__init__(pad_token_id=pad_token_id, **kwargs)
"""
CUSTOM_MODELING = '''
import torch
from transformers import PreTrainedModel
from transformers.modeling_outputs import BaseModelOutput

from .configuration_tiny import TinyEmbedderConfig


class TinyEmbedderModel(PreTrainedModel):
    """Custom code: token embeddings mixed by a causal running mean, then a tanh layer."""

    config_class = TinyEmbedderConfig
    base_model_prefix = "tiny"

    def __init__(self, config):
        super().__init__(config)
        self.embed = torch.nn.Embedding(config.vocab_size, config.hidden_size)
        self.mix = torch.nn.Linear(config.hidden_size, config.hidden_size)
        self.post_init()

    def _init_weights(self, module):
        if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
            torch.nn.init.normal_(module.weight, std=0.5)

    def forward(self, input_ids, attention_mask=None, token_type_ids=None, **kwargs):
        x = self.embed(input_ids)
        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
        weights = mask.unsqueeze(-1).to(x.dtype)
        running = torch.cumsum(x * weights, 1) / torch.cumsum(weights, 1).clamp(min=1)
        return BaseModelOutput(last_hidden_state=torch.tanh(self.mix(running)) + x)
'''


CUSTOM_AUTO_MAP = {
    "AutoConfig": "configuration_tiny.TinyEmbedderConfig",
    "AutoModel": "modeling_tiny.TinyEmbedderModel",
}
CUSTOM_FILES = {"configuration_tiny.py": CUSTOM_CONFIG, "modeling_tiny.py": CUSTOM_MODELING}


def build_custom_code(root: Path, builtin_type: str | None = None) -> Path:
    """A model folder that carries its own modeling code (config.json's auto_map), with a BERT
    tokenizer and sentence-transformers modules (mean pooling, Normalize). `builtin_type`:
    config.json also names a model type transformers ships (as jina-embeddings-v2's says
    bert), whose class cannot hold these weights."""
    import torch
    from sentence_transformers import SentenceTransformer, models
    from transformers import AutoConfig, AutoModel

    name = f"custom-code-{builtin_type or 'own'}"
    folder = root / name
    if (folder / "modules.json").is_file():
        return folder
    transformer = root / f".{name}-transformer"
    transformer.mkdir(parents=True, exist_ok=True)
    for file, text in CUSTOM_FILES.items():
        (transformer / file).write_text(text)
    tokenizer = _tokenizer_bert()
    tokenizer.model_max_length = 64
    tokenizer.save_pretrained(transformer)
    own = {"model_type": "tiny-embedder", "auto_map": CUSTOM_AUTO_MAP, "hidden_size": 64}
    own.update(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id)
    (transformer / "config.json").write_text(json.dumps(own))
    torch.manual_seed(3)
    config = AutoConfig.from_pretrained(str(transformer), trust_remote_code=True)
    AutoModel.from_config(config, trust_remote_code=True).save_pretrained(transformer)

    trusted = {"trust_remote_code": True}
    modules = [
        models.Transformer(str(transformer), model_args=trusted, config_args=trusted),
        models.Pooling(64, pooling_mode="mean"),
        models.Normalize(),
    ]
    SentenceTransformer(modules=modules, device="cpu").save(str(folder))
    shutil.rmtree(transformer)
    for file, text in CUSTOM_FILES.items():
        (folder / file).write_text(text)
    # As a hub folder has it: the code is the folder's own, not a load argument.
    st_config = json.loads((folder / "sentence_bert_config.json").read_text())
    for key in ("model_args", "config_args", "model_kwargs", "config_kwargs"):
        st_config.pop(key, None)
    (folder / "sentence_bert_config.json").write_text(json.dumps(st_config, indent=2))
    saved = json.loads((folder / "config.json").read_text())
    saved["auto_map"] = CUSTOM_AUTO_MAP
    if builtin_type is not None:  # with the fields that type's own config reads
        saved.update(model_type=builtin_type, num_hidden_layers=1, num_attention_heads=4)
        saved.update(intermediate_size=128, max_position_embeddings=128)
    (folder / "config.json").write_text(json.dumps(saved, indent=2))
    return folder


CUSTOM_TOKENIZER = '''
from transformers import BertTokenizerFast


class TinyTokenizer(BertTokenizerFast):
    """Custom code: every text is read backwards before it is tokenized."""

    def __call__(self, text=None, *args, **kwargs):
        if isinstance(text, str):
            text = text[::-1]
        elif isinstance(text, (list, tuple)):
            text = [item[::-1] if isinstance(item, str) else item for item in text]
        return super().__call__(text, *args, **kwargs)
'''


def build_custom_tokenizer(root: Path) -> Path:
    """bert-mean (current layout) with a tokenizer of its own code: tokenizer_config.json's
    auto_map names `tokenization_tiny.TinyTokenizer`, which reads every text backwards, so
    its vectors differ from the plain folder's."""
    folder = root / "custom-tokenizer"
    if (folder / "modules.json").is_file():
        return folder
    scratch = root / ".custom-tokenizer"
    shutil.rmtree(scratch, ignore_errors=True)
    shutil.copytree(build("bert-mean", "current", root), scratch)
    (scratch / "tokenization_tiny.py").write_text(CUSTOM_TOKENIZER)
    config = json.loads((scratch / "tokenizer_config.json").read_text())
    config["tokenizer_class"] = "TinyTokenizer"
    config["auto_map"] = {"AutoTokenizer": [None, "tokenization_tiny.TinyTokenizer"]}
    (scratch / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    scratch.rename(folder)
    return folder


def _protobuf_fields(data: bytes) -> list[tuple[int, int, Any]]:
    """(field number, wire type, value) of one protobuf message, top level only: enough to
    read a SentencePiece model's character map without the protobuf library."""
    fields, position = [], 0

    def varint() -> int:
        nonlocal position
        value = shift = 0
        while True:
            byte = data[position]
            position += 1
            value |= (byte & 0x7F) << shift
            shift += 7
            if not byte & 0x80:
                return value

    while position < len(data):
        key = varint()
        number, wire = key >> 3, key & 7
        if wire == 0:
            fields.append((number, wire, varint()))
        elif wire == 1:
            fields.append((number, wire, data[position : position + 8]))
            position += 8
        elif wire == 2:
            size = varint()
            fields.append((number, wire, data[position : position + size]))
            position += size
        elif wire == 5:
            fields.append((number, wire, data[position : position + 4]))
            position += 4
        else:
            raise ValueError(f"protobuf wire type {wire}")
    return fields


def write_hub_xlmr_tokenizer(folder: Path) -> None:
    """An XLM-R tokenizer as the hub's multilingual models carry it (xlm-roberta-base, bge-m3,
    multilingual-e5): a SentencePiece Unigram model (trained here with its nmt_nfkc
    normalization, which needs the `sentencepiece` package), converted as transformers 4 did
    (fairseq's ids: <s> <pad> </s> <unk>, then the pieces, <mask> last; normalizer: the
    precompiled character map and a collapse of repeated spaces; pre-tokenizer: Metaspace), with
    tokenizer_config.json and special_tokens_map.json naming <mask> with lstrip, as theirs do.
    Written into `folder`, over any tokenizer files there."""
    import base64

    proto, processor = _sentencepiece_unigram("nmt_nfkc")
    normalizer_spec = next(value for number, _wire, value in _protobuf_fields(proto) if number == 3)
    charsmap = next(v for n, _w, v in _protobuf_fields(normalizer_spec) if n == 2)
    pieces = [
        [processor.id_to_piece(index), processor.get_score(index)]
        for index in range(1, processor.get_piece_size())  # 0 is SentencePiece's <unk>
    ]
    vocab = [["<s>", 0.0], ["<pad>", 0.0], ["</s>", 0.0], ["<unk>", 0.0], *pieces, ["<mask>", 0.0]]
    mask_id = len(vocab) - 1

    def added(index: int, content: str, lstrip: bool = False) -> dict[str, Any]:
        return {"id": index, "content": content, "single_word": False, "lstrip": lstrip,
                "rstrip": False, "normalized": False, "special": True}  # fmt: skip

    specials = [added(0, "<s>"), added(1, "<pad>"), added(2, "</s>"), added(3, "<unk>"),
                added(mask_id, "<mask>", lstrip=True)]  # fmt: skip
    template = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                   {"Sequence": {"id": "A", "type_id": 0}},
                   {"SpecialToken": {"id": "</s>", "type_id": 0}}],
        "pair": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                 {"Sequence": {"id": "A", "type_id": 0}},
                 {"SpecialToken": {"id": "</s>", "type_id": 0}},
                 {"SpecialToken": {"id": "</s>", "type_id": 0}},
                 {"Sequence": {"id": "B", "type_id": 0}},
                 {"SpecialToken": {"id": "</s>", "type_id": 0}}],
        "special_tokens": {"<s>": {"id": "<s>", "ids": [0], "tokens": ["<s>"]},
                           "</s>": {"id": "</s>", "ids": [2], "tokens": ["</s>"]}},
    }  # fmt: skip
    spec = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": specials,
        "normalizer": {"type": "Sequence", "normalizers": [
            {"type": "Precompiled", "precompiled_charsmap": base64.b64encode(charsmap).decode()},
            {"type": "Replace", "pattern": {"Regex": " {2,}"}, "content": " "},
        ]},
        "pre_tokenizer": {"type": "Metaspace", "replacement": "\u2581",
                          "prepend_scheme": "always", "split": True},
        "post_processor": template,
        "decoder": {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "always",
                    "split": True},
        "model": {"type": "Unigram", "unk_id": 3, "vocab": vocab, "byte_fallback": False},
    }  # fmt: skip
    mask = {"content": "<mask>", "lstrip": True, "normalized": False, "rstrip": False,
            "single_word": False, "special": True}  # fmt: skip
    names = {"bos_token": "<s>", "cls_token": "<s>", "eos_token": "</s>", "mask_token": mask,
             "pad_token": "<pad>", "sep_token": "</s>", "unk_token": "<unk>"}  # fmt: skip
    decoder = {str(t["id"]): {k: v for k, v in t.items() if k != "id"} for t in specials}
    config = {
        **names,
        "mask_token": {"__type": "AddedToken", **mask},  # transformers 4's way of writing it
        "model_max_length": 512,
        "tokenizer_class": "XLMRobertaTokenizer",
        "added_tokens_decoder": decoder,
    }
    for stale in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (folder / stale).unlink(missing_ok=True)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False))
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (folder / "special_tokens_map.json").write_text(json.dumps(names, indent=2))
