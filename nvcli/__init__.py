"""nv: batch generation for large language models with an embedded paged-attention engine."""

from nvcli.outputs import CompletionOutput, Logprob, RequestOutput
from nvcli.sampling_params import SamplingParams, StructuredOutputsParams

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput", "Logprob"]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "LLM":  # imported lazily: torch and transformers load only when an engine is built
        from nvcli.cpu_threads import prefer_passive_wait

        prefer_passive_wait()  # before torch loads (cpu_threads.py)
        from nvcli.llm import LLM

        return LLM
    raise AttributeError(name)
