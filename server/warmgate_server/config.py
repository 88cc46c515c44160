"""The server's one configuration object, read from command-line flags and WARMGATE_* variables.

The flag names are the contract with the operator (docs/contract.md): it writes them into the
Deployment. A flag wins over its environment twin; a twin wins over the default.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from .shapes import Shape

ENV_PREFIX = "WARMGATE_"
DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "float32", "float16", "bfloat16")
POOLINGS = ("mean", "cls")
PACKINGS = ("auto", "on", "off")


class ConfigError(ValueError):
    """A configuration the server refuses to start with; the message says what to change."""


@dataclass(frozen=True)
class ServerConfig:
    model: str
    """Local model folder, or a Hugging Face id resolved offline from the local cache."""
    model_revision: str = "main"
    """Reported in /ready and the X-Warmgate-Revision header; nothing is fetched."""
    served_model_name: str = ""
    """Name clients use in the OpenAI `model` field; defaults to the last part of `model`."""
    host: str = "0.0.0.0"
    port: int = 8080
    device: str = "auto"
    """auto (cuda when available, else cpu), cpu, cuda or cuda:N."""
    dtype: str = "auto"
    """auto (float16 on cuda, float32 on cpu), float32, float16 or bfloat16."""
    pooling: str = "mean"
    normalize: bool = True
    """Default L2 normalisation (TEI's `normalize` field overrides it per request)."""
    max_input_length: int | None = None
    """Tokens per input, special tokens included (None: the model's, up to the largest bucket)."""
    max_batch_size: int = 32
    """Inputs per forward pass, and the most inputs one request may carry."""
    max_batch_tokens: int = 16384
    """Padded tokens (batch size x bucket) per forward pass; warmup never exceeds it either."""
    max_wait_ms: float = 2.0
    """How long the batcher waits for more inputs before running a batch that is not full."""
    max_concurrent_requests: int = 512
    """Embedding requests in flight at once; one more is answered 429 at once."""
    payload_limit: int = 2_000_000
    """Request body limit in bytes (413 above it)."""
    sequence_buckets: tuple[int, ...] = (32, 64, 128, 256)
    warmup_batch_sizes: tuple[int, ...] = (1, 8, 32)
    warmup_profile: str | None = None
    """JSON file of observed shapes ({"shapes": [...]}) added to the warmup plan; may be absent."""
    profile_shapes: tuple[Shape, ...] = field(default=())
    """The shapes read from `warmup_profile` at start (read once, validated here)."""
    pad_batch: bool = True
    """Pad each batch to the smallest planned batch size that holds it, so every shape is warm."""
    warmup: bool = True
    drain_seconds: float = 15.0
    """After SIGTERM: how long to finish in-flight and queued requests before exiting."""
    packing: str = "auto"
    """Padding-free forward pass: linear layers run on the real tokens only, attention on the
    padded shape. auto: on for BERT-family models on a CPU; on: wherever the model allows;
    off: the model's own padded forward pass."""
    model_workers: int | None = None
    """Forward passes that may run at once, each on its own model thread (None: 2 on a CPU with
    at least 2 usable CPUs, else 1). All of them share one copy of the weights."""
    torch_threads: int | None = None
    """CPU threads for torch per model worker (None: the usable CPUs divided among the workers;
    usable means this process's CPU affinity capped by its cgroup CPU limit)."""

    @property
    def largest_bucket(self) -> int:
        return self.sequence_buckets[-1]

    @property
    def effective_served_name(self) -> str:
        return self.served_model_name or self.model.rstrip("/").split("/")[-1]


def _int_list(text: str) -> tuple[int, ...]:
    parts = [part.strip() for part in text.split(",") if part.strip()]
    if not parts:
        raise ValueError("expected a comma-separated list of integers")
    return tuple(int(part) for part in parts)


_BOOL_TRUE = {"1", "true", "yes", "on"}
_BOOL_FALSE = {"0", "false", "no", "off"}


def _bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in _BOOL_TRUE:
        return True
    if lowered in _BOOL_FALSE:
        return False
    raise ValueError("expected true/false, 1/0, yes/no or on/off")


# (flag, dest, parser of text, help). Booleans take --x/--no-x; their twins take true/false.
_OPTIONS: tuple[tuple[str, str, object, str], ...] = (
    ("--model", "model", str, "local model folder or Hugging Face id (offline cache)"),
    ("--model-revision", "model_revision", str, "revision label reported to clients"),
    ("--served-model-name", "served_model_name", str, "model name clients send"),
    ("--host", "host", str, "bind address"),
    ("--port", "port", int, "bind port (0: any free port)"),
    ("--device", "device", str, "auto, cpu, cuda or cuda:N"),
    ("--dtype", "dtype", str, "auto, float32, float16 or bfloat16"),
    ("--pooling", "pooling", str, "mean or cls"),
    ("--normalize", "normalize", bool, "L2-normalise embeddings by default"),
    ("--max-input-length", "max_input_length", int, "max tokens per input"),
    ("--max-batch-size", "max_batch_size", int, "max inputs per batch and per request"),
    ("--max-batch-tokens", "max_batch_tokens", int, "max padded tokens per batch"),
    ("--max-wait-ms", "max_wait_ms", float, "max wait for a fuller batch"),
    ("--max-concurrent-requests", "max_concurrent_requests", int, "429 above this many"),
    ("--payload-limit", "payload_limit", int, "max request body bytes"),
    ("--sequence-buckets", "sequence_buckets", _int_list, "padded sequence lengths, ascending"),
    ("--warmup-batch-sizes", "warmup_batch_sizes", _int_list, "batch sizes to warm, ascending"),
    ("--warmup-profile", "warmup_profile", str, "JSON file of observed shapes to warm too"),
    ("--pad-batch", "pad_batch", bool, "pad batches to the smallest planned batch size"),
    ("--warmup", "warmup", bool, "warm every planned shape before /ready"),
    ("--drain-seconds", "drain_seconds", float, "drain time after SIGTERM"),
    ("--packing", "packing", str, "auto, on or off: padding-free linear layers"),
    ("--model-workers", "model_workers", int, "forward passes at once, one thread each"),
    ("--torch-threads", "torch_threads", int, "CPU threads for torch per model worker"),
)


def env_name(flag: str) -> str:
    """`--max-batch-tokens` -> `WARMGATE_MAX_BATCH_TOKENS`."""
    return ENV_PREFIX + flag.lstrip("-").replace("-", "_").upper()


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="warmgate-server",
        description="Embedding server that warms every shape it can serve before /ready.",
        epilog="Every flag has an environment twin: WARMGATE_ plus the flag in upper snake case.",
    )
    for flag, dest, kind, help_text in _OPTIONS:
        if kind is bool:
            parser.add_argument(
                flag, dest=dest, action=argparse.BooleanOptionalAction, default=None, help=help_text
            )
        else:
            parser.add_argument(flag, dest=dest, type=str, default=None, help=help_text)
    return parser


