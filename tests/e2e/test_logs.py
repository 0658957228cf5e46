"""`tollgate serve --log-format json`: everything its processes log (the edge, the in-process
simulated replicas, the fold worker child) is one JSON object a line on stderr, while the banner
stays on stdout as it was; a client that leaves mid-stream is one INFO line naming its
request, not an error with a traceback."""

from __future__ import annotations

import json
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import (
    MODEL,
    TOLLGATE,
    _stop_process,
    auth,
    free_port,
    long_body,
    poll,
    spawn,
    wait_http,
)

pytestmark = pytest.mark.e2e


def read_json_lines(path: Path) -> list[dict[str, Any]]:
    """Every line of the log, each of which must be a JSON object with the common fields."""
    records = []
    for line in path.read_text().splitlines():
        record = json.loads(line)
        assert {"time", "level", "logger", "message"} <= record.keys(), line
        assert datetime.fromisoformat(record["time"]).utcoffset() == timedelta(0), line
        records.append(record)
    return records


def leave_mid_stream(base: str, secret: str) -> str:
    with (
        httpx.Client(timeout=30) as client,
        client.stream(
            "POST",
            f"{base}/v1/chat/completions",
            headers=auth(secret),
            json=long_body(MODEL, 3000, stream=True),
        ) as response,
    ):
        assert response.status_code == 200
        content = 0
        for line in response.iter_lines():
            choices = json.loads(line[6:]).get("choices") if line.startswith("data: {") else None
            if choices and choices[0]["delta"].get("content"):
                content += 1
                if content >= 2:
                    break
        assert content >= 2
        return response.headers["x-request-id"]


def test_serve_logs_json_lines_and_a_client_gone_as_one_info_line(tmp_path: Path) -> None:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    out, err = tmp_path / "serve.out", tmp_path / "serve.err"
    proc = spawn(
        [*TOLLGATE, "serve", "--port", str(port), "--log-format", "json",
         "--simulated-replicas", "1", "--model", MODEL],
        out, env={"TOLLGATE_DATA_DIR": str(tmp_path / "data")}, stderr=err,
    )  # fmt: skip
    try:
        wait_http(f"{base}/readyz", proc, err)
        secret = json.loads((tmp_path / "data" / "demo-keys.json").read_text())["demo-standard"]
        left = [leave_mid_stream(base, secret) for _ in range(5)]

        def aborted() -> set[str]:
            return {
                r.get("request_id", "")
                for r in read_json_lines(err)
                if r["logger"] == "tollgate.simulator"
            }

        poll("the replica's line for each request left", lambda: set(left) <= aborted(),
             detail=lambda: err.read_text()[-3000:])  # fmt: skip
    finally:
        _stop_process(proc, grace=10)

    records = read_json_lines(err)
    for request_id in left:
        (line,) = [r for r in records if r.get("request_id") == request_id]
        assert (line["level"], line["logger"]) == ("INFO", "tollgate.simulator"), line
        assert request_id in line["message"] and "exc" not in line, line
    assert not [r for r in records if r["level"] in ("ERROR", "CRITICAL") or "exc" in r]
    # The fold worker child was told the format: its lines are among them.
    assert any(r["logger"] == "tollgate.worker" for r in records), records
    assert "Traceback" not in err.read_text()
    # The banner is not a log line: printed to stdout, as text, as before.
    printed = out.read_text()
    assert printed.startswith("Tollgate serving on ") and "Traceback" not in printed
