"""EAGLE-2 speculative decoding on llama.cpp.

    from eagle_llamacpp import EagleLlama
    llm = EagleLlama("target.gguf", "draft.gguf")
    print(llm.create_completion("def fib(n):", max_tokens=64, temperature=0)["choices"][0]["text"])
"""

__version__ = "0.1.0"

__all__ = ["EagleLlama", "Sampling", "TreeShape"]


def __getattr__(name):
    # lazy: importing the engine loads the patched libllama, which the converter does not need
    if name in ("EagleLlama", "Sampling"):
        from . import engine
        return getattr(engine, name)
    if name == "TreeShape":
        from .proposer import TreeShape
        return TreeShape
    raise AttributeError(name)
