"""minipaged against other implementations of the same work on CPU: llama.cpp (served by
`worker.py` in its own process), `transformers`' `generate` and the Rust `tokenizers`; every module
runs as a script, `python benchmarks/peers/NAME.py`.
"""
