"""The Hugging Face architectures p3d imports and exports, one description each (p3d.hf.architectures.base,
docs/models.md). To add one: a module beside these with its :class:`Architecture`, named in ``ARCHITECTURES``."""

from __future__ import annotations

from p3d.hf.architectures.base import Architecture, Field, Fixed
from p3d.hf.architectures.deepseek_v3 import DEEPSEEK_V3
from p3d.hf.architectures.llama import LLAMA
from p3d.hf.architectures.mistral import MISTRAL
from p3d.hf.architectures.mixtral import MIXTRAL
from p3d.hf.architectures.qwen2 import QWEN2
from p3d.hf.architectures.qwen3 import QWEN3
from p3d.hf.architectures.qwen3_moe import QWEN3_MOE

ARCHITECTURES: tuple[Architecture, ...] = (LLAMA, MISTRAL, QWEN2, QWEN3, QWEN3_MOE, MIXTRAL, DEEPSEEK_V3)
BY_FAMILY = {a.model_type: a for a in ARCHITECTURES}  # model.family is the architecture's model_type

__all__ = [
    "ARCHITECTURES",
    "BY_FAMILY",
    "DEEPSEEK_V3",
    "LLAMA",
    "MIXTRAL",
    "Architecture",
    "Field",
    "Fixed",
    "of_model",
]


def of_model(m) -> Architecture:
    """The architecture the model ``m`` (a ModelConfig) is written as: ``model.family``, else Llama (dense) or
    Mixtral (with experts). KeyError for an unknown family (p3d.launch.check refuses it first)."""
    if m.family is not None:
        return BY_FAMILY[m.family]
    return MIXTRAL if m.moe is not None else LLAMA
