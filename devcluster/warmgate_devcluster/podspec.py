"""Pure functions that turn a pod spec into what a local process needs: environment (literal,
$(VAR) expansion, downward API, ConfigMap and Secret references), mount-path rewriting and
resource quantities. No I/O: ConfigMaps and Secrets come in as lookups."""

from __future__ import annotations

import base64
import math
import re
from collections.abc import Callable
from decimal import Decimal, InvalidOperation

Lookup = Callable[[str, str], dict | None]  # (namespace, name) -> object or None

_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL = {
    "n": Decimal("1e-9"),
    "u": Decimal("1e-6"),
    "m": Decimal("1e-3"),
    "": Decimal(1),
    "k": Decimal(10**3),
    "M": Decimal(10**6),
    "G": Decimal(10**9),
    "T": Decimal(10**12),
    "P": Decimal(10**15),
    "E": Decimal(10**18),
}
_QUANTITY = re.compile(r"^([+-]?[0-9.]+(?:[eE][+-]?[0-9]+)?)([a-zA-Z]*)$")


class MissingReference(Exception):
    """A ConfigMap, Secret or key the pod needs does not exist (kubelet keeps retrying)."""


def parse_quantity(text: str | int | float) -> Decimal:
    match = _QUANTITY.match(str(text).strip())
    if not match:
        raise ValueError(f"not a quantity: {text!r}")
    number, suffix = match.groups()
    try:
        value = Decimal(number)
    except InvalidOperation as exc:
        raise ValueError(f"not a quantity: {text!r}") from exc
    if suffix in _BINARY:
        return value * _BINARY[suffix]
    if suffix in _DECIMAL:
        return value * _DECIMAL[suffix]
    raise ValueError(f"unknown quantity suffix in {text!r}")


def resource_field_value(
    container: dict, resource: str, divisor: str | None, node_allocatable: dict[str, str]
) -> str:
    """Like kubelet: limits fall back to the node's allocatable; results round up."""
    kind, _, name = resource.partition(".")
    resources = container.get("resources", {}) or {}
    quantity = (resources.get(kind) or {}).get(name)
    if quantity is None and kind == "limits":
        quantity = node_allocatable.get(name)
    if quantity is None and kind == "requests":
        quantity = "0"
    value = parse_quantity(quantity)
    scale = parse_quantity(divisor or "1")
    if scale == 0:
        scale = Decimal(1)
    return str(math.ceil(value / scale))


def field_ref_value(pod: dict, field_path: str, pod_ip: str, host_ip: str) -> str:
    meta = pod.get("metadata", {})
    spec = pod.get("spec", {})
    simple = {
        "metadata.name": meta.get("name", ""),
        "metadata.namespace": meta.get("namespace", ""),
        "metadata.uid": meta.get("uid", ""),
        "spec.nodeName": spec.get("nodeName", ""),
        "spec.serviceAccountName": spec.get("serviceAccountName", ""),
        "status.podIP": pod_ip,
        "status.podIPs": pod_ip,
        "status.hostIP": host_ip,
        "status.hostIPs": host_ip,
    }
    if field_path in simple:
        return simple[field_path]
    match = re.match(r"^metadata\.(labels|annotations)\['(.+)'\]$", field_path)
    if match:
        return (meta.get(match.group(1)) or {}).get(match.group(2), "")
    if field_path in ("metadata.labels", "metadata.annotations"):
        items = meta.get(field_path.split(".")[1]) or {}
        return "\n".join(f'{k}="{v}"' for k, v in sorted(items.items()))
    raise ValueError(f"unsupported fieldRef {field_path!r}")


