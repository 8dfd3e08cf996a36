"""GGUF metadata keys that eagle_llamacpp adds to draft heads (shared by the converter and the loader)."""

# the target a head was made for; a head for another target of the same shape is refused at load
TARGET_ARCH_KEY = "eagle2.target.architecture"
TARGET_LAYERS_KEY = "eagle2.target.block_count"
TARGET_NAME_KEY = "eagle2.target.name"

# a trained head's target token ids by frequency in its training data, most frequent first: the
# converter gives the draft an lm_head over a prefix of it (d2t); verification keeps the whole vocabulary
DRAFT_VOCAB_FILE = "draft_vocab.json"
# the sizes the converter picks from when none is given, and the most of the target's weight bytes the
# draft's lm_head rows may take: a draft decode reads them once per tree level, a verify reads the whole
# target once, so a target whose rounds are slow against its drafts affords a bigger vocabulary (README)
DRAFT_VOCAB_SIZES = (2048, 4096, 8192, 16384)
DRAFT_LM_HEAD_SHARE = 0.01
