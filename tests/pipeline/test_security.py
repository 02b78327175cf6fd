"""Nothing in a config or a checkpoint runs code: nested ``_target_`` keys are refused before
anything is built, checkpoints asking for remote code are refused at source resolution, and no
pickle is ever loaded. Each attack would create a marker file; the tests assert it does not."""

from __future__ import annotations

import contextlib
import json
import pathlib
import pickle
import re
import shutil
from pathlib import Path

import pytest

from pipeline.config import ModelConfig
from pipeline.core.errors import ConfigError, SourceError
from pipeline.core.plugins import build_passes
from pipeline.sources import check_hf_llama, resolve_source
from pipeline.speculative import draft_passes
from tests.pipeline.recipe import compose_recipe

REPO = Path(__file__).resolve().parents[2]


class TouchOnUnpickle:
    """Unpickling this creates ``marker`` (a harmless stand-in for arbitrary code)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[object, ...]]:
        return (pathlib.Path.touch, (pathlib.Path(self.marker),))


@pytest.fixture
def booby_trapped_pickle(tmp_path: Path) -> tuple[Path, Path]:
    """(a pickle whose loading creates the marker, the marker); the trap is checked to work."""
    marker = tmp_path / "MARKER"
    payload = tmp_path / "some.bin"
    payload.write_bytes(pickle.dumps(TouchOnUnpickle(marker)))
    pickle.loads(payload.read_bytes())  # the trap works ...
    assert marker.exists()
    marker.unlink()  # ... and is armed again
    return payload, marker


def nested_target_overrides(payload: Path) -> list[str]:
    return [
        "+quant._target_=passes.fp16.Fp16Pass",
        "+quant.x._target_=torch.load",
        f"+quant.x._args_=[{payload}]",
        "+quant.x.weights_only=false",
    ]


def test_a_nested_target_is_refused_before_anything_is_built(booby_trapped_pickle: tuple[Path, Path]) -> None:
    payload, marker = booby_trapped_pickle
    cfg = compose_recipe(nested_target_overrides(payload))
    with pytest.raises(ConfigError) as error:
        build_passes(cfg)
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith("quant.x._target_ is refused") and "remove quant.x._target_" in message
    assert not marker.exists()


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        (["quant=int8", "+quant.calibration._target_=torch.load"], "quant.calibration._target_"),
        (["+quant._target_=passes.fp16.Fp16Pass", "+quant._partial_=true"], "quant._partial_"),
        (["+quant._target_=passes.fp16.Fp16Pass", "+quant._args_=[1]"], "quant._args_"),
        (["+quant._target_=passes.fp16.Fp16Pass", "+quant.y=[{_target_: os.getcwd}]"], "quant.y[0]._target_"),
        (["+quant.a._target_=passes.fp16.Fp16Pass", "+quant.a.b._recursive_=true"], "quant.a.b._recursive_"),
    ],
)
def test_hydra_instantiate_keys_anywhere_below_a_pass_are_refused(overrides: list[str], named: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(f"{named} is refused")):
        build_passes(compose_recipe(overrides))


def test_the_draft_recipe_is_guarded_too(booby_trapped_pickle: tuple[Path, Path]) -> None:
    payload, marker = booby_trapped_pickle
    overrides = ["speculative=draft", "+speculative.draft.prune.x._target_=torch.load"]
    overrides += [
        f"+speculative.draft.prune.x._args_=[{payload}]",
        "+speculative.draft.prune.x.weights_only=false",
    ]
    with pytest.raises(ConfigError, match=re.escape("prune.x._target_ is refused")):
        draft_passes(compose_recipe(overrides))
    assert not marker.exists()


def test_plain_nested_settings_still_reach_the_pass() -> None:
    (smooth, *_rest) = build_passes(compose_recipe(["quant=int8", "quant.calibration.num_samples=3"]))
    assert smooth.config.calibration.num_samples == 3


def test_the_command_line_refuses_a_nested_target_in_one_line(
    tiny_llama: Path, tmp_path: Path, booby_trapped_pickle: tuple[Path, Path]
) -> None:
    from tests.pipeline.test_main import run_pipeline

    payload, marker = booby_trapped_pickle
    result = run_pipeline(tiny_llama, tmp_path, "run", *nested_target_overrides(payload))
    assert result.returncode == 2, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: quant.x._target_ is refused"), result.stderr
    assert "Traceback" not in result.stderr
    assert not marker.exists()
    assert not (tmp_path / "run" / "manifest.json").exists()


@pytest.fixture
def remote_code_checkpoint(tiny_llama: Path, tmp_path: Path) -> tuple[Path, Path]:
    """(a tiny Llama copy with a modeling file that would create the marker if imported, marker)."""
    folder = Path(shutil.copytree(tiny_llama, tmp_path / "ckpt"))
    marker = tmp_path / "MARKER"
    (folder / "modeling_evil.py").write_text(
        f"import pathlib\npathlib.Path({str(marker)!r}).touch()\n"
        "from transformers import LlamaForCausalLM as EvilForCausalLM\n"
        "from transformers import LlamaConfig as EvilConfig\n"
    )
    return folder, marker


@pytest.mark.parametrize(
    ("file", "key", "value"),
    [
        ("config.json", "auto_map", {"AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"}),
        ("config.json", "auto_map", {"AutoConfig": "modeling_evil.EvilConfig"}),
        ("config.json", "trust_remote_code", True),
        ("tokenizer_config.json", "auto_map", {"AutoTokenizer": ["modeling_evil.Evil", None]}),
    ],
)
def test_a_checkpoint_asking_for_remote_code_is_refused_in_one_line(
    remote_code_checkpoint: tuple[Path, Path], tmp_path: Path, file: str, key: str, value: object
) -> None:
    folder, marker = remote_code_checkpoint
    data = json.loads((folder / file).read_text())
    data[key] = value
    (folder / file).write_text(json.dumps(data))
    with pytest.raises(SourceError) as error:
        resolve_source(ModelConfig(name="evil", path=str(folder)), tmp_path / "models")
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith(f"model.path={folder}: {file} has {key} (remote code)")
    assert "this pipeline never runs checkpoint code: remove the key" in message
    assert not marker.exists()


def test_the_loaders_never_run_checkpoint_code(remote_code_checkpoint: tuple[Path, Path]) -> None:
    """Behind the source check, the loaders themselves pass trust_remote_code=False."""
    from pipeline.core.torch_model import load_causal_lm, load_tokenizer

    folder, marker = remote_code_checkpoint
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(SourceError, match="auto_map"):
        check_hf_llama(folder)
    with contextlib.suppress(SourceError):  # refusing is fine too; running the file is not
        load_causal_lm(folder)
    load_tokenizer(folder)
    assert not marker.exists()


def python_files() -> list[Path]:
    skip = {".venv", "build", "artifacts", ".git"}
    return [p for p in REPO.rglob("*.py") if not skip & set(p.relative_to(REPO).parts)]


def test_no_source_file_loads_a_pickle() -> None:
    """A guard beside the behavioural tests: no pickle loading anywhere in the repository."""
    patterns = [
        re.compile(r"weights_only\s*=\s*False"),
        re.compile(r"\btorch\.load\("),
        re.compile(r"\bpickle\.loads?\("),
        re.compile(r"\b(?:cloudpickle|dill|joblib)\.load"),
        re.compile(r"trust_remote_code\s*=\s*True"),
    ]
    found = []
    for path in python_files():
        if path == Path(__file__).resolve():
            continue  # this file pickles its own harmless marker
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if any(p.search(line) for p in patterns):
                found.append(f"{path.relative_to(REPO)}:{number}: {line.strip()}")
    assert not found, "\n".join(found)


def test_every_tokenizer_and_config_load_refuses_remote_code() -> None:
    """Every ``from_pretrained`` of an Auto class outside the tests names trust_remote_code=False."""
    call = re.compile(r"Auto\w+\.from_(?:pretrained|config)\(([^()]*(?:\([^()]*\)[^()]*)*)\)", re.S)
    missing = []
    for path in python_files():
        if "tests" in path.relative_to(REPO).parts:
            continue
        for match in call.finditer(path.read_text(errors="replace")):
            if "trust_remote_code=False" not in match.group(1):
                line = path.read_text()[: match.start()].count("\n") + 1
                missing.append(f"{path.relative_to(REPO)}:{line}")
    assert not missing, missing
