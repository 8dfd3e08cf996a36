"""GGUF metadata keys that eagle_llamacpp adds to draft heads (shared by the converter and the loader)."""

# the target a head was made for; a head for another target of the same shape is refused at load
TARGET_ARCH_KEY = "eagle2.target.architecture"
TARGET_LAYERS_KEY = "eagle2.target.block_count"
TARGET_NAME_KEY = "eagle2.target.name"

# a trained head's target token ids by frequency in its training data, most frequent first: the
# converter gives the draft an lm_head over a prefix of it (d2t); verification keeps the whole vocabulary
DRAFT_VOCAB_FILE = "draft_vocab.json"
DEFAULT_DRAFT_VOCAB = 2048  # benchmarks/draft_vocab.py: 1024 and 2048 fastest, same acceptance as larger (README)
