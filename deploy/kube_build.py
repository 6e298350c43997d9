"""Build the Kubernetes control plane the chart's cluster tests run on, once per version.

`make kube-test` installs the Helm chart into a real API server with the real KubeRay
operator (`tests/kube_cluster.py`). Every part is built from Go modules with the ordinary
`go` tooling and kept in `~/.cache/baton/kube/<part>-<version>/` with `baton-build.json`
(versions, Go, seconds taken):

- `kubernetes-v1.36.3`: kube-apiserver, kube-scheduler and kube-controller-manager (the
  StatefulSet, Job, garbage-collector and namespace controllers) from `k8s.io/kubernetes`.
  Its go.mod points the `k8s.io/*` staging modules at `./staging/...` folders that the
  published module does not carry, so the build is a module of its own that requires
  `k8s.io/kubernetes` and replaces each staging module by its published release of the same
  version (`v0.36.3` for `v1.36.3`); the version is stamped in as the release build does.
- `etcd-v3.6.8`: the etcd that release requires (its go.mod), from `go.etcd.io/etcd/server/v3`
  (`etcdmain`). Debian's `etcd-server` is 3.4.23: Kubernetes 1.36 supports etcd 3.6 only
  (kubeadm's version map) and the API server turns its watch-progress support off below 3.4.31.
- `kuberay-v1.6.2`: the KubeRay operator and its CRDs (`config/crd/bases`) from
  `github.com/ray-project/kuberay/ray-operator`. The chart targets KubeRay v1.7.0, whose
  module the Go module proxy refuses (403 on its zip); v1.6.2 is the newest it serves, and
  the chart's RayService passes both releases' CRD schemas.
- `kwok-v0.8.0`: KWOK, which plays the kubelet of fake nodes, and the stages it is given
  (node start and heartbeat, Job pods completing, deletion) from `sigs.k8s.io/kwok`.

    python -m baton_serve.deploy.kube_build install   # builds what is missing; prints paths
    python -m baton_serve.deploy.kube_build check     # exit 1 naming what is missing
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

KUBERNETES_VERSION = "v1.36.3"
ETCD_VERSION = "v3.6.8"  # what KUBERNETES_VERSION's go.mod requires (checked at build)
KUBERAY_VERSION = "v1.6.2"
KWOK_VERSION = "v0.8.0"

KUBERNETES_MODULE = "k8s.io/kubernetes"
ETCD_MODULE = "go.etcd.io/etcd/server/v3"
KUBERAY_MODULE = "github.com/ray-project/kuberay/ray-operator"
KWOK_MODULE = "sigs.k8s.io/kwok"
KWOK_STAGES = (  # upstream stages the harness runs KWOK with, beside its own pod stage
    "kustomize/stage/node/fast/node-initialize.yaml",
    "kustomize/stage/node/heartbeat-with-lease/node-heartbeat-with-lease.yaml",
    "kustomize/stage/pod/fast/pod-complete.yaml",
    "kustomize/stage/pod/fast/pod-delete.yaml",
)
BUILD_INFO = "baton-build.json"
STAGING_REPLACE = re.compile(r"^\s*(k8s\.io/[\w.-]+)\s+=>\s+\./staging/\S+\s*$", re.MULTILINE)


@dataclass(frozen=True)
class Part:
    """One cached build: a folder named after the part and its version."""

    name: str
    version: str
    files: tuple[str, ...]  # what the folder holds once built (relative paths)
    build: Callable[[Path, Path], None]  # build(scratch, out)

    @property
    def folder_name(self) -> str:
        return f"{self.name}-{self.version}"


def default_cache() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "baton" / "kube"


def go_env() -> dict[str, str]:
    """Static binaries, go.sum filled in as modules are resolved."""
    return {**os.environ, "CGO_ENABLED": "0", "GOFLAGS": "-mod=mod -buildvcs=false"}


def go(*args: str, cwd: Path, env: dict[str, str] | None = None) -> str:
    """Run `go` niced (it shares two cores with everything else); return its stdout."""
    nice = ["nice", "-n", "19"] if shutil.which("nice") else []
    result = subprocess.run(
        [*nice, "go", *args], cwd=cwd, env=env or go_env(), capture_output=True, text=True
    )
    if result.returncode != 0:
        raise RuntimeError(f"go {' '.join(args)} failed in {cwd}:\n{result.stderr[-4000:]}")
    return result.stdout


def module_dir(module: str, version: str, scratch: Path) -> Path:
    """The module's source in Go's module cache, downloaded if needed."""
    info = json.loads(go("mod", "download", "-json", f"{module}@{version}", cwd=scratch))
    if info.get("Error"):
        raise RuntimeError(f"{module}@{version}: {info['Error']}")
    return Path(info["Dir"])


def published_replaces(kubernetes_go_mod: str, version: str) -> list[str]:
    """For each `k8s.io/X => ./staging/...` of the kubernetes go.mod, a replace by the
    published `k8s.io/X` of the same release (`v1.36.3` → `v0.36.3`)."""
    staging_version = "v0." + version.removeprefix("v").split(".", 1)[1]
    modules = STAGING_REPLACE.findall(kubernetes_go_mod)
    if not modules:
        raise RuntimeError("the kubernetes go.mod has no ./staging replaces: not the layout known")
    return [f"{module} => {module} {staging_version}" for module in modules]


def required_version(go_mod: str, module: str) -> str:
    found = re.search(rf"^\s*{re.escape(module)}\s+(v\S+)", go_mod, re.MULTILINE)
    if not found:
        raise RuntimeError(f"{module} is not required by this go.mod")
    return found[1]


def write_module(folder: Path, requires: dict[str, str], replaces: tuple[str, ...] = ()) -> None:
    """A throw-away main module that requires `requires` and applies `replaces`."""
    folder.mkdir(parents=True, exist_ok=True)
    lines = ["module baton.local/kube-build", "", "go 1.26.0", "", "require ("]
    lines += [f"\t{module} {version}" for module, version in requires.items()]
    lines += [")", "", "replace (", *[f"\t{line}" for line in replaces], ")", ""]
    (folder / "go.mod").write_text("\n".join(lines))


def version_ldflags(version: str) -> str:
    """What the release build stamps in (the API server's /version, helm's kubeVersion)."""
    major, minor, _ = version.removeprefix("v").split(".")
    stamps = {
        "k8s.io/component-base/version.gitVersion": version,
        "k8s.io/component-base/version.gitMajor": major,
        "k8s.io/component-base/version.gitMinor": minor,
        "k8s.io/component-base/version.gitTreeState": "clean",
        "k8s.io/client-go/pkg/version.gitVersion": version,
    }
    return " ".join(["-s", "-w", *(f"-X {name}={value}" for name, value in stamps.items())])


KUBERNETES_BINARIES = ("kube-apiserver", "kube-scheduler", "kube-controller-manager")


def build_kubernetes(scratch: Path, out: Path) -> None:
    source = module_dir(KUBERNETES_MODULE, KUBERNETES_VERSION, scratch)
    go_mod = (source / "go.mod").read_text()
    if (etcd := required_version(go_mod, ETCD_MODULE)) != ETCD_VERSION:
        raise RuntimeError(f"{KUBERNETES_VERSION} requires etcd {etcd}: set ETCD_VERSION to it")
    build = scratch / "kubernetes"
    replaces = tuple(published_replaces(go_mod, KUBERNETES_VERSION))
    write_module(build, {KUBERNETES_MODULE: KUBERNETES_VERSION}, replaces)
    commands = [f"{KUBERNETES_MODULE}/cmd/{name}" for name in KUBERNETES_BINARIES]
    go("get", *(f"{command}@{KUBERNETES_VERSION}" for command in commands), cwd=build)
    for name, command in zip(KUBERNETES_BINARIES, commands, strict=True):
        ldflags = version_ldflags(KUBERNETES_VERSION)
        go("build", "-trimpath", "-ldflags", ldflags, "-o", str(out / name), command, cwd=build)


def build_etcd(scratch: Path, out: Path) -> None:
    build = scratch / "etcd"
    write_module(build, {ETCD_MODULE: ETCD_VERSION})
    # etcd's own main.go (in a module whose go.mod replaces its siblings) is this one call.
    main = 'package main\n\nimport (\n\t"os"\n\n\t"go.etcd.io/etcd/server/v3/etcdmain"\n)\n'
    (build / "main.go").write_text(main + "\nfunc main() { etcdmain.Main(os.Args) }\n")
    go("get", f"{ETCD_MODULE}/etcdmain@{ETCD_VERSION}", cwd=build)
    go("build", "-trimpath", "-ldflags", "-s -w", "-o", str(out / "etcd"), ".", cwd=build)


def go_install(package: str, version: str, binary: str, scratch: Path, out: Path) -> None:
    """`go install package@version` (a module without replaces), as `out/binary`."""
    gobin = scratch / "gobin"
    install = ["install", "-trimpath", "-ldflags", "-s -w", f"{package}@{version}"]
    go(*install, cwd=scratch, env={**go_env(), "GOBIN": str(gobin)})
    (built,) = gobin.iterdir()
    shutil.move(built, out / binary)


def copy_files(source: Path, paths: list[str], into: Path) -> None:
    into.mkdir(parents=True, exist_ok=True)
    for path in paths:
        target = into / Path(path).name
        shutil.copyfile(source / path, target)  # the module cache's copies are read-only


KUBERAY_CRDS = ("ray.io_rayclusters.yaml", "ray.io_rayjobs.yaml", "ray.io_rayservices.yaml")


def build_kuberay(scratch: Path, out: Path) -> None:
    go_install(KUBERAY_MODULE, KUBERAY_VERSION, "kuberay-operator", scratch, out)
    source = module_dir(KUBERAY_MODULE, KUBERAY_VERSION, scratch)
    copy_files(source, [f"config/crd/bases/{name}" for name in KUBERAY_CRDS], out / "crds")


def build_kwok(scratch: Path, out: Path) -> None:
    go_install(f"{KWOK_MODULE}/cmd/kwok", KWOK_VERSION, "kwok", scratch, out)
    copy_files(module_dir(KWOK_MODULE, KWOK_VERSION, scratch), list(KWOK_STAGES), out / "stages")


KUBERAY_CRD_FILES = tuple(f"crds/{name}" for name in KUBERAY_CRDS)
KWOK_STAGE_FILES = tuple(f"stages/{Path(stage).name}" for stage in KWOK_STAGES)
PARTS = (
    Part("etcd", ETCD_VERSION, ("etcd",), build_etcd),
    Part("kubernetes", KUBERNETES_VERSION, KUBERNETES_BINARIES, build_kubernetes),
    Part("kuberay", KUBERAY_VERSION, ("kuberay-operator", *KUBERAY_CRD_FILES), build_kuberay),
    Part("kwok", KWOK_VERSION, ("kwok", *KWOK_STAGE_FILES), build_kwok),
)


def missing(cache: Path) -> list[str]:
    """The parts whose cached folder is absent or incomplete."""
    return [
        part.folder_name
        for part in PARTS
        if not all((cache / part.folder_name / path).is_file() for path in part.files)
    ]


def part_dir(name: str, cache: Path | None = None) -> Path:
    """The cached folder of the part called `name` (built or not)."""
    (part,) = [part for part in PARTS if part.name == name]
    return (cache or default_cache()) / part.folder_name


def go_version() -> str:
    return subprocess.run(["go", "env", "GOVERSION"], capture_output=True, text=True).stdout.strip()


def build_part(part: Part, cache: Path) -> float:
    """Build `part` into its cached folder (whole or not at all); returns the seconds taken."""
    cache.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(dir=cache, prefix=".building-") as scratch_dir:
        scratch = Path(scratch_dir)
        staged = scratch / "out"
        staged.mkdir()
        part.build(scratch, staged)
        seconds = round(time.monotonic() - started, 1)
        info = {"part": part.name, "version": part.version, "go": go_version(), "seconds": seconds}
        (staged / BUILD_INFO).write_text(json.dumps(info, indent=2) + "\n")
        target = cache / part.folder_name
        shutil.rmtree(target, ignore_errors=True)
        staged.replace(target)
    return seconds


def install(cache: Path) -> dict[str, float]:
    """Build every part the cache lacks; returns each built part's seconds."""
    wanted = set(missing(cache))
    times: dict[str, float] = {}
    for part in PARTS:
        if part.folder_name not in wanted:
            print(f"reusing {cache / part.folder_name}")
            continue
        print(f"building {part.folder_name} (go {go_version()}, niced) ...", flush=True)
        times[part.folder_name] = build_part(part, cache)
        print(f"built {cache / part.folder_name} in {times[part.folder_name]:.0f} s", flush=True)
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m baton_serve.deploy.kube_build")
    parser.add_argument("command", choices=("install", "check"))
    parser.add_argument("--cache", type=Path, default=default_cache())
    args = parser.parse_args(argv)
    if args.command == "check":
        absent = missing(args.cache)
        for name in absent:
            print(f"kube_build: {args.cache / name} is not built", file=sys.stderr)
        return 1 if absent else 0
    if shutil.which("go") is None:
        print("kube_build: no `go` on PATH (Go 1.26 or newer builds these)", file=sys.stderr)
        return 1
    install(args.cache)
    return 0


if __name__ == "__main__":
    sys.exit(main())
