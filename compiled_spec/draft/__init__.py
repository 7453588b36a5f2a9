"""EAGLE-1 / EAGLE-3 draft heads in the public Hugging Face layout, and their loader."""
from compiled_spec.draft.config import DraftConfig
from compiled_spec.draft.loader import load_draft
from compiled_spec.draft.model import EagleDraft

__all__ = ["DraftConfig", "EagleDraft", "load_draft"]
