"""The server's flags: the contract the operator writes into every Deployment.

One table: each flag's name, its environment twin, how its text is read and written, its default
and what it means. The server builds its command line and its configuration object from it; the
operator renders a spec into flags with it and reads a pod's flags back with it (the warm gate
judges a pod by what its own template asks).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

ENV_PREFIX = "WARMGATE_"

_BOOL_TRUE = {"1", "true", "yes", "on"}
_BOOL_FALSE = {"0", "false", "no", "off"}

# The values the server accepts for its enumerated flags (--device also takes cuda:N). The
# operator's CRD offers these, or the subset it can place a pod for.
DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "float32", "float16", "bfloat16")
POOLINGS = ("mean", "cls", "last", "max", "mean_sqrt_len_tokens", "weightedmean")
PACKINGS = ("auto", "on", "off")
TASKS = ("auto", "embed", "rerank", "classify")
CUDA_GRAPHS = ("auto", "on", "off")
BACKENDS = ("torch", "onnxruntime")
TOKEN_ID_KINDS = ("model", "cl100k_base")
MEMORY_POLICIES = ("refuse", "fit")
LINEAR_KERNELS = ("auto", "onednn", "mkl", "aten")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in _BOOL_TRUE:
        return True
    if lowered in _BOOL_FALSE:
        return False
    raise ValueError("expected true/false, 1/0, yes/no or on/off")


def parse_int_list(text: str) -> tuple[int, ...]:
    parts = [part.strip() for part in text.split(",") if part.strip()]
    if not parts:
        raise ValueError("expected a comma-separated list of integers")
    return tuple(int(part) for part in parts)


def _format(value: Any) -> str:
    if isinstance(value, tuple | list):
        return ",".join(str(item) for item in value)
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


@dataclass(frozen=True)
class Flag:
    name: str  # --max-batch-tokens
    dest: str  # max_batch_tokens (the configuration's field)
    parse: Callable[[str], Any]
    default: Any
    help: str

    @property
    def is_bool(self) -> bool:
        return self.parse is parse_bool

    @property
    def env(self) -> str:
        """The environment twin: `--max-batch-tokens` -> `WARMGATE_MAX_BATCH_TOKENS`."""
        return ENV_PREFIX + self.name.lstrip("-").replace("-", "_").upper()

    def render(self, value: Any) -> str:
        """One command-line item: `--flag=value`, or `--flag` / `--no-flag` for a boolean."""
        if self.is_bool:
            return self.name if value else f"--no-{self.name.lstrip('-')}"
        return f"{self.name}={_format(value)}"


FLAGS: tuple[Flag, ...] = (
    Flag(
        "--model",
        "model",
        str,
        None,
        "local model folder, or Hugging Face id (from HF_HOME's cache, else downloaded)",
    ),
    Flag(
        "--model-revision",
        "model_revision",
        str,
        "main",
        "branch, tag or commit of a hub id (for a folder, a label reported to clients)",
    ),
    Flag("--served-model-name", "served_model_name", str, "", "model name clients send"),
    Flag("--host", "host", str, "0.0.0.0", "bind address"),
    Flag("--port", "port", int, 8080, "bind port (0: any free port)"),
    Flag("--device", "device", str, "auto", "auto, cpu, cuda or cuda:N"),
    Flag("--dtype", "dtype", str, "auto", "auto, float32, float16 or bfloat16"),
    Flag(
        "--pooling",
        "pooling",
        str,
        None,
        "mean, cls, last, max, mean_sqrt_len_tokens or weightedmean (default: the model "
        "folder's own, else mean; last for a decoder)",
    ),
    Flag(
        "--normalize",
        "normalize",
        parse_bool,
        None,
        "L2-normalise embeddings (default: the model folder's own, else yes)",
    ),
    Flag(
        "--trust-remote-code",
        "trust_remote_code",
        parse_bool,
        None,
        "for a model folder that points at its own Python (config.json's or "
        "tokenizer_config.json's auto_map, a custom module): on runs it, off serves "
        "transformers' own class for its model type instead (its vectors may differ from the "
        "author's); unset refuses such a folder, naming both choices",
    ),
    Flag("--max-input-length", "max_input_length", int, None, "max tokens per input"),
    Flag("--max-batch-size", "max_batch_size", int, 32, "max inputs per batch"),
    Flag(
        "--max-client-batch-size",
        "max_client_batch_size",
        int,
        2048,
        "max inputs per request (split across batches; OpenAI's limit is 2048)",
    ),
    Flag(
        "--auto-truncate",
        "auto_truncate",
        parse_bool,
        False,
        "truncate inputs above the token limit instead of refusing them (a request's "
        "`truncate` field wins on the TEI routes)",
    ),
    Flag(
        "--openai-token-ids",
        "openai_token_ids",
        str,
        "cl100k_base",
        "what token ids on the OpenAI route are: cl100k_base (OpenAI's tiktoken ids, what the "
        "OpenAI API means and LangChain's OpenAIEmbeddings sends) or model (the model's own, "
        "TEI's meaning, which the TEI routes always take)",
    ),
    Flag("--max-batch-tokens", "max_batch_tokens", int, 16384, "max padded tokens per batch"),
    Flag("--max-wait-ms", "max_wait_ms", float, 2.0, "max wait for a fuller batch"),
    Flag("--max-concurrent-requests", "max_concurrent_requests", int, 512, "429 above this many"),
    Flag("--payload-limit", "payload_limit", int, 2_000_000, "max request body bytes"),
    Flag(
        "--sequence-buckets",
        "sequence_buckets",
        parse_int_list,
        (32, 64, 128, 256),
        "padded sequence lengths, ascending",
    ),
    Flag(
        "--warmup-batch-sizes",
        "warmup_batch_sizes",
        parse_int_list,
        (1, 8, 32),
        "batch sizes to warm, ascending",
    ),
    Flag("--warmup-profile", "warmup_profile", str, None, "JSON file of observed shapes to warm"),
    Flag("--pad-batch", "pad_batch", parse_bool, True, "pad batches to a planned batch size"),
    Flag("--warmup", "warmup", parse_bool, True, "warm every planned shape before /ready"),
    Flag(
        "--memory-policy",
        "memory_policy",
        str,
        "refuse",
        "a planned shape whose predicted peak memory passes the limit (the container's, or the "
        "GPU's, less a tenth): refuse (the warmup fails, naming it) or fit (the plan is cut "
        "there)",
    ),
    Flag(
        "--warmup-cpus",
        "warmup_cpus",
        float,
        0.0,
        "CPUs the warmup may use on average while the node's other processes are busy (the "
        "pod's CPU request): it sleeps between passes to stay within them, leaving the node's "
        "other cores to the pods serving beside it; 0: never paced",
    ),
    Flag("--drain-seconds", "drain_seconds", float, 15.0, "drain time after SIGTERM"),
    Flag(
        "--request-timeout",
        "request_timeout",
        float,
        60.0,
        "seconds a request may take in all (503 while still queued, 504 once running)",
    ),
    Flag("--body-timeout", "body_timeout", float, 15.0, "seconds to receive a body (408 after)"),
    Flag(
        "--forward-timeout",
        "forward_timeout",
        float,
        30.0,
        "a forward pass running longer counts as a model fault (its requests get 504)",
    ),
    Flag(
        "--fault-threshold",
        "fault_threshold",
        int,
        3,
        "failed or hung forward passes in a row that turn /ready 503",
    ),
    Flag(
        "--fault-restart-seconds",
        "fault_restart_seconds",
        float,
        30.0,
        "seconds of model faults without a good forward pass after which /healthz fails too",
    ),
    Flag(
        "--default-prompt-name",
        "default_prompt_name",
        str,
        None,
        "the model's prompt (config_sentence_transformers.json) put before every input",
    ),
    Flag("--default-prompt", "default_prompt", str, None, "a text put before every input"),
    Flag(
        "--task",
        "task",
        str,
        "auto",
        "auto (what the model's folder says), embed, rerank or classify: what the server does "
        "with the model",
    ),
    Flag("--packing", "packing", str, "auto", "auto, on or off: padding-free linear layers"),
    Flag(
        "--backend",
        "backend",
        str,
        "torch",
        "torch or onnxruntime (CPU, float32): what runs the forward passes",
    ),
    Flag(
        "--compile-cache",
        "compile_cache",
        str,
        None,
        "a folder that keeps the --backend onnxruntime export across restarts (none: no cache)",
    ),
    Flag(
        "--warm-state",
        "warm_state",
        str,
        None,
        "a folder that keeps what a restart reuses: the weight files' sha256 and the linear "
        "kernels measured at load (none: read and measure again)",
    ),
    Flag(
        "--cuda-graphs",
        "cuda_graphs",
        str,
        "auto",
        "auto, on or off: a CUDA graph per planned shape, captured during warmup",
    ),
    Flag(
        "--tokenization-workers",
        "tokenization_workers",
        int,
        None,
        "threads that tokenize side by side (default: 1 on a CPU, up to 4 on a GPU)",
    ),
    Flag("--model-workers", "model_workers", int, None, "forward passes at once, one thread each"),
    Flag("--torch-threads", "torch_threads", int, None, "CPU threads for torch per model worker"),
    # The server's own settings below: the operator writes none of them (the environment of a
    # pod, a developer's or a benchmark's run sets them).
    Flag(
        "--linear",
        "linear",
        str,
        "auto",
        "the packed pass's linear layers on a CPU: auto (oneDNN or MKL, measured at load), "
        "onednn, mkl, or aten (torch's own F.linear)",
    ),
    Flag("--log-level", "log_level", str, "INFO", "DEBUG, INFO, WARNING or ERROR (any case)"),
    Flag(
        "--termination-log",
        "termination_log",
        str,
        "/dev/termination-log",
        "where a failed start writes its reason (Kubernetes shows it as the container's "
        "termination message); nothing is written where the file does not exist",
    ),
    Flag(
        "--runtime-memory",
        "runtime_memory",
        str,
        "/opt/warmgate/runtime-memory.json",
        "what importing the image's torch and server takes, measured when the image was built "
        "(python -m warmgate_server.preflight FILE): read before loading, so that a memory "
        "limit below what loading needs is said at once",
    ),
    Flag(
        "--fault-injection",
        "fault_injection",
        parse_bool,
        False,
        "serve POST /debug/faults, which makes the next forward passes fail or hang (tests "
        "and chaos drills only)",
    ),
)


@dataclass(frozen=True)
class Variable:
    """An environment variable the server reads that is not a flag's twin: one whose name
    Kubernetes or another library gives it."""

    name: str
    dest: str | None
    """The configuration's field it fills; None where a library reads it itself."""
    help: str
    read: Callable[[str], Any] = lambda text: text or None
    """The field's value from the variable's text; None leaves the field as it is."""


