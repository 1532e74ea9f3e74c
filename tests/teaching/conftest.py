"""The teaching helpers live in `notebooks/teaching/`, imported as the notebooks import them."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "notebooks"))
