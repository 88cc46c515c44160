"""The server's one configuration object, read from command-line flags and WARMGATE_* variables.

The flags are the contract with the operator (`warmgate_contract.flags`: names, environment
twins, defaults; docs/contract.md): it writes them into the Deployment. A flag wins over its
environment twin; a twin wins over the default.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from warmgate_contract.flags import (
    BACKENDS,
    CUDA_GRAPHS,
    DEFAULTS,
    DEVICES,
    DTYPES,
    ENVIRONMENT,
    FLAGS,
    LINEAR_KERNELS,
    LOG_LEVELS,
    MEMORY_POLICIES,
    PACKINGS,
    POOLINGS,
    TASKS,
    TOKEN_ID_KINDS,
)
from warmgate_contract.report import parse_profile as parse_profile_entries
from warmgate_contract.report import shapes_by_count
from warmgate_contract.shapes import Shape


class ConfigError(ValueError):
    """A configuration the server refuses to start with; the message says what to change."""


@dataclass(frozen=True)
class ServerConfig:
    model: str
    """Local model folder, or a Hugging Face id resolved offline from the local cache."""
    model_revision: str = DEFAULTS["model_revision"]
    """Reported in /ready and the X-Warmgate-Revision header; nothing is fetched."""
    served_model_name: str = DEFAULTS["served_model_name"]
    """Name clients use in the OpenAI `model` field; defaults to the last part of `model`."""
    host: str = DEFAULTS["host"]
    port: int = DEFAULTS["port"]
    device: str = DEFAULTS["device"]
    """auto (cuda when available, else cpu), cpu, cuda or cuda:N."""
    dtype: str = DEFAULTS["dtype"]
    """auto (float16 on cuda, float32 on cpu), float32, float16 or bfloat16."""
    pooling: str | None = DEFAULTS["pooling"]
    """One of POOLINGS; None: the model folder's own (model_folder.py), else mean."""
    normalize: bool | None = DEFAULTS["normalize"]
    """Default L2 normalisation (TEI's `normalize` field overrides it per request); None: the
    model folder's own, else yes."""
    trust_remote_code: bool | None = DEFAULTS["trust_remote_code"]
    """For a folder that points at its own Python (auto_map classes, custom modules and
    activations): True runs it; False serves transformers' own class for its model type (if it
    loads the checkpoint exactly); None (unset) refuses the folder at start, naming both."""
    max_input_length: int | None = DEFAULTS["max_input_length"]
    """Tokens per input, special tokens included (None: the model's, up to the largest bucket)."""
    max_batch_size: int = DEFAULTS["max_batch_size"]
    """Inputs per forward pass."""
    max_client_batch_size: int = DEFAULTS["max_client_batch_size"]
    """The most inputs one request may carry (TEI's name); more than a batch holds are split
    across batches and answered in order."""
    auto_truncate: bool = DEFAULTS["auto_truncate"]
    """Truncate inputs above the token limit (default: refuse them with a 4xx, as OpenAI does);
    TEI's per-request `truncate` wins."""
    openai_token_ids: str = DEFAULTS["openai_token_ids"]
    """What token ids on the OpenAI route mean: `model` (the model's vocabulary, as TEI) or
    `cl100k_base` (OpenAI's, as tiktoken makes them; decoded to text, then tokenized)."""
    max_batch_tokens: int = DEFAULTS["max_batch_tokens"]
    """Padded tokens (batch size x bucket) per forward pass; warmup never exceeds it either."""
    max_wait_ms: float = DEFAULTS["max_wait_ms"]
    """How long the batcher waits for more inputs before running a batch that is not full."""
    max_concurrent_requests: int = DEFAULTS["max_concurrent_requests"]
    """Embedding requests in flight at once; one more is answered 429 at once."""
    payload_limit: int = DEFAULTS["payload_limit"]
    """Request body limit in bytes (413 above it)."""
    sequence_buckets: tuple[int, ...] = DEFAULTS["sequence_buckets"]
    warmup_batch_sizes: tuple[int, ...] = DEFAULTS["warmup_batch_sizes"]
    warmup_profile: str | None = DEFAULTS["warmup_profile"]
    """JSON file of observed shapes ({"shapes": [...]}) added to the warmup plan; may be absent."""
    profile_shapes: tuple[Shape, ...] = field(default=())
    """The shapes read from `warmup_profile` at start (read once, validated here)."""
    pad_batch: bool = DEFAULTS["pad_batch"]
    """Pad each batch to the smallest planned batch size that holds it, so every shape is warm."""
    warmup: bool = DEFAULTS["warmup"]
    memory_policy: str = DEFAULTS["memory_policy"]
    """A planned shape whose predicted memory peak is past the budget (the container's limit,
    or the GPU's memory, less 10%): refuse fails the warmup there, naming it; fit cuts the plan
    there and lowers the batcher's token budget and largest batch to the warmed shapes."""
    warmup_cpus: float = DEFAULTS["warmup_cpus"]
    """CPUs the warmup may use on average while the node's other processes are busy
    (pacing.CpuPacer; the operator passes the pod's CPU request); 0: never paced."""
    drain_seconds: float = DEFAULTS["drain_seconds"]
    """After SIGTERM: how long to finish in-flight and queued requests before exiting."""
    request_timeout: float = DEFAULTS["request_timeout"]
    """Deadline of an embedding request from admission: 503 if its inputs were still queued,
    504 if their forward pass was running."""
    body_timeout: float = DEFAULTS["body_timeout"]
    """How long a client may take to send its body (408 after): a slow sender cannot hold an
    admission slot for long."""
    forward_timeout: float = DEFAULTS["forward_timeout"]
    """A forward pass running longer is a model fault: its requests get 504 at once and the
    worker stays out of use until the pass returns."""
    fault_threshold: int = DEFAULTS["fault_threshold"]
    """Model faults (a forward pass raised or hung) in a row that turn /ready 503 (phase
    `unhealthy`); one good forward pass, from traffic or the server's own probe, turns it back."""
    fault_restart_seconds: float = DEFAULTS["fault_restart_seconds"]
    """How long `unhealthy` may last before /healthz fails too, so kubelet restarts the
    container."""
    packing: str = DEFAULTS["packing"]
    """Padding-free forward pass: linear layers run on the real tokens only, attention on the
    padded shape on a CPU, variable-length attention on a CUDA device in half precision.
    auto and on: for BERT-family models (on refuses to start with another); off: the model's
    own padded forward pass. With CUDA graphs, it serves the shapes that have no graph."""
    backend: str = DEFAULTS["backend"]
    """What runs the forward passes. torch: warmgate's packed pass (or the model's own padded
    one); onnxruntime: the model exported to ONNX at start and run by ONNX Runtime on padded
    batches of the planned shapes (CPU, float32 only; a session per thread count, each shape
    run during warmup so its memory plan is made before /ready)."""
    task: str = DEFAULTS["task"]
    """auto, embed, rerank or classify (model_folder.TASKS): what the server does with the model;
    auto takes the folder's own answer and refuses a folder that could be either."""
    compile_cache: str | None = DEFAULTS["compile_cache"]
    """A folder where --backend onnxruntime keeps its export under a key of the weights, the
    model's configuration and the library versions, so a restart with the same model and image
    opens it instead of exporting (ort.py); None: export at every start."""
    warm_state: str | None = DEFAULTS["warm_state"]
    """A folder of what a restart reuses instead of reading or measuring it again (warm_state.py:
    the weight files' sha256, the linear kernels measured at load); None: nothing kept."""
    default_prompt_name: str | None = DEFAULTS["default_prompt_name"]
    """Which of the model's prompts (config_sentence_transformers.json) goes before every
    input (None: the folder's default_prompt_name, if any)."""
    default_prompt: str | None = DEFAULTS["default_prompt"]
    """A text put before every input, instead of any of the model's prompts."""
    cuda_graphs: str = DEFAULTS["cuda_graphs"]
    """A CUDA graph per planned shape (and model worker), captured during warmup and replayed
    for that shape. auto: on a CUDA device, falling back to eager passes (with the reason in
    /ready) when the model cannot be captured; on: a capture that fails fails the warmup; off:
    eager passes."""
    tokenization_workers: int | None = DEFAULTS["tokenization_workers"]
    """Tokenizer threads (None: 1 with --device cpu, else a quarter of the usable CPUs, 1 to 4),
    so that several requests tokenize while the model runs."""
    model_workers: int | None = DEFAULTS["model_workers"]
    """Forward passes that may run at once, each on its own model thread (None: 2 on a CPU with
    at least 2 usable CPUs, else 1). All of them share one copy of the weights."""
    torch_threads: int | None = DEFAULTS["torch_threads"]
    """CPU threads for torch per model worker (None: the usable CPUs divided among the workers;
    usable means this process's CPU affinity capped by its cgroup CPU limit)."""
    linear: str = DEFAULTS["linear"]
    """The packed pass's linear kernels on a CPU (models/linear.py): auto measures oneDNN
    against MKL at load; onednn, mkl or aten are one of them always."""
    log_level: str = DEFAULTS["log_level"]
    termination_log: str = DEFAULTS["termination_log"]
    """Where a failed start writes its reason: Kubernetes' termination message file."""
    runtime_memory: str = DEFAULTS["runtime_memory"]
    """The image's measured runtime memory (preflight.py), read before loading."""
    fault_injection: bool = DEFAULTS["fault_injection"]
    """POST /debug/faults (faults.py): tests and chaos drills only."""
    pod_name: str | None = None
    """POD_NAME (the downward API's): who served a request; None: the host name."""

    @property
    def largest_bucket(self) -> int:
        return self.sequence_buckets[-1]

    @property
    def effective_served_name(self) -> str:
        return self.served_model_name or self.model.rstrip("/").split("/")[-1]


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="warmgate-server",
        description="Embedding server that warms every shape it can serve before /ready.",
        epilog="Every flag has an environment twin: WARMGATE_ plus the flag in upper snake case.",
    )
    for flag in FLAGS:
        if flag.is_bool:
            parser.add_argument(
                flag.name,
                dest=flag.dest,
                action=argparse.BooleanOptionalAction,
                default=None,
                help=flag.help,
            )
        else:
            parser.add_argument(flag.name, dest=flag.dest, type=str, default=None, help=flag.help)
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
    for flag in FLAGS:
        raw, source = args[flag.dest], flag.name
        if raw is None and flag.env in environ:
            raw, source = environ[flag.env], flag.env
        if raw is None:
            continue
        if isinstance(raw, bool):  # --flag / --no-flag
            values[flag.dest] = raw
            continue
        try:
            values[flag.dest] = flag.parse(raw)
        except ValueError as exc:
            raise ConfigError(f"{source}={raw!r} is not valid: {exc}") from None
    values.update(_from_environment(environ, values))
    if not values.get("model"):
        raise ConfigError("no model given: pass --model FOLDER_OR_ID or set WARMGATE_MODEL")
    profile = values.get("warmup_profile")
    if profile:
        values["profile_shapes"] = load_profile_file(str(profile))
    config = ServerConfig(**values)  # type: ignore[arg-type]
    validate(config)
    return config


