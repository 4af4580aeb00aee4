"""A self-signed certificate for KVSync TLS tests, made with the ``cryptography`` package, else
the ``openssl`` CLI (the test is skipped where neither exists)."""
from __future__ import annotations

import datetime
import shutil
import subprocess

import pytest

NAME = "draft.specserve.test"


def self_signed(tmp_path, name=NAME) -> tuple[str, str]:
    """(certificate file, key file) for ``name``, valid for a day, its own CA."""
    try:
        from cryptography import x509
    except ImportError:
        return _openssl(tmp_path, name)
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_file, key_file = tmp_path / "kvsync.crt", tmp_path / "kvsync.key"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return str(cert_file), str(key_file)


def _openssl(tmp_path, name: str) -> tuple[str, str]:
    if shutil.which("openssl") is None:
        pytest.skip("neither the cryptography package nor the openssl CLI is available")
    cert_file, key_file = tmp_path / "kvsync.crt", tmp_path / "kvsync.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-keyout", str(key_file), "-out", str(cert_file), "-days", "1",
                    "-subj", f"/CN={name}", "-addext", f"subjectAltName=DNS:{name}",
                    "-addext", "basicConstraints=critical,CA:TRUE"], check=True, capture_output=True)
    return str(cert_file), str(key_file)
