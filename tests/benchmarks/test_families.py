"""The family benchmark (``benchmarks.families``): its random checkpoints have the real shapes of
the models it names (their published parameter counts) within our config bounds, and its own
mistakes are one line and exit 2."""

from __future__ import annotations

import math

import pytest

from benchmarks import families
from pipeline.core.planned_model import PlannedModel
from pipeline.source_config import check_config

# The parameter counts the model cards publish (Phi-3-mini: 3.8B, all 32 layers).
PUBLISHED = {"qwen2.5-0.5b": 494_032_768, "qwen3-0.6b": 596_049_920, "phi3-mini": 3_821_079_552}


@pytest.mark.parametrize("name", list(families.SHAPES))
def test_each_random_checkpoint_has_the_real_models_shape(name: str) -> None:
    model_type, shape = families.SHAPES[name]
    config = {"model_type": model_type, **shape}
    check_config(config, f"{name} config.json")
    tensors = PlannedModel(config=config).tensors
    count = sum(math.prod(t.shape) for key, t in tensors.items() if not (t.tied and key == "lm_head.weight"))
    assert count == PUBLISHED[name]


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (
            ["--only", "llama2"],
            "error: --only 'llama2': the families are qwen2.5-0.5b, qwen3-0.6b, phi3-mini, gemma3-270m",
        ),
        (
            ["--phi3-layers", "0"],
            "error: --phi3-layers 0: from 1 to 32 (see python -m benchmarks.families --help)",
        ),
    ],
)
def test_a_mistake_is_one_line_and_exit_2(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        raise SystemExit(families.main(argv))
    assert exited.value.code == 2
    assert capsys.readouterr().err.strip() == says
