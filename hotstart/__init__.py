"""hotstart: an OpenAI-compatible LLM server engineered for the fastest cold start.

The package's front door is vLLM's offline API: `from hotstart import LLM, SamplingParams` (hotstart/llm/,
hotstart/sampling_params.py). Both are loaded on first use, so `import hotstart` stays light (no torch, no
web stack)."""

__version__ = "0.1.0"

_LAZY = {"LLM": "hotstart.llm", "RequestOutput": "hotstart.llm", "CompletionOutput": "hotstart.llm",
         "SamplingParams": "hotstart.sampling_params", "StructuredOutputsParams": "hotstart.sampling_params",
         "GuidedDecodingParams": "hotstart.sampling_params"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib  # noqa: PLC0415 - lazy: the public API's modules load on first use

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'hotstart' has no attribute {name!r}")
