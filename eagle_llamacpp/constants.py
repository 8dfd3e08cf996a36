"""GGUF metadata keys that eagle_llamacpp adds to draft heads (shared by the converter and the loader)."""

# the target a head was made for; a head for another target of the same shape is refused at load
TARGET_ARCH_KEY = "eagle2.target.architecture"
TARGET_LAYERS_KEY = "eagle2.target.block_count"
TARGET_NAME_KEY = "eagle2.target.name"

# draft vocabulary: target token ids by frequency in the head's training data, most frequent first;
# the draft may restrict its lm_head to a prefix of it (verification keeps the full vocabulary)
DRAFT_VOCAB_KEY = "eagle2.draft_vocab"
DRAFT_VOCAB_FILE = "draft_vocab.json"  # the same list in a trained head's HF folder
