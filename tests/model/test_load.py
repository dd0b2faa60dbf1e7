"""How the base model is loaded: the attention implementation each architecture gets."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoConfig

from cpudist.model.load import attention_implementation
from tests.helpers import lora_model


@pytest.mark.parametrize(("kind", "expected"), [("llama", "sdpa"), ("qwen2", "sdpa"),
                                                ("gemma3_text", "sdpa"), ("gemma2", "eager")])
def test_auto_attention_is_sdpa_where_the_architecture_has_it(kind: str, expected: str) -> None:
    assert attention_implementation("auto", AutoConfig.for_model(kind)) == expected
    # An explicit choice is passed through as it is.
    assert attention_implementation("eager", AutoConfig.for_model(kind)) == "eager"


def test_gemma2_loads_with_its_eager_attention(tiny_gemma2: Path, tmp_path: Path) -> None:
    # sdpa, the default before auto, stopped Gemma 2 at load time.
    model = lora_model(tiny_gemma2, tmp_path)
    assert model.config._attn_implementation == "eager"
