"""glm5serve: serve GLM-5 (``glm-dsa``) GGUF files with vLLM, and verify the output against independent references."""
from glm5serve.errors import GGUFModelError

__version__ = "0.1.0"
__all__ = ["GGUFModelError", "__version__"]
