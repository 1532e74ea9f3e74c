"""minipaged: an educational, from-scratch LLM serving engine.

PagedAttention (Kwon et al., SOSP 2023) and FastServe's skip-join MLFQ scheduler (Wu et al.),
layered so that each idea can be read, run and checked on its own. See docs/architecture.md.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# The public API, imported lazily so that `import minipaged` stays cheap and never pulls in
# Triton or the engine when a reader only wants the tokenizer.
_LAZY = {
    "LLM": "minipaged.engine.llm",
    "LLMEngine": "minipaged.engine.engine",
    "EngineConfig": "minipaged.engine.config",
    "SamplingParams": "minipaged.sampling.params",
    "RequestOutputKind": "minipaged.sampling.params",
    "RequestOutput": "minipaged.sampling.outputs",
    "CompletionOutput": "minipaged.sampling.outputs",
    "StepRecord": "minipaged.engine.record",
    "ModelConfig": "minipaged.models.checkpoint.model_config",
    "Tokenizer": "minipaged.tokenizer.tokenizer",
}

__all__ = sorted(_LAZY) + ["__version__"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'minipaged' has no attribute {name!r}")
