"""Offline API: `LLM(model, **settings).generate(prompts, SamplingParams(...))` over the same
Engine the server runs, the way vLLM's `LLM` works.

    from kiln import LLM, SamplingParams
    llm = LLM()                                     # the embedded SmolLM2 default
    out = llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(temperature=0))
    print(out[0].outputs[0].text)

`LLM` resolves MODEL and every setting exactly as `kiln serve` does (the settings table, presets,
model defaults and auto rules; keyword arguments rank as CLI flags), so it runs what the server
would run: `llm.settings` and `llm.effective_config()` say what and why. Its text comes from the
engine's one output processor: stop strings end a request in the engine, as on the server.
"""

from __future__ import annotations

import itertools
from dataclasses import replace
from pathlib import Path
from typing import Any

from kiln.engine.output import CompletionOutput, RequestOutput
from kiln.sampling_params import RequestOutputKind, SamplingParams

__all__ = ["LLM", "CompletionOutput", "RequestOutput"]


class LLM:
    def __init__(self, model: str | None = None, *, tokenizer: Any = None,
                 config: str | Path | None = None, **settings: Any) -> None:
        """`model`: an alias, owner/repo[:QUANT], a folder or a .gguf (None: the embedded
        default). `settings`: any setting of `kiln serve` by its table name (`dtype="float32"`,
        `max_num_seqs=8`, `kv_cache_memory="1GiB"`). `config`: a config file, as `--config`."""
        from kiln import startup

        args = startup.namespace_for(model, settings, Path(config) if config else None)
        self.plan = startup.plan(args)
        self.tokenizer = tokenizer if tokenizer is not None else startup.load_tokenizer(self.plan)
        self.engine = startup.build_engine(self.plan, self.tokenizer)
        self.config = self.engine.config
        self._ids = itertools.count()

    @property
    def settings(self) -> Any:
        """The resolved settings (`kiln.settings.resolve.ResolvedSettings`): value, source and reason."""
        return self.plan.settings

    def effective_config(self) -> dict[str, Any]:
        """What `kiln serve --effective-config-json` writes for the same model and settings."""
        from kiln import startup_report

        return startup_report.effective_config(self.plan, "ok")

    def load_lora(self, name: str, path: str) -> None:
        """Loads a PEFT LoRA adapter folder under `name` (as `lora_modules=["name=path"]`)."""
        self.engine.load_lora(name, path)

    def generate(self, prompts: str | list[str] | list[int] | list[list[int]],
                 params: SamplingParams | None = None, *, lora: str | None = None
                 ) -> list[RequestOutput]:
        """Runs every prompt (x params.n) to completion, batched; outputs in prompt order, each
        request's choices whole (the engine's FINAL_ONLY outputs: it fans out and gathers).
        `lora`: the name of a loaded LoRA adapter to run them with (None: the base model)."""
        params = replace(params or SamplingParams(), output_kind=RequestOutputKind.FINAL_ONLY)
        if lora is not None:
            params = replace(params, lora=lora)
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        order: list[tuple[str, str | None]] = []
        for prompt in prompts:
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            rid = str(next(self._ids))
            self.engine.add_request(rid, ids, params)
            order.append((rid, prompt if isinstance(prompt, str) else None))
        done: dict[str, RequestOutput] = {}
        while len(done) < len(order):
            done.update((out.request_id, out) for out in self.engine.step())
        for rid, text in order:
            done[rid].prompt = text
        return [done[rid] for rid, _ in order]

    def chat(self, messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
             params: SamplingParams | None = None, *, lora: str | None = None
             ) -> list[RequestOutput]:
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.apply_chat_template(c, add_generation_prompt=True)
                   for c in convs]  # type: ignore[arg-type]
        return self.generate(prompts, params, lora=lora)
