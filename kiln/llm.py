"""Offline API: `LLM(model).generate(prompts, SamplingParams(...))` over the same Engine the server
runs, the way vLLM's `LLM` works.

    from kiln import LLM, SamplingParams
    llm = LLM()                                     # the embedded SmolLM2 default
    out = llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(temperature=0))
    print(out[0].outputs[0].text)
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kiln.config import EngineConfig
from kiln.engine.engine import Engine
from kiln.engine.request import TokenLogprob
from kiln.sampling_params import SamplingParams


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[TokenLogprob] | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    num_cached_tokens: int = 0


def _resolve_model_path(model: str | None) -> tuple[str, str | None]:
    """(path, gguf file) for a local folder, a .gguf file, or None (the embedded default)."""
    if model is None or model in ("smollm2", "default"):
        from kiln.resolve.sources import default_model_path

        return str(default_model_path()), None
    p = Path(model)
    if p.exists():
        return str(p), None
    from kiln.resolve.sources import resolve_model

    src = resolve_model(model, interactive=False)
    return str(src.gguf_file or src.path), None


class LLM:
    def __init__(self, model: str | None = None, *, tokenizer: Any = None,
                 **engine_overrides: Any) -> None:
        path, gguf = _resolve_model_path(model)
        engine_overrides.setdefault("dtype", _default_dtype(engine_overrides.get("device")))
        self.config = EngineConfig(model=path, gguf_file=gguf, **engine_overrides)
        self.engine = Engine(self.config)
        if tokenizer is None:
            from kiln.tokenizer import load_tokenizer

            tokenizer = load_tokenizer(Path(path), gguf)
        self.tokenizer = tokenizer
        self._ids = itertools.count()

    def generate(self, prompts: str | list[str] | list[list[int]],
                 params: SamplingParams | None = None) -> list[RequestOutput]:
        """Runs every prompt (x params.n) to completion, batched; outputs in prompt order."""
        params = params or SamplingParams()
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        results: list[RequestOutput] = []
        pending: dict[str, tuple[RequestOutput, CompletionOutput]] = {}
        for prompt in prompts:
            text = prompt if isinstance(prompt, str) else None
            ids = (self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt))
            ro = RequestOutput(str(next(self._ids)), text, ids)
            results.append(ro)
            for i in range(params.n):
                rid = f"{ro.request_id}-{i}"
                co = CompletionOutput(i, "", [], None,
                                      [] if params.logprobs is not None else None)
                ro.outputs.append(co)
                self.engine.add_request(rid, ids, params.for_choice(i),
                                        eos_token_ids=self._eos_ids())
                pending[rid] = (ro, co)
        while pending:
            for out in self.engine.step():
                ro, co = pending[out.request_id]
                co.token_ids.extend(out.new_token_ids)
                if co.logprobs is not None and out.new_logprobs:
                    co.logprobs.extend(out.new_logprobs)
                if out.finished:
                    co.finish_reason = out.finish_reason
                    ro.num_cached_tokens = max(ro.num_cached_tokens, out.num_cached_tokens)
                    co.text = self._decode(co.token_ids, params)
                    del pending[out.request_id]
        return results

    def chat(self, messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
             params: SamplingParams | None = None) -> list[RequestOutput]:
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.apply_chat_template(c, add_generation_prompt=True)
                   for c in convs]  # type: ignore[arg-type]
        return self.generate(prompts, params)

    def _eos_ids(self) -> set[int]:
        return set(getattr(self.tokenizer, "eos_token_ids", ())) | set(self.engine.eos_token_ids)

    def _decode(self, ids: list[int], params: SamplingParams) -> str:
        text = self.tokenizer.decode(ids, skip_special_tokens=params.skip_special_tokens)
        for s in params.stop:
            cut = text.find(s)
            if cut != -1:
                text = text[:cut]
        return text


def _default_dtype(device: str | None) -> str:
    """The offline API's default dtype: what the settings table's auto rule would pick."""
    from kiln.config import AutoContext, _auto_dtype

    ctx = AutoContext(device=device or "cpu", cpu_bf16=_cpu_has_bf16(),
                      gpu_bf16=_gpu_bf16(device))
    return _auto_dtype(ctx, {"device": device or "cpu"})[0]


def _cpu_has_bf16() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def _gpu_bf16(device: str | None) -> bool:
    if not device or not device.startswith("cuda"):
        return False
    import torch

    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 8
