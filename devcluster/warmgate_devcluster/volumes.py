"""Volumes as folders under the pod's state folder: configMap, secret, emptyDir, downwardAPI,
projected and hostPath. Rewriting them again after a ConfigMap or Secret changes refreshes the
files in place (each file replaced atomically), like kubelet does eventually."""

from __future__ import annotations

import base64
import contextlib
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from warmgate_devcluster.podspec import (
    Lookup,
    MissingReference,
    field_ref_value,
    resource_field_value,
)

log = logging.getLogger(__name__)


@dataclass
class Materialised:
    paths: dict[str, str] = field(default_factory=dict)  # volume name -> host folder
    # ("configmap" | "secret", namespace, name) the files came from, for refreshes.
    references: set[tuple[str, str, str]] = field(default_factory=set)


def _write(path: Path, content: bytes, mode: int | None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        if path.read_bytes() == content:
            return
    except OSError:
        pass
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(content)
    if mode is not None:
        tmp.chmod(mode & 0o777)
    os.replace(tmp, path)


def _data_of(obj: dict, secret: bool) -> dict[str, bytes]:
    out: dict[str, bytes] = {}
    if secret:
        for key, value in (obj.get("data") or {}).items():
            out[key] = base64.b64decode(value)
        for key, value in (obj.get("stringData") or {}).items():
            out[key] = value.encode()
    else:
        for key, value in (obj.get("data") or {}).items():
            out[key] = value.encode()
        for key, value in (obj.get("binaryData") or {}).items():
            out[key] = base64.b64decode(value)
    return out


def _key_files(
    source: dict,
    obj: dict | None,
    secret: bool,
    kind: str,
    namespace: str,
    name: str,
    default_mode: int | None,
) -> dict[str, tuple[bytes, int | None]]:
    if obj is None:
        if source.get("optional"):
            return {}
        raise MissingReference(f"{kind} {namespace}/{name} not found")
    data = _data_of(obj, secret)
    files: dict[str, tuple[bytes, int | None]] = {}
    items = source.get("items")
    if items:
        for item in items:
            if item["key"] not in data:
                if source.get("optional"):
                    continue
                raise MissingReference(f"{kind} {namespace}/{name} has no key {item['key']!r}")
            files[item["path"]] = (data[item["key"]], item.get("mode", default_mode))
    else:
        for key, value in data.items():
            files[key] = (value, default_mode)
    return files


def _downward_files(
    items: list[dict],
    pod: dict,
    pod_ip: str,
    node_allocatable: dict[str, str],
    default_mode: int | None,
) -> dict[str, tuple[bytes, int | None]]:
    files = {}
    for item in items or []:
        if "fieldRef" in item:
            value = field_ref_value(pod, item["fieldRef"]["fieldPath"], pod_ip, "127.0.0.1")
        else:
            ref = item["resourceFieldRef"]
            container = next(
                (c for c in pod["spec"]["containers"] if c["name"] == ref.get("containerName")),
                pod["spec"]["containers"][0],
            )
            value = resource_field_value(
                container, ref["resource"], ref.get("divisor"), node_allocatable
            )
        files[item["path"]] = (value.encode(), item.get("mode", default_mode))
    return files


def _sync_folder(folder: Path, files: dict[str, tuple[bytes, int | None]]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    wanted = set()
    for rel, (content, mode) in files.items():
        target = folder / rel
        wanted.add(target)
        _write(target, content, mode)
    for existing in folder.rglob("*"):
        if existing.is_file() and existing not in wanted and not existing.name.startswith("."):
            with contextlib.suppress(OSError):
                existing.unlink()


def materialise(
    pod: dict,
    pod_dir: Path,
    *,
    pod_ip: str,
    configmaps: Lookup,
    secrets: Lookup,
    node_allocatable: dict[str, str],
    token: str | None = None,
    ca_cert: bytes = b"",
) -> Materialised:
    """Write every volume of `pod`; raise MissingReference when a required source is absent."""
    namespace = pod["metadata"]["namespace"]
    result = Materialised()
    for volume in pod["spec"].get("volumes") or []:
        name = volume["name"]
        folder = pod_dir / "volumes" / name
        if "hostPath" in volume:
            host = Path(volume["hostPath"]["path"])
            if volume["hostPath"].get("type") == "DirectoryOrCreate":
                host.mkdir(parents=True, exist_ok=True)
            result.paths[name] = str(host)
            continue
        result.paths[name] = str(folder)
        if "configMap" in volume:
            source = volume["configMap"]
            result.references.add(("configmap", namespace, source["name"]))
            files = _key_files(
                source,
                configmaps(namespace, source["name"]),
                False,
                "configmap",
                namespace,
                source["name"],
                source.get("defaultMode"),
            )
        elif "secret" in volume:
            source = volume["secret"]
            result.references.add(("secret", namespace, source["secretName"]))
            files = _key_files(
                source,
                secrets(namespace, source["secretName"]),
                True,
                "secret",
                namespace,
                source["secretName"],
                source.get("defaultMode"),
            )
        elif "downwardAPI" in volume:
            source = volume["downwardAPI"]
            files = _downward_files(
                source.get("items"), pod, pod_ip, node_allocatable, source.get("defaultMode")
            )
        elif "projected" in volume:
            files = {}
            default_mode = volume["projected"].get("defaultMode")
            for source in volume["projected"].get("sources") or []:
                if "configMap" in source:
                    ref = source["configMap"]
                    result.references.add(("configmap", namespace, ref["name"]))
                    files.update(
                        _key_files(
                            ref,
                            configmaps(namespace, ref["name"]),
                            False,
                            "configmap",
                            namespace,
                            ref["name"],
                            default_mode,
                        )
                    )
                elif "secret" in source:
                    ref = source["secret"]
                    result.references.add(("secret", namespace, ref["name"]))
                    files.update(
                        _key_files(
                            ref,
                            secrets(namespace, ref["name"]),
                            True,
                            "secret",
                            namespace,
                            ref["name"],
                            default_mode,
                        )
                    )
                elif "downwardAPI" in source:
                    files.update(
                        _downward_files(
                            source["downwardAPI"].get("items"),
                            pod,
                            pod_ip,
                            node_allocatable,
                            default_mode,
                        )
                    )
                elif "serviceAccountToken" in source:
                    files[source["serviceAccountToken"]["path"]] = (
                        (token or "").encode(),
                        default_mode,
                    )
                elif "clusterTrustBundle" in source:
                    files[source["clusterTrustBundle"]["path"]] = (ca_cert, default_mode)
        else:
            if "emptyDir" not in volume:
                log.warning(
                    "volume %s of %s/%s: unsupported type, using an empty folder",
                    name,
                    namespace,
                    pod["metadata"]["name"],
                )
            folder.mkdir(parents=True, exist_ok=True)
            continue
        _sync_folder(folder, files)
    return result