def parse_config(
    argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
) -> ServerConfig:
    """Build the config from flags and WARMGATE_* variables, or raise ConfigError saying why.

    argparse itself exits with status 2 on an unknown flag, as every CLI does.
    """
    environ = os.environ if environ is None else environ
    args = vars(_build_parser().parse_args(argv))
    values: dict[str, object] = {}
    for flag, dest, kind, _help in _OPTIONS:
        raw = args[dest]
        source = flag
        if raw is None and env_name(flag) in environ:
            raw = environ[env_name(flag)]
            source = env_name(flag)
        if raw is None:
            continue
        if kind is bool and isinstance(raw, bool):
            values[dest] = raw
            continue
        try:
            values[dest] = (_bool if kind is bool else kind)(raw)  # type: ignore[operator]
        except ValueError as exc:
            raise ConfigError(f"{source}={raw!r} is not valid: {exc}") from None
    if not values.get("model"):
        raise ConfigError("no model given: pass --model FOLDER_OR_ID or set WARMGATE_MODEL")
    profile = values.get("warmup_profile")
    if profile:
        values["profile_shapes"] = load_profile_file(str(profile))
    config = ServerConfig(**values)  # type: ignore[arg-type]
    validate(config)
    return config


def _ascending(values: tuple[int, ...]) -> bool:
    return all(a < b for a, b in itertools.pairwise(values))


