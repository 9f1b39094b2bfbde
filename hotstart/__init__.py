"""hotstart: an OpenAI-compatible LLM server engineered for the fastest cold start.

`from hotstart import LLM, SamplingParams` is vLLM's offline API (hotstart/llm/); it is loaded on first
use, so `import hotstart` stays light (no torch, no web stack)."""

__version__ = "0.1.0"

_LAZY = {"LLM", "SamplingParams", "StructuredOutputsParams", "GuidedDecodingParams", "RequestOutput",
         "CompletionOutput"}


def __getattr__(name: str):
    if name in _LAZY:
        import hotstart.llm as llm  # noqa: PLC0415 - lazy: the offline API's modules

        return getattr(llm, name)
    raise AttributeError(f"module 'hotstart' has no attribute {name!r}")
