"""GPU benchmarks: the Triton kernels' tests, timings and resources on a CUDA card, and the
engine's offline throughput there against `transformers`; every module runs as a script,
`python benchmarks/gpu/NAME.py`.
"""
