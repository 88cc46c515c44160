"""The cluster's certificates, made with the `cryptography` package.

A cluster CA signs the apiserver's serving certificate and one client certificate per user of
the apiserver (admin, the node's kubelet, kube-proxy) and the apiserver's own client certificate
for kubelets. A second CA, the front proxy's, signs the certificate the apiserver presents to
aggregated APIs (metrics-server), as kubeadm lays it out. Service-account tokens are signed with
their own RSA key pair.
"""

from __future__ import annotations

import datetime
import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

SERVING_DNS_NAMES = (
    "localhost",
    "kubernetes",
    "kubernetes.default",
    "kubernetes.default.svc",
    "kubernetes.default.svc.cluster.local",
)
FRONT_PROXY_CLIENT = "front-proxy-client"
VALID_DAYS = 3650


@dataclass(frozen=True)
class ClientIdentity:
    """A user of the apiserver, as a client certificate names it: CN = user, O = groups."""

    file_stem: str
    user: str
    groups: tuple[str, ...] = ()


ADMIN = ClientIdentity("admin", "admin", ("system:masters",))
KUBE_PROXY = ClientIdentity("kube-proxy", "system:kube-proxy")
# The apiserver's identity towards kubelets (logs, exec, port-forward).
APISERVER_KUBELET_CLIENT = ClientIdentity(
    "apiserver-kubelet-client", "kube-apiserver-kubelet-client", ("system:masters",)
)


def kubelet_identity(node_name: str) -> ClientIdentity:
    """The Node authorizer admits a kubelet as `system:node:<name>` in `system:nodes`."""
    return ClientIdentity("kubelet", f"system:node:{node_name}", ("system:nodes",))


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
    def front_proxy_ca_cert(self) -> Path:
        return self.folder / "front-proxy-ca.crt"

    @property
    def front_proxy_client_cert(self) -> Path:
        return self.folder / "front-proxy-client.crt"

    @property
    def front_proxy_client_key(self) -> Path:
        return self.folder / "front-proxy-client.key"

    @property
    def sa_key(self) -> Path:
        return self.folder / "sa.key"

    @property
    def sa_pub(self) -> Path:
        return self.folder / "sa.pub"

    def client_cert(self, identity: ClientIdentity) -> Path:
        return self.folder / f"{identity.file_stem}.crt"

    def client_key(self, identity: ClientIdentity) -> Path:
        return self.folder / f"{identity.file_stem}.key"

    @property
    def admin_cert(self) -> Path:
        return self.client_cert(ADMIN)

    @property
    def admin_key(self) -> Path:
        return self.client_key(ADMIN)

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


def _write_key(path: Path, key) -> None:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    path.chmod(0o600)


def _write_cert(path: Path, cert: x509.Certificate) -> None:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def _name(common_name: str, organizations: Iterable[str] = ()) -> x509.Name:
    attributes = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, org) for org in organizations]
    attributes.append(x509.NameAttribute(NameOID.COMMON_NAME, common_name))
    return x509.Name(attributes)


class _Authority:
    """A CA key and certificate that sign leaf certificates."""

    def __init__(self, common_name: str) -> None:
        self.key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        subject = _name(common_name)
        self.cert = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(subject)
            .public_key(self.key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(
                x509.SubjectKeyIdentifier.from_public_key(self.key.public_key()), critical=False
            )
            .sign(self.key, hashes.SHA256())
        )

    def issue(
        self,
        key_path: Path,
        cert_path: Path,
        subject: x509.Name,
        *,
        server: bool = False,
        dns_names: Iterable[str] = (),
        ips: Iterable[str] = (),
    ) -> None:
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
        builder = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(self.cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=True,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=False,
                    crl_sign=False,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self.key.public_key()),
                critical=False,
            )
        )
        names = [x509.DNSName(name) for name in dns_names]
        names += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ips]
        if names:
            builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
        _write_key(key_path, key)
        _write_cert(cert_path, builder.sign(self.key, hashes.SHA256()))


def create_pki(
    folder: Path,
    *,
    serving_ips: Iterable[str],
    clients: Iterable[ClientIdentity] = (ADMIN,),
) -> Pki:
    """Write a fresh cluster CA, the apiserver's serving certificate for `serving_ips` (plus the
    in-cluster names), a client certificate per identity, the front proxy's CA and client
    certificate, and the service-account key pair."""
    folder.mkdir(parents=True, exist_ok=True)
    pki = Pki(folder)
    cluster_ca = _Authority("warmgate-devcluster-ca")
    _write_key(pki.ca_key, cluster_ca.key)
    _write_cert(pki.ca_cert, cluster_ca.cert)
    cluster_ca.issue(
        pki.serving_key,
        pki.serving_cert,
        _name("kube-apiserver"),
        server=True,
        dns_names=SERVING_DNS_NAMES,
        ips=dict.fromkeys(["127.0.0.1", *serving_ips]),
    )
    for identity in clients:
        cluster_ca.issue(
            pki.client_key(identity),
            pki.client_cert(identity),
            _name(identity.user, identity.groups),
        )
    front_proxy_ca = _Authority("warmgate-devcluster-front-proxy-ca")
    _write_cert(pki.front_proxy_ca_cert, front_proxy_ca.cert)
    front_proxy_ca.issue(
        pki.front_proxy_client_key, pki.front_proxy_client_cert, _name(FRONT_PROXY_CLIENT)
    )
    sa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    _write_key(pki.sa_key, sa_key)
    pki.sa_pub.write_bytes(
        sa_key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    return pki
