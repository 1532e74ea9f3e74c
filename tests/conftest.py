"""Shared test set-up.

Triton's interpreter must be switched on before any `@triton.jit` decorator runs, so it is set
here, before any test module imports `minipaged.kernels`.

The bundled SmolLM2 (and `transformers`' own load of the same GGUF, ~15 s) is loaded once per
test process by the `bundled_*` fixtures below; every test that uses one is put in one xdist
group, so that with `pytest -n 2` a single worker pays for the loads.
"""

import os
from pathlib import Path

import pytest
import torch

# On a machine without a GPU the kernels run in Triton's interpreter; on a CUDA machine they are
# compiled, unless TRITON_INTERPRET is set explicitly.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The CPU platform's few-row choice is measured per machine at load; tests fix it (every float
# projection on the GEMV kernel up to 8 rows), so that what runs does not depend on the machine.
os.environ.setdefault("MINIPAGED_GEMV_ROWS", "8")

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

BUNDLED_GROUP = "bundled"


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook, which reads the groups
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests that use a bundled-model fixture run on one xdist worker (`--dist loadgroup`),
    except those that already name a group of their own (they keep it: a test of two groups
    would form a third, which runs anywhere)."""
    for item in items:
        if item.get_closest_marker("xdist_group") is not None:
            continue
        if any(name.startswith("bundled_") for name in getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.xdist_group(BUNDLED_GROUP))


@pytest.fixture(scope="session")
def bundled_path() -> Path:
    """The bundled SmolLM2-135M-Instruct GGUF file."""
    from minipaged.models.checkpoint.loader import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def bundled_checkpoint(bundled_path: Path) -> tuple:
    """(ModelConfig, state dict) of the bundled model, dequantised once."""
    from minipaged.models.checkpoint.loader import load_checkpoint
    from minipaged.models.registry import FAMILIES

    return load_checkpoint(bundled_path, FAMILIES, progress=False)


@pytest.fixture(scope="session")
def bundled_model(bundled_path: Path) -> tuple:
    """(minipaged model, ModelConfig) of the bundled model, float32, built once. Tests must not
    change its weights; engines built on it move it to their dtype and device (a no-op here)."""
    from minipaged.models.registry import load_model

    return load_model(bundled_path, progress=False)


@pytest.fixture(scope="session")
def bundled_tokenizer(bundled_path: Path):
    """minipaged's tokenizer of the bundled model, read from the GGUF once."""
    from minipaged.tokenizer.tokenizer import Tokenizer

    return Tokenizer.from_pretrained(bundled_path)


@pytest.fixture(scope="session")
def bundled_hf_model(bundled_path: Path) -> torch.nn.Module:
    """`transformers`' own float32 load of the bundled GGUF (the oracle), once."""
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        bundled_path.parent, gguf_file=bundled_path.name, dtype=torch.float32
    ).eval()
