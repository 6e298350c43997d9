"""The device in every test run: Mesa's software Vulkan driver (lavapipe).

`make test` builds llama.cpp's Vulkan module (`deploy/vulkan_build.py`). ggml's Vulkan backend
uses a CPU-type device such as lavapipe only when `GGML_VK_VISIBLE_DEVICES` names it before
the backends load, so the device runs in child processes and replicas given `DEVICE_ENV`; the
test process's llama.cpp stays CPU-only and serves as the reference.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from baton_serve.deploy import vulkan_build

DEVICE_ENV = {"GGML_VK_VISIBLE_DEVICES": os.environ.get("GGML_VK_VISIBLE_DEVICES", "0")}
NAMED = "GGML_VK_VISIBLE_DEVICES=" + DEVICE_ENV["GGML_VK_VISIBLE_DEVICES"]
CHILD_TIMEOUT_S = 900  # a fresh machine compiles every shader once (Mesa caches them on disk)


def require_vulkan_module() -> None:
    """Skip, saying why, where the Vulkan module is not built."""
    problem = vulkan_build.check()
    if problem:
        pytest.skip(f"llama.cpp's Vulkan backend is not built ({problem})")


def skip_unless_device(device: str) -> None:
    """Skip where llama.cpp put the layers on the CPU: the variable named no device."""
    if device == "CPU" or not device:
        pytest.skip(f"{NAMED} names no Vulkan device (Mesa's mesa-vulkan-drivers missing?)")


def child_report(script: str, *args: str) -> dict:
    """Run `python script args` with the device named; return its last output line as JSON."""
    require_vulkan_module()
    done = subprocess.run(
        [sys.executable, script, *args],
        capture_output=True,
        text=True,
        env={**os.environ, **DEVICE_ENV},
        timeout=CHILD_TIMEOUT_S,
        check=False,
    )
    if done.returncode != 0 and "Invalid Vulkan device index" in done.stderr:
        pytest.skip(f"no Vulkan device with the index {NAMED} (no Vulkan driver installed?)")
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
