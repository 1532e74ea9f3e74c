"""Layer 1 -- tokenizers: byte-level BPE read from a GGUF file or a `tokenizer.json`, added
and special tokens, chat templates, and the GGUF container reader the checkpoint layer shares.
"""

from __future__ import annotations

from minipaged.tokenizer.bpe import TokenizerError
from minipaged.tokenizer.chat_template import ChatTemplateError
from minipaged.tokenizer.gguf_file import GGUFError, GGUFFile, read_gguf_file
from minipaged.tokenizer.tokenizer import IncrementalDetokenizer, Tokenizer

__all__ = [
    "ChatTemplateError",
    "GGUFError",
    "GGUFFile",
    "IncrementalDetokenizer",
    "Tokenizer",
    "TokenizerError",
    "read_gguf_file",
]
