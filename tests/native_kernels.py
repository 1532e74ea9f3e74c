"""What the tests of the C kernels may skip for, and nothing else.

A kernel is missing for one reason only: the machine has no C compiler. A build that fails where
a compiler exists is a bug, so the tests run and fail (`require_native` raises, naming the
kernel). Import it from any test module in `tests/` as

    from native_kernels import NEEDS_COMPILER
"""

from __future__ import annotations

import pytest

from minipaged.kernels.cpu.build import find_compiler

NEEDS_COMPILER = pytest.mark.skipif(
    find_compiler() is None,
    reason="this machine has no C compiler ($CC, else cc): the C kernels cannot be built")
