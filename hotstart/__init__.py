"""hotstart: an OpenAI-compatible LLM server engineered for the fastest cold start."""

__version__ = "0.1.0"
