"""GGUF metadata keys that eagle_llamacpp adds to draft heads (shared by the converter and the loader)."""

# the target a head was made for; a head for another target of the same shape is refused at load
TARGET_ARCH_KEY = "eagle2.target.architecture"
TARGET_LAYERS_KEY = "eagle2.target.block_count"
TARGET_NAME_KEY = "eagle2.target.name"
