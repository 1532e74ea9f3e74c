"""The vLLM and FastServe papers' experiments in miniature, in the simulator at the papers'
settings and on the engine; every module runs as a script, `python benchmarks/papers/NAME.py`.
"""