def _from_environment(
    environ: Mapping[str, str], values: Mapping[str, object]
) -> dict[str, object]:
    """The fields filled by the variables that are not a flag's twin (the contract's
    ENVIRONMENT), where neither a flag nor its twin gave them."""
    found: dict[str, object] = {}
    for variable in ENVIRONMENT:
        raw = environ.get(variable.name)
        if variable.dest is None or raw is None or variable.dest in values:
            continue
        value = variable.read(raw)
        if value is not None:
            found[variable.dest] = value
    return found


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
    if config.pooling is not None and config.pooling not in POOLINGS:
        problems.append(f"--pooling {config.pooling!r}: use one of {', '.join(POOLINGS)}")
    if config.memory_policy not in MEMORY_POLICIES:
        problems.append(
            f"--memory-policy {config.memory_policy!r}: use one of {', '.join(MEMORY_POLICIES)}"
        )
    if config.linear not in LINEAR_KERNELS:
        problems.append(f"--linear {config.linear!r}: use one of {', '.join(LINEAR_KERNELS)}")
    if config.log_level.upper() not in LOG_LEVELS:
        problems.append(f"--log-level {config.log_level!r}: use one of {', '.join(LOG_LEVELS)}")
    if config.packing not in PACKINGS:
        problems.append(f"--packing {config.packing!r}: use one of {', '.join(PACKINGS)}")
    if config.task not in TASKS:
        problems.append(f"--task {config.task!r}: use one of {', '.join(TASKS)}")
    if config.backend not in BACKENDS:
        problems.append(f"--backend {config.backend!r}: use one of {', '.join(BACKENDS)}")
    elif config.backend == "onnxruntime":
        if config.device not in ("cpu", "auto"):
            problems.append("--backend onnxruntime runs on the CPU: use --device cpu")
        if config.dtype not in ("float32", "auto"):
            problems.append("--backend onnxruntime runs float32: use --dtype float32")
        if config.packing == "on":
            problems.append(
                "--backend onnxruntime runs padded batches: use --packing auto or off with it"
            )
        if config.cuda_graphs == "on":
            problems.append("--backend onnxruntime has no CUDA graphs: use --cuda-graphs auto")
    if config.compile_cache and config.backend != "onnxruntime":
        problems.append(
            "--compile-cache keeps the export of --backend onnxruntime: with --backend "
            f"{config.backend} there is nothing to keep"
        )
    if config.default_prompt_name is not None and config.default_prompt is not None:
        problems.append("--default-prompt-name and --default-prompt: give one of them")
    if config.cuda_graphs not in CUDA_GRAPHS:
        problems.append(
            f"--cuda-graphs {config.cuda_graphs!r}: use one of {', '.join(CUDA_GRAPHS)}"
        )
    elif config.cuda_graphs == "on" and config.device == "cpu":
        problems.append("--cuda-graphs on needs a CUDA device: use --device cuda, or auto/off")
    if config.tokenization_workers is not None and not 1 <= config.tokenization_workers <= 64:
        problems.append(f"--tokenization-workers {config.tokenization_workers}: use 1..64")
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
    if config.max_client_batch_size < 1:
        problems.append("--max-client-batch-size must be at least 1")
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
    if config.warmup_cpus < 0:
        problems.append("--warmup-cpus must be >= 0 (0: unpaced)")
    if config.drain_seconds < 0:
        problems.append("--drain-seconds must be >= 0")
    if config.openai_token_ids not in TOKEN_ID_KINDS:
        problems.append(
            f"--openai-token-ids {config.openai_token_ids!r}: use one of "
            + ", ".join(TOKEN_ID_KINDS)
        )
    for name, value in (
        ("--request-timeout", config.request_timeout),
        ("--body-timeout", config.body_timeout),
        ("--forward-timeout", config.forward_timeout),
        ("--fault-restart-seconds", config.fault_restart_seconds),
    ):
        if not value > 0:
            problems.append(f"{name} must be above 0 seconds")
    if config.fault_threshold < 1:
        problems.append("--fault-threshold must be at least 1")
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
    return shapes_by_count(parse_profile_entries(document))
