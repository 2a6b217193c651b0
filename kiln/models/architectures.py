"""HF architecture name -> model class, imported lazily (a CLI that lists models needs no torch)."""

from __future__ import annotations

import importlib

from kiln.errors import ModelLoadError
from kiln.i18n import msg

_MODELS = {
    "LlamaForCausalLM": ("kiln.models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("kiln.models.llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("kiln.models.llama", "LlamaForCausalLM"),
    "Qwen3ForCausalLM": ("kiln.models.llama", "LlamaForCausalLM"),
    "Qwen2MoeForCausalLM": ("kiln.models.qwen_moe", "QwenMoeForCausalLM"),
    "Qwen3MoeForCausalLM": ("kiln.models.qwen_moe", "QwenMoeForCausalLM"),
    "MixtralForCausalLM": ("kiln.models.mixtral", "MixtralForCausalLM"),
    "DeepseekV2ForCausalLM": ("kiln.models.deepseek", "DeepseekV2ForCausalLM"),
    "DeepseekV3ForCausalLM": ("kiln.models.deepseek", "DeepseekV3ForCausalLM"),
    "Phi3ForCausalLM": ("kiln.models.llama", "LlamaForCausalLM"),
    "GraniteForCausalLM": ("kiln.models.llama", "LlamaForCausalLM"),
    "Gemma2ForCausalLM": ("kiln.models.gemma", "GemmaForCausalLM"),
    "Gemma3ForCausalLM": ("kiln.models.gemma", "GemmaForCausalLM"),
    "Olmo2ForCausalLM": ("kiln.models.olmo2", "Olmo2ForCausalLM"),
    "BertModel": ("kiln.models.bert", "BertModel"),
    "RobertaModel": ("kiln.models.bert", "BertModel"),
    "XLMRobertaModel": ("kiln.models.bert", "BertModel"),
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def model_class(architecture: str) -> type:
    try:
        module, name = _MODELS[architecture]
    except KeyError:
        raise ModelLoadError(
            msg("model.arch_unsupported", arch=repr(architecture)),
            hint=msg("model.supported", supported=", ".join(supported_architectures())),
        ) from None
    return getattr(importlib.import_module(module), name)
