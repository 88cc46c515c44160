"""The cluster's certificates."""

from __future__ import annotations

from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from warmgate_devcluster.pki import ADMIN, KUBE_PROXY, create_pki, kubelet_identity


def test_certificates_name_their_users_and_the_apiserver_addresses(tmp_path):
    identities = [ADMIN, KUBE_PROXY, kubelet_identity("devcluster")]
    pki = create_pki(tmp_path, serving_ips=["10.200.1.1", "10.96.0.1"], clients=identities)
    serving = x509.load_pem_x509_certificate(pki.serving_cert.read_bytes())
    names = serving.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert {str(ip) for ip in names.get_values_for_type(x509.IPAddress)} == {
        "127.0.0.1",
        "10.200.1.1",
        "10.96.0.1",
    }
    assert "kubernetes.default.svc" in names.get_values_for_type(x509.DNSName)
    kubelet = x509.load_pem_x509_certificate(
        pki.client_cert(kubelet_identity("devcluster")).read_bytes()
    )
    subject = kubelet.subject
    assert subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "system:node:devcluster"
    assert subject.get_attributes_for_oid(NameOID.ORGANIZATION_NAME)[0].value == "system:nodes"
    usage = kubelet.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(usage) == [ExtendedKeyUsageOID.CLIENT_AUTH]
    ca = x509.load_pem_x509_certificate(pki.ca_cert.read_bytes())
    kubelet.verify_directly_issued_by(ca)
    assert oct(pki.ca_key.stat().st_mode & 0o777) == "0o600"
