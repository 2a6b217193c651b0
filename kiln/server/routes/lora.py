"""POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's bodies and answers), with
--enable-lora-runtime-updates; the adapters' model ids (--lora-model-id-template) live in
`Serving.adapters`, which /v1/models lists and the generating routes pick an adapter by."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict

from kiln.server.errors import APIError
from kiln.server.serving import Serving


@dataclass
class LoRAOptions:
    """What the server knows of LoRA: the model-id template, whether adapters may be loaded
    while serving, and the adapters the engine loaded at startup (name -> path)."""

    template: str = "<name>"
    runtime_updates: bool = False
    adapters: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_settings(cls, s: Any, engine: Any) -> LoRAOptions:
        loaded = engine.lora.adapters if engine.lora is not None else {}
        return cls(s["lora_model_id_template"], bool(s["enable_lora_runtime_updates"]),
                   {n: str(a.spec.path) for n, a in loaded.items()})


class LoadLoRARequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    lora_name: str
    lora_path: str


class UnloadLoRARequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    lora_name: str
    lora_int_id: int | None = None  # vLLM's; the name is what kiln goes by


def router(sv: Serving, opts: LoRAOptions) -> APIRouter:
    """Under /v1, behind the API key."""
    r = APIRouter()

    def check_enabled() -> None:
        if not opts.runtime_updates:
            raise APIError(404, "loading and unloading LoRA adapters while serving is off: "
                           "start the server with --enable-lora-runtime-updates",
                           code="lora_runtime_updates_disabled")

    @r.post("/load_lora_adapter")
    async def load(req: LoadLoRARequest) -> Any:
        from kiln.engine.lora import LoRAError

        check_enabled()
        if not req.lora_name.strip() or not req.lora_path.strip():
            raise APIError(400, "lora_name and lora_path must not be empty", param="lora_name",
                           code="invalid_value")
        if sv.adapter_model_id(req.lora_name) in sv.names:
            raise APIError(400, f"`{req.lora_name}` would be served as a base model's name",
                           param="lora_name", code="invalid_value")
        try:
            await sv.engine.call(lambda eng: eng.load_lora(req.lora_name, req.lora_path))
        except LoRAError as e:
            hint = f" ({e.hint})" if e.hint else ""
            # the adapter's problem by its code (lora.file_missing, ...), as a KilnError
            # raised by add_request is (server/errors.py)
            raise APIError(400, f"{e.message}{hint}", param=f"lora_{e.field}",
                           code=e.code or "invalid_value") from e
        sv.add_adapter(req.lora_name, req.lora_path)
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")

    @r.post("/unload_lora_adapter")
    async def unload(req: UnloadLoRARequest) -> Any:
        from kiln.engine.lora import LoRAError, LoRANotFoundError

        check_enabled()
        try:
            await sv.engine.call(lambda eng: eng.unload_lora(req.lora_name))
        except LoRANotFoundError as e:
            raise APIError(404, f"The lora adapter '{req.lora_name}' cannot be found.",
                           param="lora_name", code="model_not_found") from e
        except LoRAError as e:
            raise APIError(409, f"{e.message} ({e.hint})" if e.hint else e.message,
                           param="lora_name", code="lora_in_use") from e
        sv.remove_adapter(req.lora_name)
        return PlainTextResponse(
            f"Success: LoRA adapter '{req.lora_name}' removed successfully.")

    return r
