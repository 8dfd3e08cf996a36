"""Training EAGLE heads for GGUF targets: features from the patched llama.cpp (`features`: ShareGPT
replies; `distill`: the target's own replies, many per decode), shards streamed from disk
(`shards`), the torch head (`head_model`) and the resumable training loop (`train`). The runtime
modules of eagle_llamacpp do not import this package."""

import os

# torch backs CPU tensors of 2 MiB and more with transparent huge pages only when this is set (read
# once, at its first allocation). A training step allocates hundreds of MB of fresh activations; on
# 4 KiB pages (the kernel's default where huge pages are left to madvise) each step paid ~10^5 page
# faults for them.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
