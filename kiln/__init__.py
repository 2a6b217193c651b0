"""kiln: an OpenAI-compatible LLM inference server with its own PyTorch engine."""

from __future__ import annotations

from typing import TYPE_CHECKING

__version__ = "0.1.0"

if TYPE_CHECKING:
    from kiln.llm import LLM
    from kiln.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str):
    # Lazy: `import kiln` (and `kiln --help`) must not import torch.
    if name == "LLM":
        from kiln.llm import LLM

        return LLM
    if name == "SamplingParams":
        from kiln.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(name)
