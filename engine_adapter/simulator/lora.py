"""The simulated replica's LoRA adapters, as vLLM 0.33 serves them with `--enable-lora
--max-loras N --max-lora-rank R` and runtime updates on: `POST /v1/load_lora_adapter` and
`/v1/unload_lora_adapter` with vLLM's answers and error bodies, the adapters in `/v1/models`
with their `parent`, and `vllm:lora_requests_info` in /metrics once the engine has stepped.

Loading reads what vLLM reads first (vllm/lora/peft_helper.py, lora_model.py): the directory's
`adapter_config.json` (its rank against `--max-lora-rank`) and a tensors file whose names are
peft's (`base_model.model.<module>.lora_A.weight` / `lora_B.weight`). The adapter changes no
token the simulated model samples: which adapter served a request is in its `SimRecord`.
"""

from __future__ import annotations

import json
import re
import struct
import time
from pathlib import Path
from typing import Any

import orjson
from aiohttp import web

from tollgate_llm.engine_adapter.simulator.responses import json_response
from tollgate_llm.engine_adapter.simulator.state import SimConfig

_TENSOR = re.compile(r"^base_model\.model\..+\.lora_[AB]\.weight$")


def _worker_failed(why: str) -> web.Response:
    """vLLM's answer when its worker refuses an adapter (a 500, whatever the reason)."""
    return _error(
        500, f"Call to add_lora method failed: Worker failed with error '{why}', please check "
        "the stack trace above for the root cause", "InternalServerError",
    )  # fmt: skip


def _error(status: int, message: str, err_type: str) -> web.Response:
    body = {"error": {"message": message, "type": err_type, "param": None, "code": status}}
    return json_response(status, body)


class SimLoras:
    """The adapters one simulated replica holds: name -> path, in load order."""

    def __init__(self, cfg: SimConfig) -> None:
        self.cfg = cfg
        self.adapters: dict[str, str] = {}
        self.stepped = False  # vLLM sets its LoRA series on the engine's first step

    def serves(self, model: str) -> bool:
        return model in self.adapters

    async def load(self, request: web.Request) -> web.Response:
        if not self.cfg.enable_lora:
            return json_response(404, {"detail": "Not Found"})  # no such route in vLLM
        try:
            body = orjson.loads(await request.read())
        except orjson.JSONDecodeError:
            return _error(400, "invalid JSON", "BadRequestError")
        name, path = body.get("lora_name"), body.get("lora_path")
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            return _error(400, "Both 'lora_name' and 'lora_path' must be provided.",
                          "InvalidUserInput")  # fmt: skip
        if name in self.adapters and not body.get("load_inplace"):
            return _error(
                400, f"The lora adapter '{name}' has already been loaded. If you want to load "
                "the adapter in place, set 'load_inplace' to True.", "InvalidUserInput",
            )  # fmt: skip
        refused = self._check(name, Path(path))
        if refused is not None:
            return refused
        self.adapters[name] = path
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def unload(self, request: web.Request) -> web.Response:
        if not self.cfg.enable_lora:
            return json_response(404, {"detail": "Not Found"})
        try:
            body = orjson.loads(await request.read())
        except orjson.JSONDecodeError:
            return _error(400, "invalid JSON", "BadRequestError")
        name = body.get("lora_name")
        if not isinstance(name, str) or name not in self.adapters:
            return _error(404, f"The lora adapter '{name}' cannot be found.", "NotFoundError")
        del self.adapters[name]
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")

    def _check(self, name: str, path: Path) -> web.Response | None:
        config = path / "adapter_config.json"
        try:
            rank = json.loads(config.read_text()).get("r")
        except (OSError, ValueError, AttributeError):
            return _error(404, f"Loading lora {name} failed: No adapter found for {path}",
                          "NotFoundError")  # fmt: skip
        if not isinstance(rank, int) or rank > self.cfg.max_lora_rank:
            return _worker_failed(
                f"LoRA rank {rank} is greater than max_lora_rank {self.cfg.max_lora_rank}."
            )
        names = _tensor_names(path / "adapter_model.safetensors")
        if names is None:
            return _worker_failed(f"{path} doesn't contain tensors")
        unexpected = [n for n in names if not _TENSOR.fullmatch(n)]
        if unexpected or not names:
            return _worker_failed(
                f"While loading {path}, expected LoRA weights but received {unexpected[:3]}"
            )
        return None

    def cards(self, base: dict[str, Any]) -> list[dict[str, Any]]:
        """The adapters as vLLM lists them in /v1/models: the base model's card (`base`) with
        their name, `root` their path, `parent` the base model's served name, and no
        context of their own."""
        return [
            {**base, "id": name, "root": path, "parent": self.cfg.model, "max_model_len": None}
            for name, path in self.adapters.items()
        ]

    def metrics_text(self, running: list[str]) -> bytes:
        """vLLM's `vllm:lora_requests_info` (a gauge set to the time of its last step), absent
        until the engine has run a step, as in vLLM."""
        if not self.cfg.enable_lora or not self.stepped:
            return b""
        labels = (
            f'max_lora="{self.cfg.max_loras}",running_lora_adapters="{",".join(running)}",'
            'waiting_lora_adapters=""'
        )
        return (
            b"# HELP vllm:lora_requests_info Running stats on lora requests.\n"
            b"# TYPE vllm:lora_requests_info gauge\n"
            + f"vllm:lora_requests_info{{{labels}}} {time.time()}\n".encode()
        )


def _tensor_names(path: Path) -> list[str] | None:
    """The tensor names in a safetensors file's header (None: no such file, or not one)."""
    try:
        with path.open("rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
    except (OSError, ValueError, struct.error):
        return None
    return [name for name in header if name != "__metadata__"] if isinstance(header, dict) else None
