"""A sentence-transformers model folder with its ONNX export, laid out for Infinity's ONNX
Runtime engine (`infinity_emb v2 --engine optimum`, venv from `make bench-server-infinity-onnx`).

`python bench/server/onnx_export.py SOURCE [OUT] [--check]`: copies SOURCE into OUT (default
~/.cache/warmgate/onnx/<name of SOURCE>) and adds

- `model.onnx`: the export, as `optimum-cli export onnx --task feature-extraction
  --library-name transformers --model SOURCE DIR` makes it (the onnx venv's optimum-cli, offline);
- `model_optimized.onnx`: what Infinity 0.0.78's optimum engine serves.

Why the second file. Infinity 0.0.78 (infinity_emb/transformer/utils_optimum.py) lists every
`*.onnx` under the folder and passes the one it picks to optimum as `file_name` with the
folder's path in front; optimum-onnx matches `file_name` against bare file names, so a local
folder holding only `model.onnx` fails to load ("Could not find any ONNX files with target file
name ..."). Only one path passes a bare name: when a `*_optimized.onnx` lies under the folder
(for an absolute model path, its cache folder *is* the model folder), Infinity loads it and
skips its own optimisation. That optimisation (ORTOptimizer, optimization_level=99, the
transformer fusions, fp32 on a CPU) would also fail today: Infinity passes
`optimize_with_onnxruntime_only`, which optimum-onnx renamed, so it logs a warning and keeps
the export. So `--infinity-file optimized` (the default) writes here what Infinity means to
serve, made by the same ORTOptimizer with the same settings (renamed argument) and saved as
Infinity names it; `--infinity-file plain` writes the export itself under that name (ONNX
Runtime still applies its own graph optimisations, level ALL, when the session starts).

Idempotent: `.warmgate-onnx.json` in OUT records the source's files (sizes and sha256), the
command and the venv's versions; a second run with the same source does nothing.

`--check` then starts Infinity on OUT (127.0.0.1, a free port, offline), times /health, posts
one /embeddings and compares the vector with sentence-transformers' (this interpreter) on the
same text; it needs sentence-transformers, so run it with the project venv.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

ONNX_VENV = Path(os.environ.get("INFINITY_ONNX_VENV", "~/.cache/warmgate/infinity-onnx-venv"))
OUT_ROOT = Path("~/.cache/warmgate/onnx")
STAMP = ".warmgate-onnx.json"
EXPORTED = "model.onnx"
INFINITY_FILE = "model_optimized.onnx"
VERSIONED = ("infinity_emb", "optimum", "optimum_onnx", "onnxruntime", "onnx", "torch",
             "transformers")  # fmt: skip
CHECK_TEXT = "The first request of a cold process pays for lazy initialisation."
TASKS = {
    "feature-extraction": "ORTModelForFeatureExtraction",
    "text-classification": "ORTModelForSequenceClassification",
}
"""optimum-cli's export task, and the optimum class Infinity loads it with: an embedding
model's, or a cross-encoder's (Infinity's OptimumCrossEncoder, its /rerank)."""
# Infinity 0.0.78's OptimizationConfig for a CPU provider (utils_optimum.optimize_model), with
# optimum-onnx's name for its `optimize_with_onnxruntime_only=False`.
_OPTIMIZE = """
import sys
import optimum.onnxruntime
from optimum.onnxruntime import ORTOptimizer
from optimum.onnxruntime.configuration import OptimizationConfig

exported, save_dir, model_class = sys.argv[1:4]
model = getattr(optimum.onnxruntime, model_class).from_pretrained(exported, file_name="model.onnx")
config = OptimizationConfig(
    optimization_level=99, enable_transformers_specific_optimizations=True,
    optimize_for_gpu=False, fp16=False,
)
ORTOptimizer.from_pretrained(model).optimize(
    optimization_config=config, save_dir=save_dir, one_external_file=True
)
"""


def offline_env() -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "INFINITY_ANONYMOUS_USAGE_STATS": "0", "DO_NOT_TRACK": "1"}  # fmt: skip


def export_command(
    source: Path, out: Path, venv: Path = ONNX_VENV, task: str = "feature-extraction"
) -> list[str]:
    """The issue's export (`task`: TASKS). optimum-cli takes the model as `--model` (required
    since optimum 1.x and in optimum-onnx), not as a positional argument."""
    return [str(venv.expanduser() / "bin" / "optimum-cli"), "export", "onnx",
            "--task", task, "--library-name", "transformers",
            "--model", str(source), str(out)]  # fmt: skip


