"""Layer 12 -- the engine: `LLMEngine` (schedule -> execute -> update, one step at a time),
`EngineConfig`, what follows the forward pass, beam search, and `LLM`, the offline front end.
"""

from __future__ import annotations

from minipaged.engine.config import EngineConfig
from minipaged.engine.engine import LLMEngine
from minipaged.engine.llm import LLM
from minipaged.engine.record import StepRecord

__all__ = ["EngineConfig", "LLM", "LLMEngine", "StepRecord"]
