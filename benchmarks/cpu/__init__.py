"""CPU benchmarks: the engine's steps against this machine's roofline (GEMM rates, memory
bandwidth), its projections and attention, int8's accuracy, tensor parallelism, and offline
throughput against `transformers`.

A package so that scripts of other folders can import its helpers (`cpu.roofline`); every module
also runs as a script, `python benchmarks/cpu/NAME.py`.
"""