def fingerprint(folder: Path) -> dict[str, list[Any]]:
    """Every file of the folder (hidden ones and ONNX files aside): [size, sha256]."""
    found = {}
    for path in sorted(folder.rglob("*")):
        relative = path.relative_to(folder)
        if not path.is_file() or any(part.startswith(".") for part in relative.parts):
            continue
        if path.name.endswith((".onnx", ".onnx_data")):
            continue
        digest = hashlib.sha256()
        with open(path, "rb") as handle:
            while chunk := handle.read(1 << 22):
                digest.update(chunk)
        found[relative.as_posix()] = [path.stat().st_size, digest.hexdigest()]
    return found


def venv_versions(venv: Path = ONNX_VENV) -> dict[str, str]:
    """The versions of the packages that make the files, from the venv's dist-info names."""
    found = {}
    for site in (venv.expanduser() / "lib").glob("python3*/site-packages"):
        for info in site.glob("*.dist-info"):
            name, _, version = info.name.removesuffix(".dist-info").partition("-")
            if name.lower().replace("-", "_") in VERSIONED:
                found[name.lower().replace("-", "_")] = version
    return dict(sorted(found.items()))


def recorded(out: Path) -> dict[str, Any] | None:
    try:
        return json.loads((out / STAMP).read_text())
    except (OSError, ValueError):
        return None


