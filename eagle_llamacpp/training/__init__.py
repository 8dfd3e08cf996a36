"""Training EAGLE heads for GGUF targets: features from the patched llama.cpp (`features`: ShareGPT
replies; `distill`: the target's own replies, many per decode), shards streamed from disk
(`shards`), the torch head (`head_model`) and the resumable training loop (`train`). The runtime
modules of eagle_llamacpp do not import this package."""
