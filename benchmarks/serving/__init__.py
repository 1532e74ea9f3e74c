"""Serving: `minipaged serve` online, start-up time, a short request's time to first token beside
a long prompt, and the KV cache manager's bookkeeping per step; every module runs as a script,
`python benchmarks/serving/NAME.py`.
"""
