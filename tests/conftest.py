"""Shared test set-up.

Triton's interpreter must be switched on before any `@triton.jit` decorator runs, so it is set
here, before any test module imports `minipaged.kernels`.
"""

import os

import torch

# On a machine without a GPU the kernels run in Triton's interpreter; on a CUDA machine they are
# compiled, unless TRITON_INTERPRET is set explicitly.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hypothesis import HealthCheck, settings  # noqa: E402

# The interpreter and the CPU are slow: few examples, no deadline. `HYPOTHESIS_PROFILE=thorough`
# runs more for anyone with the time.
settings.register_profile(
    "default", max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "thorough", max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))
