"""The cluster's certificates, made with the openssl command (no Python dependency).

A local CA signs the apiserver's serving certificate (127.0.0.1, localhost and the in-cluster
names) and the admin client certificate (CN=admin, O=system:masters). The service-account
tokens are signed with their own RSA key pair.
"""

from __future__ import annotations

import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

SERVING_NAMES = (
    "IP:127.0.0.1",
    "DNS:localhost",
    "IP:10.0.0.1",
    "DNS:kubernetes",
    "DNS:kubernetes.default",
    "DNS:kubernetes.default.svc",
    "DNS:kubernetes.default.svc.cluster.local",
)


@dataclass(frozen=True)
class Pki:
    folder: Path

    @property
    def ca_cert(self) -> Path:
        return self.folder / "ca.crt"

    @property
    def ca_key(self) -> Path:
        return self.folder / "ca.key"

    @property
    def serving_cert(self) -> Path:
        return self.folder / "apiserver.crt"

    @property
    def serving_key(self) -> Path:
        return self.folder / "apiserver.key"

    @property
    def admin_cert(self) -> Path:
        return self.folder / "admin.crt"

    @property
    def admin_key(self) -> Path:
        return self.folder / "admin.key"

    @property
    def sa_key(self) -> Path:
        return self.folder / "sa.key"

    @property
    def sa_pub(self) -> Path:
        return self.folder / "sa.pub"

    def exists(self) -> bool:
        paths = (
            self.ca_cert,
            self.serving_cert,
            self.serving_key,
            self.admin_cert,
            self.admin_key,
            self.sa_key,
            self.sa_pub,
        )
        return all(p.is_file() for p in paths)


def _openssl(*args: str) -> None:
    result = subprocess.run(["openssl", *args], capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"openssl {' '.join(args)} failed: {result.stderr.strip()}")


def _ec_key(path: Path) -> None:
    _openssl("ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", str(path))
    path.chmod(0o600)


def _signed_cert(pki: Pki, key: Path, cert: Path, subject: str, extensions: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        csr = Path(tmp) / "req.csr"
        ext = Path(tmp) / "ext.cnf"
        ext.write_text(extensions)
        _openssl("req", "-new", "-key", str(key), "-subj", subject, "-out", str(csr))
        _openssl(
            "x509",
            "-req",
            "-in",
            str(csr),
            "-CA",
            str(pki.ca_cert),
            "-CAkey",
            str(pki.ca_key),
            "-CAcreateserial",
            "-days",
            "3650",
            "-sha256",
            "-extfile",
            str(ext),
            "-out",
            str(cert),
        )


def create_pki(folder: Path) -> Pki:
    """Write a fresh CA, apiserver serving cert, admin client cert and SA key pair."""
    folder.mkdir(parents=True, exist_ok=True)
    pki = Pki(folder)
    _ec_key(pki.ca_key)
    _openssl(
        "req",
        "-x509",
        "-new",
        "-key",
        str(pki.ca_key),
        "-subj",
        "/CN=warmgate-devcluster-ca",
        "-days",
        "3650",
        "-sha256",
        "-addext",
        "basicConstraints=critical,CA:TRUE",
        "-addext",
        "keyUsage=critical,keyCertSign,cRLSign,digitalSignature",
        "-out",
        str(pki.ca_cert),
    )
    _ec_key(pki.serving_key)
    _signed_cert(
        pki,
        pki.serving_key,
        pki.serving_cert,
        "/CN=kube-apiserver",
        "basicConstraints=CA:FALSE\n"
        "keyUsage=critical,digitalSignature,keyEncipherment\n"
        "extendedKeyUsage=serverAuth\n"
        f"subjectAltName={','.join(SERVING_NAMES)}\n",
    )
    _ec_key(pki.admin_key)
    _signed_cert(
        pki,
        pki.admin_key,
        pki.admin_cert,
        "/O=system:masters/CN=admin",
        "basicConstraints=CA:FALSE\n"
        "keyUsage=critical,digitalSignature,keyEncipherment\n"
        "extendedKeyUsage=clientAuth\n",
    )
    _openssl("genrsa", "-out", str(pki.sa_key), "2048")
    pki.sa_key.chmod(0o600)
    _openssl("rsa", "-in", str(pki.sa_key), "-pubout", "-out", str(pki.sa_pub))
    return pki