def _older_onednn(text: str) -> str | None:
    return "mkl" if text.strip() == "0" else None


ENVIRONMENT: tuple[Variable, ...] = (
    Variable(
        "POD_NAME",
        "pod_name",
        "the pod's name (the downward API's metadata.name, which the operator writes): the "
        "X-Warmgate-Pod header and /ready's pod; without it, the host name",
    ),
    Variable(
        "WARMGATE_ONEDNN",
        "linear",
        "the older spelling of --linear mkl: 0 runs the linear layers with MKL (where "
        "--linear and WARMGATE_LINEAR are not given)",
        _older_onednn,
    ),
    Variable(
        "HF_HOME",
        None,
        "the Hugging Face cache a hub id is read from, as huggingface_hub reads it (named in "
        "the server's messages)",
    ),
    Variable(
        "HF_ENDPOINT",
        None,
        "the hub a missing model is downloaded from, as huggingface_hub reads it",
    ),
    Variable(
        "HF_HUB_OFFLINE",
        None,
        "1: nothing is downloaded, a model missing from the cache fails the start",
    ),
)
BY_NAME: Mapping[str, Flag] = {flag.name: flag for flag in FLAGS}
BY_DEST: Mapping[str, Flag] = {flag.dest: flag for flag in FLAGS}
DEFAULTS: Mapping[str, Any] = {flag.dest: flag.default for flag in FLAGS}


