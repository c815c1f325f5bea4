"""TLS material for a federation, made with the `cryptography` package instead of openssl recipes.

`make_certs(DIR, hosts)` writes, atomically and with private keys readable by the owner only:

    DIR/ca.pem  DIR/ca.key          a self-signed CA (give ca.pem to every worker; keep ca.key to re-issue)
    DIR/server.pem  DIR/server.key  the SuperLink's certificate, signed by the CA, valid for `hosts`

Each host is a DNS name or an IP address; IPs go into the certificate as IP subjectAltNames, which is
what gRPC checks when a worker connects by address. Keys are ECDSA P-256.
"""

from __future__ import annotations

import datetime
import hashlib
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from soma_edge.checkpoint import atomic_write
from soma_edge.errors import ConfigError

CA, CA_KEY, SERVER, SERVER_KEY = "ca.pem", "ca.key", "server.pem", "server.key"
VALID_DAYS = 3650


@dataclass(frozen=True)
class TLSFiles:
    ca: Path
    cert: Path
    key: Path


def files(root: str | Path) -> TLSFiles:
    """The server-side files in a folder written by `make_certs`; ConfigError naming what is missing."""
    root = Path(root)
    out = TLSFiles(root / CA, root / SERVER, root / SERVER_KEY)
    missing = [p.name for p in (out.ca, out.cert, out.key) if not p.is_file()]
    if missing:
        raise ConfigError(
            f"--tls {root}: no {', '.join(missing)} there (write them with `soma-coord certs {root} --host HOST`)"
        )
    return out


def _san(host: str):
    # cryptography (a compiled library, ~30 ms to load) serves only `certs`, `keygen` and --auth: loaded here
    from cryptography import x509

    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        pass
    if not host or any(c.isspace() or c in "/:@" for c in host):
        raise ConfigError(f"--host {host!r}: not a DNS name or an IP address")
    return x509.DNSName(host)


def _check_out(root: Path, names: tuple[str, ...], force: bool) -> None:
    """Refuse an output folder that is a file, or that already holds any of `names` (unless forced)."""
    if root.exists() and not root.is_dir():
        raise ConfigError(f"{root}: exists and is not a directory")
    existing = [n for n in names if (root / n).exists()]
    if existing and not force:
        raise ConfigError(f"{root}: already holds {', '.join(existing)}; pass --force to replace them")


LOOPBACK = ("127.0.0.1", "localhost")  # in every server certificate


def make_certs(root: str | Path, hosts: list[str], force: bool = False) -> TLSFiles:
    # cryptography (a compiled library, ~30 ms to load) serves only `certs`, `keygen` and --auth: loaded here
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    root = Path(root)
    if not hosts:
        raise ConfigError("give at least one --host: the names or IP addresses workers use to reach the coordinator")
    # The coordinator's own commands dial the SuperLink on loopback (`start --host 0.0.0.0` submits its run
    # to 127.0.0.1), so the certificate names it too, whatever names the workers dial.
    hosts = [*hosts, *(h for h in LOOPBACK if h not in hosts)]
    sans = [_san(h) for h in hosts]
    _check_out(root, (CA, CA_KEY, SERVER, SERVER_KEY), force)
    now = datetime.datetime.now(datetime.timezone.utc)
    start, end = now - datetime.timedelta(days=1), now + datetime.timedelta(days=VALID_DAYS)

    def name(cn: str) -> x509.Name:
        return x509.Name(
            [x509.NameAttribute(NameOID.ORGANIZATION_NAME, "soma-edge"), x509.NameAttribute(NameOID.COMMON_NAME, cn)]
        )

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (
        x509.CertificateBuilder()
        .subject_name(name("soma-edge CA"))
        .issuer_name(name("soma-edge CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    server = (
        x509.CertificateBuilder()
        .subject_name(name(hosts[0]))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )

    def pem_key(k) -> bytes:
        return k.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )

    root.mkdir(parents=True, exist_ok=True)
    for fname, data, mode in (
        (CA_KEY, pem_key(ca_key), 0o600),
        (SERVER_KEY, pem_key(key), 0o600),
        (CA, ca.public_bytes(serialization.Encoding.PEM), 0o644),
        (SERVER, server.public_bytes(serialization.Encoding.PEM), 0o644),
    ):
        atomic_write(root / fname, data, mode=mode)
    return files(root)


# --- worker keys (SuperNode authentication) --------------------------------------------------------------

WORKER_KEY, WORKER_PUB = "worker.key", "worker.pub"


def make_worker_key(root: str | Path, force: bool = False) -> tuple[Path, Path]:
    """A worker's EC key pair (P-384) in the OpenSSH formats Flower reads: DIR/worker.key (owner only),
    which `soma-worker join --auth-key` uses, and DIR/worker.pub, which the coordinator registers."""
    # cryptography (a compiled library, ~30 ms to load) serves only `certs`, `keygen` and --auth: loaded here
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    root = Path(root)
    _check_out(root, (WORKER_KEY, WORKER_PUB), force)
    key = ec.generate_private_key(ec.SECP384R1())
    private = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()
    )
    public = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    atomic_write(root / WORKER_KEY, private, mode=0o600)
    atomic_write(root / WORKER_PUB, public + b"\n", mode=0o644)
    return root / WORKER_KEY, root / WORKER_PUB


def read_public_key(path: str | Path) -> str:
    """The one-line OpenSSH text of a worker's EC public key (a NIST curve, as Flower requires)."""
    # cryptography (a compiled library, ~30 ms to load) serves only `certs`, `keygen` and --auth: loaded here
    from cryptography.exceptions import UnsupportedAlgorithm
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    path = Path(path)
    try:
        data = path.read_bytes()[:16384]
        key = serialization.load_ssh_public_key(data.strip())
    except OSError as e:
        raise ConfigError(f"{path}: cannot read ({e.strerror or e})") from None
    except (ValueError, UnsupportedAlgorithm):
        raise ConfigError(f"{path}: not an OpenSSH public key (write one with `soma-worker keygen DIR`)") from None
    if not isinstance(key, ec.EllipticCurvePublicKey) or key.curve.name not in ("secp256r1", "secp384r1", "secp521r1"):
        raise ConfigError(f"{path}: not an EC key on a NIST curve (write one with `soma-worker keygen DIR`)")
    return key.public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH).decode()


def check_private_key(path: str | Path) -> None:
    """ConfigError unless `path` holds an unencrypted OpenSSH EC private key (what `keygen` writes)."""
    # cryptography (a compiled library, ~30 ms to load) serves only `certs`, `keygen` and --auth: loaded here
    from cryptography.exceptions import UnsupportedAlgorithm
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    path = Path(path)
    try:
        key = serialization.load_ssh_private_key(path.read_bytes()[:65536], None)
    except OSError as e:
        raise ConfigError(f"--auth-key {path}: cannot read ({e.strerror or e})") from None
    except (ValueError, TypeError, UnsupportedAlgorithm):
        raise ConfigError(
            f"--auth-key {path}: not an unencrypted OpenSSH private key (write one with `soma-worker keygen DIR`)"
        ) from None
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise ConfigError(f"--auth-key {path}: not an EC key (write one with `soma-worker keygen DIR`)")


def fingerprint(public_key: str) -> str:
    """A short, stable id of a public key: sha256 of its OpenSSH text, 16 hex digits."""
    return hashlib.sha256(public_key.strip().encode()).hexdigest()[:16]
