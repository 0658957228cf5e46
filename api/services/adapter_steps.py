"""What admission asks of a tenant's LoRA adapters (domain/control_plane/adapters.py): which
adapter a caller's `model` names, and the base model version on sale that serves it.

A name resolves to an adapter only for its own tenant (and the projects it names), only while
it is live, and only when no model on sale has that name: for anyone else, and in every other
case, it is a model that does not exist, with exactly that answer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tollgate_llm.api.services.auth import Caller
from tollgate_llm.domain.capacity import AdapterRef
from tollgate_llm.domain.control_plane.adapters import Adapter
from tollgate_llm.domain.control_plane.state import ControlView

__all__ = ["LoraRequest", "lora_request", "listed_adapters"]


@dataclass(frozen=True, slots=True)
class LoraRequest:
    adapter: Adapter
    model: str  # the version of its base model on sale that serves it

    @property
    def ref(self) -> AdapterRef:
        """What the router and the replica need of it."""
        a = self.adapter
        return AdapterRef(a.engine_name, a.path, a.name)


def lora_request(
    control: ControlView, caller: Caller, name: str, resolve: Callable[[str], str | None]
) -> LoraRequest | None:
    """The caller's adapter called `name` and the base version that serves it, or None: no
    such adapter for this caller, or its base model is not on sale (`resolve`: a base name or
    version to the version on sale, `Admission.resolve_model`)."""
    adapter = control.adapter(caller.tenant_id, caller.key_id, name)
    if adapter is None:
        return None
    model = resolve(adapter.base_model)
    return None if model is None else LoraRequest(adapter, model)


def listed_adapters(
    control: ControlView, caller: Caller, resolve: Callable[[str], str | None]
) -> list[LoraRequest]:
    """The adapters the caller may ask for now, by name: its own tenant's only, by the same
    rule as a request (`lora_request`), less any whose name a model on sale takes."""
    found = (lora_request(control, caller, a.name, resolve)
             for a in control.adapters.of_tenant(caller.tenant_id))  # fmt: skip
    return [lora for lora in found if lora is not None and resolve(lora.adapter.name) is None]
