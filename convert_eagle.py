#!/usr/bin/env python3
"""Convert an EAGLE-1/2 draft checkpoint (HF folder, safetensors or .bin) to GGUF.

    python convert_eagle.py path/to/eagle-head --target target.gguf --outfile draft.gguf --outtype f16
"""

import sys

from eagle_llamacpp.convert import main

if __name__ == "__main__":
    sys.exit(main())
