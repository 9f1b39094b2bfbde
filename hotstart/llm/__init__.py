"""vLLM's offline Python API over hotstart's engine: `from hotstart import LLM, SamplingParams`."""

from hotstart.llm.llm import LLM
from hotstart.llm.outputs import CompletionOutput, Logprob, RequestOutput
from hotstart.sampling_params import GuidedDecodingParams, SamplingParams, StructuredOutputsParams

__all__ = ["LLM", "CompletionOutput", "GuidedDecodingParams", "Logprob", "RequestOutput", "SamplingParams",
           "StructuredOutputsParams"]