def export(
    source: Path,
    out: Path | None = None,
    *,
    venv: Path = ONNX_VENV,
    infinity_file: str = "optimized",
    force: bool = False,
    log: Callable[[str], None] = print,
    task: str = "feature-extraction",
) -> Path:
    """OUT: a copy of SOURCE with `model.onnx` and Infinity's `model_optimized.onnx` (see the
    module's doc); does nothing when OUT already holds them for the same source files.
    `task`: TASKS (a cross-encoder's is text-classification)."""
    if infinity_file not in ("optimized", "plain"):
        raise ValueError(f"infinity_file must be optimized or plain, not {infinity_file!r}")
    if task not in TASKS:
        raise ValueError(f"task must be one of {', '.join(TASKS)}, not {task!r}")
    source = source.expanduser().resolve()
    out = (out or OUT_ROOT / source.name).expanduser().resolve()
    cli = Path(export_command(source, out, venv, task)[0])
    if not cli.exists():
        raise FileNotFoundError(f"{cli} not found: run `make bench-server-infinity-onnx`")
    if not (source / "config.json").is_file():
        raise FileNotFoundError(f"{source} is not a model folder (no config.json)")
    wanted = {
        "source": str(source),
        "files": fingerprint(source),
        "command": " ".join(export_command(source, Path("<out>"), venv, task)),
        "infinity_file": infinity_file,
        "versions": venv_versions(venv),
    }
    done = recorded(out)
    same = done is not None and {key: done.get(key) for key in wanted} == wanted
    if not force and same and (out / EXPORTED).is_file() and (out / INFINITY_FILE).is_file():
        log(f"{out}: up to date")
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.with_name(f".{out.name}.staging-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(source, staging, ignore=shutil.ignore_patterns(".*", "*.onnx", "*.onnx_data"))
    timings = {}
    try:
        with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}.work-") as work:
            exported = Path(work) / "export"
            command = export_command(source, exported, venv, task)
            log("$ HF_HUB_OFFLINE=1 " + " ".join(command))
            started = time.monotonic()
            _run(command)
            timings["export_s"] = round(time.monotonic() - started, 1)
            if infinity_file == "optimized":
                optimized = Path(work) / "optimized"
                command = [str(venv.expanduser() / "bin" / "python"), "-c", _OPTIMIZE,
                           str(exported), str(optimized), TASKS[task]]  # fmt: skip
                log("$ ORTOptimizer, Infinity's settings (optimization_level=99, CPU, fp32)")
                started = time.monotonic()
                _run(command)
                timings["optimize_s"] = round(time.monotonic() - started, 1)
                _move_model(optimized, "model_optimized", staging, "model_optimized")
            _move_model(exported, "model", staging, "model")
            if infinity_file == "plain":
                _link_or_copy(staging / EXPORTED, staging / INFINITY_FILE)
        (staging / STAMP).write_text(json.dumps({**wanted, **timings}, indent=1) + "\n")
        if out.exists():
            old = out.with_name(f".{out.name}.old-{os.getpid()}")
            out.rename(old)
            staging.rename(out)
            shutil.rmtree(old)
        else:
            staging.rename(out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    log(f"{out}: {EXPORTED} and {INFINITY_FILE} ({infinity_file}) {timings}")
    return out


def _run(command: list[str]) -> None:
    result = subprocess.run(command, env=offline_env(), capture_output=True, text=True)
    if result.returncode != 0:
        tail = (result.stdout + result.stderr)[-3000:]
        raise RuntimeError(f"{command[0]} exited {result.returncode}:\n{tail}")


def _move_model(folder: Path, stem: str, into: Path, new_stem: str) -> None:
    """Moves `stem.onnx` and its external data files (`stem.onnx_data`, `stem.onnx.data`),
    which the ONNX file names relative to itself, so they keep their names."""
    moved = False
    for path in folder.iterdir():
        if path.name == f"{stem}.onnx" or path.name.startswith(f"{stem}.onnx"):
            target = into / (new_stem + path.name[len(stem) :])
            shutil.move(str(path), target)
            moved = True
    if not moved:
        raise FileNotFoundError(f"no {stem}.onnx in {folder}: {sorted(os.listdir(folder))}")


def _link_or_copy(source: Path, target: Path) -> None:
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


def pooling_of(folder: Path) -> str:
    """Infinity's --pooling-method for a sentence-transformers folder. Its optimum engine
    pools the CLS token unless told `mean` (`auto` means CLS there), so say it."""
    try:
        config = json.loads((folder / "1_Pooling" / "config.json").read_text())
    except (OSError, ValueError):
        return "mean"
    return "mean" if config.get("pooling_mode_mean_tokens") else "cls"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def infinity_command(
    folder: Path,
    port: int,
    venv: Path = ONNX_VENV,
    served_name: str = "model",
    extra: tuple[str, ...] = (),
) -> list[str]:
    return [str(venv.expanduser() / "bin" / "infinity_emb"), "v2", "--model-id", str(folder),
            "--served-model-name", served_name, "--engine", "optimum", "--device", "cpu",
            "--pooling-method", pooling_of(folder), "--host", "127.0.0.1", "--port", str(port),
            "--batch-size", "32", *extra]  # fmt: skip


def check(folder: Path, venv: Path = ONNX_VENV, timeout_s: float = 600) -> dict[str, Any]:
    """Infinity on `folder`: seconds to /health 200, one /embeddings, its cosine against
    sentence-transformers on the same text. Stops Infinity (its pid) before returning."""
    import numpy as np
    from sentence_transformers import SentenceTransformer

    port = free_port()
    command = infinity_command(folder, port, venv)
    log_path = folder.with_name(folder.name + ".infinity.log")
    result: dict[str, Any] = {"command": " ".join(command), "log": str(log_path)}
    started = time.monotonic()
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, env=offline_env(), stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        while True:
            if process.poll() is not None:
                tail = log_path.read_text(errors="replace")[-2000:]
                raise RuntimeError(f"infinity exited ({process.returncode}):\n{tail}")
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() - started > timeout_s:
                raise RuntimeError(f"infinity was not healthy within {timeout_s:g} s")
            time.sleep(0.25)
        result["healthy_s"] = round(time.monotonic() - started, 1)
        body = json.dumps({"model": "model", "input": [CHECK_TEXT]}).encode()
        request = urllib.request.Request(
            url + "/embeddings", data=body, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=120) as response:
            served = np.asarray(json.load(response)["data"][0]["embedding"], dtype=np.float64)
    finally:
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(30)
        result["pid"] = process.pid
    log_text = log_path.read_text(errors="replace")
    result["loaded"] = "Optimized model found at" in log_text
    result["warnings"] = [line.strip() for line in log_text.splitlines() if "WARN" in line][:10]
    reference = SentenceTransformer(str(folder), device="cpu").encode([CHECK_TEXT])[0]
    reference = np.asarray(reference, dtype=np.float64)
    cosine = served @ reference / (np.linalg.norm(served) * np.linalg.norm(reference))
    result["cosine"] = float(cosine)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", type=Path, help="a local sentence-transformers model folder")
    parser.add_argument("out", type=Path, nargs="?", help=f"default {OUT_ROOT}/<source name>")
    parser.add_argument("--venv", type=Path, default=ONNX_VENV)
    parser.add_argument("--infinity-file", choices=("optimized", "plain"), default="optimized")
    parser.add_argument("--force", action="store_true", help="export again even if up to date")
    parser.add_argument("--check", action="store_true", help="serve it with Infinity, compare")
    args = parser.parse_args()
    out = export(
        args.source, args.out, venv=args.venv, infinity_file=args.infinity_file, force=args.force
    )
    if args.check:
        found = check(out, args.venv)
        print(json.dumps(found, indent=1))
        return 0 if found["cosine"] >= 0.9999 else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
