"""Triton kernels for paged attention, imported as `minipaged.kernels` (issue #5).

Importing this package imports Triton. On a machine without a GPU, set `TRITON_INTERPRET=1`
before the import to run the kernels through Triton's CPU interpreter.
"""
