"""Deploy an application and show its replicas starting: each replica's stage as it changes
(loading the model, connecting to the index, ready) and, when a deployment fails, the
replica's own last error line instead of Serve's "Failed to update the deployments"."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable

from ray import serve
from ray.serve.deployment import Application

from baton_serve.cache_store.telemetry.startup import read_stages

POLL_S = 0.5
# The last line of a Python traceback: `SomeError: message`, maybe with a dotted module.
_EXCEPTION_LINE = re.compile(r"^[\w.]*(Error|Exception|Exit|Interrupt)\b.*")


class AppStartFailed(RuntimeError):
    """A deployment of the application could not start; the message names the cause."""


def deploy_with_progress(
    app: Application,
    *,
    name: str,
    stages_dir: str | None,
    show: Callable[[str], None] = print,
) -> None:
    """`serve.run` the app; while it starts, `show` one line per replica stage change."""
    failure: list[BaseException] = []

    def run() -> None:
        try:
            serve.run(app, name=name, route_prefix="/", blocking=False)
        except BaseException as exc:  # reported below, in the caller's thread
            failure.append(exc)

    started = time.time()
    deploying = threading.Thread(target=run, name="baton-deploy", daemon=True)
    deploying.start()
    shown: dict[str, str] = {}
    while deploying.is_alive():
        deploying.join(POLL_S)
        if stages_dir:
            for replica, (stage, at) in sorted(read_stages(stages_dir).items()):
                if shown.get(replica) != stage:
                    shown[replica] = stage
                    show(f"  replica {replica}: {stage} ({max(0.0, at - started):.1f} s)")
    if failure:
        raise AppStartFailed(failure_cause(name, failure[0])) from failure[0]


def failure_cause(name: str, error: BaseException) -> str:
    """One line: the failing deployment and the last exception line of its message."""
    try:
        status = serve.status().applications[name]
    except Exception:  # the controller is gone too: what serve.run said is all there is
        return _last_exception_line(str(error)) or str(error)
    for deployment, overview in status.deployments.items():
        line = _last_exception_line(overview.message or "")
        if line:
            return f"the {deployment} deployment failed to start: {line}"
    return _last_exception_line(status.message or "") or str(error)


def _last_exception_line(message: str) -> str | None:
    lines = [ln.strip() for ln in message.splitlines() if _EXCEPTION_LINE.match(ln.strip())]
    return lines[-1] if lines else None