def validate(config: ServerConfig) -> None:
    """Reject combinations that cannot work, saying what to change."""
    problems: list[str] = []
    device_ok = config.device in DEVICES or re.fullmatch(r"cuda:\d+", config.device)
    if not device_ok:
        problems.append(f"--device {config.device!r}: use one of auto, cpu, cuda, cuda:N")
    if config.dtype not in DTYPES:
        problems.append(f"--dtype {config.dtype!r}: use one of {', '.join(DTYPES)}")
    if config.pooling not in POOLINGS:
        problems.append(f"--pooling {config.pooling!r}: use one of {', '.join(POOLINGS)}")
    if config.packing not in PACKINGS:
        problems.append(f"--packing {config.packing!r}: use one of {', '.join(PACKINGS)}")
    if not 0 <= config.port <= 65535:
        problems.append(f"--port {config.port}: use 0..65535")
    buckets = config.sequence_buckets
    if not buckets or min(buckets) < 2 or not _ascending(buckets):
        problems.append(
            f"--sequence-buckets {','.join(map(str, buckets))}: give strictly ascending lengths "
            "of at least 2 tokens, e.g. 32,64,128,256"
        )
    if config.max_batch_size < 1:
        problems.append("--max-batch-size must be at least 1")
    sizes = config.warmup_batch_sizes
    if not sizes or min(sizes) < 1 or not _ascending(sizes):
        problems.append(
            f"--warmup-batch-sizes {','.join(map(str, sizes))}: give strictly ascending "
            "positive sizes, e.g. 1,8,32"
        )
    elif max(sizes) > config.max_batch_size:
        problems.append(
            f"--warmup-batch-sizes has {max(sizes)}, above --max-batch-size "
            f"{config.max_batch_size}: raise --max-batch-size or drop that size"
        )
    if buckets and config.max_batch_tokens < buckets[-1]:
        problems.append(
            f"--max-batch-tokens {config.max_batch_tokens} is below the largest bucket "
            f"{buckets[-1]}: one input of that length would not fit; raise --max-batch-tokens "
            "or drop the bucket"
        )
    if (
        config.pad_batch
        and sizes
        and buckets
        and min(sizes) >= 1
        and sizes[0] * buckets[-1] > config.max_batch_tokens
    ):
        problems.append(
            f"--pad-batch needs a warmed batch size for every bucket, but {sizes[0]} x "
            f"{buckets[-1]} > --max-batch-tokens {config.max_batch_tokens}: add a smaller "
            "warmup batch size (e.g. 1) or raise --max-batch-tokens"
        )
    if config.max_input_length is not None:
        if config.max_input_length < 2:
            problems.append("--max-input-length must be at least 2 (special tokens)")
        elif buckets and config.max_input_length > buckets[-1]:
            problems.append(
                f"--max-input-length {config.max_input_length} is above the largest bucket "
                f"{buckets[-1]}: add a bucket >= {config.max_input_length} to "
                "--sequence-buckets or lower --max-input-length"
            )
    if config.max_wait_ms < 0:
        problems.append("--max-wait-ms must be >= 0")
    if config.max_concurrent_requests < 1:
        problems.append("--max-concurrent-requests must be at least 1")
    if config.payload_limit < 1024:
        problems.append("--payload-limit must be at least 1024 bytes")
    if config.drain_seconds < 0:
        problems.append("--drain-seconds must be >= 0")
    if config.torch_threads is not None and config.torch_threads < 1:
        problems.append("--torch-threads must be at least 1")
    if config.model_workers is not None and config.model_workers < 1:
        problems.append("--model-workers must be at least 1")
    if problems:
        raise ConfigError("; ".join(problems))


def load_profile_file(path: str) -> tuple[Shape, ...]:
    """Read a warmup profile. Missing or empty: no shapes. Malformed: ConfigError."""
    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
    except FileNotFoundError:
        return ()
    except OSError as exc:
        raise ConfigError(f"--warmup-profile {path}: cannot read it: {exc}") from None
    if not text.strip():
        return ()
    try:
        document = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"--warmup-profile {path}: not valid JSON ({exc}); expected "
            '{"shapes": [{"batch_size": 8, "seq_len": 64, "count": 10}]}'
        ) from None
    try:
        return parse_profile(document)
    except ValueError as exc:
        raise ConfigError(f"--warmup-profile {path}: {exc}") from None


def parse_profile(document: object) -> tuple[Shape, ...]:
    """The shapes of a profile document (docs/contract.md), most frequent first."""
    if not isinstance(document, dict) or not isinstance(document.get("shapes", []), list):
        raise ValueError('expected an object {"shapes": [...]}')
    entries = []
    for position, entry in enumerate(document.get("shapes", [])):
        if not isinstance(entry, dict):
            raise ValueError(f"shapes[{position}] is not an object")
        batch_size, seq_len = entry.get("batch_size"), entry.get("seq_len")
        count = entry.get("count", 0)
        valid = all(
            isinstance(value, int) and not isinstance(value, bool)
            for value in (batch_size, seq_len, count)
        )
        if not valid or batch_size < 1 or seq_len < 1 or count < 0:
            raise ValueError(
                f"shapes[{position}] needs positive integers batch_size and seq_len "
                "(and a non-negative integer count)"
            )
        entries.append((count, Shape(batch_size, seq_len)))
    entries.sort(key=lambda item: (-item[0], item[1]))
    seen: dict[Shape, None] = {}
    for _count, shape in entries:
        seen.setdefault(shape, None)
    return tuple(seen)
