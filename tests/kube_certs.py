"""Self-signed certificates and a kubeconfig for the test control plane (`kube_cluster`).

One CA signs the API server's serving certificate (loopback names and addresses only) and
one client certificate in `system:masters`, which every component and test uses; a separate
RSA key signs service account tokens.
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import NameOID

LOOPBACK_NAMES = ("localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc")
LOOPBACK_ADDRESSES = ("127.0.0.1", "::1")
CERT_DAYS = 2


@dataclass(frozen=True)
class Certificates:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    service_account_key: Path
    service_account_public: Path


def _name(common_name: str, organization: str | None = None) -> x509.Name:
    parts = [x509.NameAttribute(NameOID.COMMON_NAME, common_name)]
    if organization:
        parts.append(x509.NameAttribute(NameOID.ORGANIZATION_NAME, organization))
    return x509.Name(parts)


def _pem_key(key: ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _certificate(
    subject: x509.Name,
    key: ec.EllipticCurvePrivateKey,
    issuer: x509.Name,
    issuer_key: ec.EllipticCurvePrivateKey,
    extensions: list[tuple[x509.ExtensionType, bool]],
) -> bytes:
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=CERT_DAYS))
    )
    for extension, critical in extensions:
        builder = builder.add_extension(extension, critical=critical)
    return builder.sign(issuer_key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM)


def make_certificates(folder: Path) -> Certificates:
    """Write the CA, the API server's and the admin client's certificates into `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = _name("baton-test-ca")
    ca = _certificate(
        ca_name, ca_key, ca_name, ca_key, [(x509.BasicConstraints(ca=True, path_length=0), True)]
    )
    server_key = ec.generate_private_key(ec.SECP256R1())
    alt_names: list[x509.GeneralName] = [x509.DNSName(name) for name in LOOPBACK_NAMES]
    alt_names += [x509.IPAddress(ipaddress.ip_address(a)) for a in LOOPBACK_ADDRESSES]
    server = _certificate(
        _name("kube-apiserver"),
        server_key,
        ca_name,
        ca_key,
        [
            (x509.SubjectAlternativeName(alt_names), False),
            (x509.ExtendedKeyUsage([x509.ExtendedKeyUsageOID.SERVER_AUTH]), False),
        ],
    )
    client_key = ec.generate_private_key(ec.SECP256R1())
    client = _certificate(
        _name("baton-test-admin", "system:masters"),
        client_key,
        ca_name,
        ca_key,
        [(x509.ExtendedKeyUsage([x509.ExtendedKeyUsageOID.CLIENT_AUTH]), False)],
    )
    service_account_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    public = service_account_key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    files = {
        "ca.crt": ca,
        "apiserver.crt": server,
        "apiserver.key": _pem_key(server_key),
        "admin.crt": client,
        "admin.key": _pem_key(client_key),
        "sa.key": _pem_key(service_account_key),
        "sa.pub": public,
    }
    for name, data in files.items():
        (folder / name).write_bytes(data)
        (folder / name).chmod(0o600)
    return Certificates(*(folder / name for name in files))


def write_kubeconfig(path: Path, server: str, certs: Certificates) -> Path:
    """A kubeconfig for `server` as the admin client (helm and every component use it)."""
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {"name": "test", "cluster": {"server": server, "certificate-authority": str(certs.ca)}}
        ],
        "users": [
            {
                "name": "admin",
                "user": {
                    "client-certificate": str(certs.client_cert),
                    "client-key": str(certs.client_key),
                },
            }
        ],
        "contexts": [{"name": "test", "context": {"cluster": "test", "user": "admin"}}],
        "current-context": "test",
    }
    path.write_text(yaml.safe_dump(config))
    path.chmod(0o600)
    return path
