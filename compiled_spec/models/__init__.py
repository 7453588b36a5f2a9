"""Our own decoder implementations (Llama / Mistral / Qwen2 / Qwen3) and checkpoint loaders."""
from compiled_spec.models.config import Llama3RopeScaling, ModelConfig
from compiled_spec.models.decoder import CausalLM
from compiled_spec.models.loader import load_model

__all__ = ["CausalLM", "Llama3RopeScaling", "ModelConfig", "load_model"]
