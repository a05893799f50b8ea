"""schemathesis against the service's own OpenAPI schema: no generated request may get a 5xx,
and the server must still be alive afterwards. It sends an inference key: the admin routes
(which unload and remove models, after which a 503 is the right answer) answer it 403."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.conftest import serve

pytestmark = pytest.mark.e2e

FLEET = """
models:
  toy:
    plugin: toy
    batch: {max_size: 4, max_delay_ms: 2}
"""


def test_no_generated_request_gets_a_server_error(tmp_path: Path) -> None:
    binary = shutil.which("schemathesis", path=str(Path(sys.executable).parent))
    assert binary, "schemathesis is a test dependency; install the test extra"
    config = tmp_path / "schemathesis.toml"
    config.write_text('[parameters]\n"path.name" = "toy"\n"path.version" = "1"\n', encoding="utf-8")
    keys = {"MODEL_ROUTER_API_KEYS": "fuzz-inference-key-0123456789", "MODEL_ROUTER_ADMIN_KEYS": "fuzz-admin-key-0123456789"}
    with serve(tmp_path, FLEET, env=keys) as server:
        result = subprocess.run(
            [binary, "--config-file", str(config), "run", server.url + "/schema/openapi.json",
             "--header", "Authorization: Bearer fuzz-inference-key-0123456789",
             "--checks", "not_a_server_error", "--max-examples", "25", "--workers", "1",
             "--request-timeout", "10", "--seed", "1"],
            capture_output=True, text=True, timeout=240, cwd=tmp_path, check=False,  # asserted below, with its output
        )
        alive = httpx.get(server.url + "/health/live")
        server_errors = [r for r in server.log_records() if isinstance(r.get("status"), int) and r["status"] >= 500]
    assert result.returncode == 0, result.stdout[-4000:]
    assert "generated" in result.stdout
    assert alive.status_code == 200
    assert server_errors == []