_VAR = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes $(VAR) expansion: known names are replaced, $$ escapes, others stay."""

    def replace(match: re.Match) -> str:
        if match.group(0) == "$$":
            return "$"
        name = match.group(1)
        return env[name] if name in env else match.group(0)

    return _VAR.sub(replace, text)


def _config_data(obj: dict, secret: bool) -> dict[str, str]:
    data = dict(obj.get("data") or {})
    if secret:
        data = {k: base64.b64decode(v).decode(errors="replace") for k, v in data.items()}
        data.update(obj.get("stringData") or {})
    else:
        for key, value in (obj.get("binaryData") or {}).items():
            data[key] = base64.b64decode(value).decode(errors="replace")
    return data


def container_env(
    pod: dict,
    container: dict,
    *,
    pod_ip: str,
    host_ip: str,
    base: dict[str, str],
    configmaps: Lookup,
    secrets: Lookup,
    node_allocatable: dict[str, str],
    mounts: list[tuple[str, str]] = (),
) -> dict[str, str]:
    """The process environment: `base`, then envFrom, then env (in order, with expansion).
    Values the pod spec sets are pointed at volume folders (`rewrite`); inherited ones
    (`base`) are host values and are left alone."""
    namespace = pod["metadata"]["namespace"]
    env = dict(base)
    from_spec: set[str] = set()

    def put(name: str, value: str) -> None:
        env[name] = value
        from_spec.add(name)

    for source in container.get("envFrom") or []:
        prefix = source.get("prefix", "")
        for kind, lookup, secret in (
            ("configMapRef", configmaps, False),
            ("secretRef", secrets, True),
        ):
            ref = source.get(kind)
            if not ref:
                continue
            obj = lookup(namespace, ref["name"])
            if obj is None:
                if ref.get("optional"):
                    continue
                raise MissingReference(f"{kind} {namespace}/{ref['name']} not found")
            for key, value in _config_data(obj, secret).items():
                put(prefix + key, value)
    for item in container.get("env") or []:
        name = item["name"]
        if "valueFrom" not in item:
            put(name, expand(item.get("value", ""), env))
            continue
        source = item["valueFrom"]
        if "fieldRef" in source:
            put(name, field_ref_value(pod, source["fieldRef"]["fieldPath"], pod_ip, host_ip))
        elif "resourceFieldRef" in source:
            ref = source["resourceFieldRef"]
            target = container
            if ref.get("containerName"):
                target = next(
                    (c for c in pod["spec"]["containers"] if c["name"] == ref["containerName"]),
                    container,
                )
            put(
                name,
                resource_field_value(target, ref["resource"], ref.get("divisor"), node_allocatable),
            )
        else:
            for kind, lookup, secret in (
                ("configMapKeyRef", configmaps, False),
                ("secretKeyRef", secrets, True),
            ):
                ref = source.get(kind)
                if not ref:
                    continue
                obj = lookup(namespace, ref["name"])
                data = _config_data(obj, secret) if obj is not None else None
                if data is None or ref["key"] not in data:
                    if ref.get("optional"):
                        break
                    raise MissingReference(f"{kind} {namespace}/{ref['name']}[{ref['key']}]")
                put(name, data[ref["key"]])
    for name in from_spec:
        env[name] = rewrite(env[name], mounts)
    return env


def mount_table(container: dict, volume_paths: dict[str, str]) -> list[tuple[str, str]]:
    """(mountPath, host path) pairs, longest mountPath first, for `rewrite`."""
    table = []
    for mount in container.get("volumeMounts") or []:
        host = volume_paths.get(mount["name"])
        if host is None:
            continue
        if mount.get("subPath"):
            host = host.rstrip("/") + "/" + mount["subPath"]
        table.append((mount["mountPath"].rstrip("/") or "/", host))
    table.sort(key=lambda pair: len(pair[0]), reverse=True)
    return table


def rewrite(value: str, mounts: list[tuple[str, str]]) -> str:
    """Our stand-in for mounts: a value that starts with a mountPath (at a path boundary)
    is pointed at the host folder that holds the volume."""
    for mount_path, host in mounts:
        if value == mount_path:
            return host
        if value.startswith(mount_path + "/"):
            return host + value[len(mount_path) :]
        # Flags like --config=/etc/app/config.yaml carry the path after '='.
        if "=" in value:
            flag, _, rest = value.partition("=")
            if rest == mount_path or rest.startswith(mount_path + "/"):
                return f"{flag}={host}{rest[len(mount_path) :]}"
    return value


def container_argv(
    container: dict,
    image_entry: dict,
    env: dict[str, str],
    mounts: list[tuple[str, str]] = (),
) -> list[str]:
    """Kubernetes semantics: `command` replaces the image entrypoint; `args` replace the
    image's default args; the pod's words see $(VAR) expansion and mount rewriting (the image
    map's words are host paths already and are left alone)."""
    command = container.get("command")
    args = container.get("args")

    def from_spec(words) -> list[str]:
        return [rewrite(expand(str(word), env), mounts) for word in words or []]

    if command:
        return from_spec(command) + from_spec(args)
    entrypoint = [str(word) for word in image_entry.get("command", [])]
    if args is not None:
        return entrypoint + from_spec(args)
    return entrypoint + [str(word) for word in image_entry.get("args", [])]