def render_args(
    values: Mapping[str, Any], *, leave_out_defaults: Collection[str] = ()
) -> list[str]:
    """Command-line items for `values` ({dest: value}), in the table's order; None is left out
    (the server's default applies), and so is the value of a flag named in
    `leave_out_defaults` that the server would read as that flag's own default."""
    unknown = (set(values) | set(leave_out_defaults)) - set(BY_DEST)
    if unknown:
        raise KeyError(f"not server flags: {sorted(unknown)}")
    return [
        flag.render(values[flag.dest])
        for flag in FLAGS
        if values.get(flag.dest) is not None
        and not (flag.dest in leave_out_defaults and _reads_as_default(flag, values[flag.dest]))
    ]


def _reads_as_default(flag: Flag, value: Any) -> bool:
    """Whether the server, given `value` for `flag`, reads the flag's default: what it reads
    with the flag left out, where no environment twin is set."""
    if flag.default is None:
        return False
    try:
        return read_args([flag.render(value)]) == {flag.dest: flag.default}
    except (KeyError, ValueError):
        return False


def read_args(args: Sequence[str], environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """{dest: value} as a server started with `args` and `environ` would read them: a flag wins
    over its environment twin. `--flag value`, `--flag=value` and `--no-flag` are understood;
    ValueError names a value that does not parse, KeyError a flag the server does not have."""
    found: dict[str, Any] = {}
    for flag in FLAGS:
        if environ and flag.env in environ:
            found[flag.dest] = _parse(flag, environ[flag.env], flag.env)
    items = list(args)
    index = 0
    while index < len(items):
        item = items[index]
        index += 1
        if not item.startswith("--"):
            continue
        name, eq, text = item.partition("=")
        positive = BY_NAME.get(f"--{name[5:]}") if name.startswith("--no-") else None
        negated = positive is not None and positive.is_bool
        flag = positive if negated else BY_NAME.get(name)
        if flag is None:
            raise KeyError(f"{name} is not a server flag")
        if flag.is_bool and not eq:
            found[flag.dest] = not negated
            continue
        if not eq:
            if index >= len(items):
                raise ValueError(f"{name} needs a value")
            text = items[index]
            index += 1
        found[flag.dest] = _parse(flag, text, name)
    return found


def _parse(flag: Flag, text: str, source: str) -> Any:
    try:
        return flag.parse(text)
    except ValueError as exc:
        raise ValueError(f"{source}={text!r} is not valid: {exc}") from None


def settings(values: Iterable[tuple[str, Any]] | Mapping[str, Any]) -> dict[str, Any]:
    """Every flag's value: the defaults, then `values`."""
    return {**DEFAULTS, **dict(values)}
