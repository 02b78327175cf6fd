"""``python -m benchmarks.scaling``'s parts that decide its numbers: the random checkpoint writer (a
loadable Llama of the asked shape and parameter count, sharded or not, reused only when it checks
out), the exponent fit, and the disk accounting (a hard-linked file counts once)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

from benchmarks import scaling


def _tiny(tied: bool) -> scaling.Shape:
    # vocab 320: the tiny tokenizer's (tests/conftest.py); head_dim 16
    return scaling.Shape("tiny", "test", 64, 3, 4, 2, 96, tied=tied, vocab=320, max_positions=256)


@pytest.mark.parametrize("tied", [True, False])
def test_the_writer_makes_a_loadable_llama_of_the_shape(tiny_llama: Path, tmp_path: Path, tied: bool) -> None:
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    from pipeline.sources import check_hf_llama

    shape = _tiny(tied)
    folder = tmp_path / "ckpt"
    assert scaling.write_checkpoint(shape, folder, tiny_llama, seed=3)
    check_hf_llama(folder)  # the pipeline's own check of a model.path folder
    config = json.loads((folder / "config.json").read_text())
    assert {k: config[k] for k in shape.config()} == shape.config()
    assert config["bos_token_id"] == 1 and config["eos_token_id"] == 2  # the tokenizer's model's
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "pt") as handle:
        stored = {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118
    assert {t.dtype for t in stored.values()} == {torch.bfloat16}
    assert ("lm_head.weight" in stored) is not tied
    assert sum(t.numel() for t in stored.values()) == shape.parameters()
    # the count by hand: embeddings + 3 x (q,o 64x64; k,v 64x32; gate,up,down 64x96; 2 norms) + norm
    layer = 2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 96 + 2 * 64
    by_hand = 320 * 64 + 3 * layer + 64 + (0 if tied else 320 * 64)
    assert shape.parameters() == by_hand

    model = LlamaForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    assert sum(p.numel() for p in model.parameters()) == shape.parameters()
    assert model.config.num_hidden_layers == 3 and model.config.num_key_value_heads == 2
    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids = tokenizer("The quick brown fox", return_tensors="pt").input_ids
    logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], 320) and torch.isfinite(logits).all()
    weight = stored["model.layers.0.mlp.up_proj.weight"].float()
    assert abs(weight.std().item() - 0.02) < 0.002  # HF init: normal(0, 0.02)
    assert torch.equal(stored["model.norm.weight"], torch.ones(64, dtype=torch.bfloat16))


def test_the_writer_shards_reuses_and_rewrites(tiny_llama: Path, tmp_path: Path) -> None:
    import torch
    from transformers import LlamaForCausalLM

    shape = _tiny(tied=True)
    whole, sharded = tmp_path / "whole", tmp_path / "sharded"
    scaling.write_checkpoint(shape, whole, tiny_llama, seed=0)
    assert scaling.write_checkpoint(shape, sharded, tiny_llama, seed=0, shard_bytes=40_000)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in sharded.glob("*.safetensors"))
    assert len(shards) > 1 and set(index["weight_map"].values()) == set(shards)
    a = LlamaForCausalLM.from_pretrained(whole, dtype=torch.bfloat16).state_dict()
    b = LlamaForCausalLM.from_pretrained(sharded, dtype=torch.bfloat16).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # seeded per tensor name

    mtime = (whole / "model.safetensors").stat().st_mtime_ns
    assert not scaling.write_checkpoint(shape, whole, tiny_llama, seed=0)  # verified, kept
    assert (whole / "model.safetensors").stat().st_mtime_ns == mtime
    with open(whole / "model.safetensors", "r+b") as handle:  # a flipped byte: digest mismatch
        handle.seek(-1, os.SEEK_END)
        last = handle.read(1)
        handle.seek(-1, os.SEEK_END)
        handle.write(bytes([last[0] ^ 1]))
    assert scaling.write_checkpoint(shape, whole, tiny_llama, seed=0)
    assert not scaling.write_checkpoint(shape, whole, tiny_llama, seed=0)
    assert scaling.write_checkpoint(shape, whole, tiny_llama, seed=1)  # another seed: rewritten
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())  # no staging left


def test_the_fit_recovers_a_known_exponent() -> None:
    params = [135e6, 360e6, 1.1e9, 3e9]
    a, b = scaling.fit_exponent(params, [2e-7 * p**1.3 for p in params])
    assert b == pytest.approx(1.3, abs=1e-9) and a == pytest.approx(2e-7, rel=1e-6)
    noisy = [3e-6 * p * f for p, f in zip(params, [1.05, 0.97, 1.02, 0.99], strict=True)]
    assert scaling.fit_exponent(params, noisy)[1] == pytest.approx(1.0, abs=0.05)
    assert scaling.fit_exponent([1e8, 1e8], [1.0, 2.0]) is None  # one shape: no exponent
    assert scaling.fit_exponent([1e8, 1e9], [1.0, 0.0]) is None

    def build(params: float, seconds: float, rss: int) -> dict[str, object]:
        passes = [{"name": "export", "seconds": seconds, "cpu_seconds": seconds / 2, "peak_rss_bytes": rss}]
        total = {"seconds": seconds + 5, "peak_rss_bytes": rss + 2**30}
        return {"status": "ok", "params": params, "recipe": "none", "passes": passes, "total": total}

    builds = [build(p, 1e-6 * p**1.5, int(8 * p)) for p in params]
    builds.append({**build(5e9, 1.0, 1), "status": "refused"})  # not a measurement
    found = {f["pass"]: f for f in scaling.fits(builds)}
    assert found["export"]["time_exponent"] == pytest.approx(1.5, abs=1e-3)
    assert found["export"]["cpu_exponent"] == pytest.approx(1.5, abs=1e-3)
    assert found["export"]["rss_exponent"] == pytest.approx(1.0, abs=1e-3)
    assert found["total"]["cpu_exponent"] is None and found["total"]["rss_exponent"] is not None
    assert found["export"]["time_flag"] and found["export"]["shapes"] == 4
    only_large = {f["pass"]: f for f in scaling.fits(builds, min_params=int(1e9))}
    assert only_large["export"]["shapes"] == 2


def test_disk_accounting_counts_a_hard_linked_file_once(tmp_path: Path) -> None:
    cache, run, source = tmp_path / "cache", tmp_path / "run", tmp_path / "source"
    for folder in (cache, run, source):
        folder.mkdir()
    (source / "weights.bin").write_bytes(b"s" * 700)
    before = scaling.inodes([cache, run, source])
    (cache / "model.onnx.data").write_bytes(b"x" * 1000)
    os.link(cache / "model.onnx.data", run / "model.onnx.data")  # the run folder's engine: a link
    os.link(source / "weights.bin", cache / "weights.bin")  # a link to a file that was there before
    (run / "manifest.json").write_bytes(b"{}" * 12)
    (run / "link").symlink_to(cache / "model.onnx.data")
    assert scaling.new_bytes([cache, run], before) == 1000 + 24
    assert scaling.new_bytes([cache, run]) == 1000 + 24 + 700
    os.unlink(run / "model.onnx.data")
    (run / "model.onnx.data").write_bytes(b"x" * 1000)  # a copy is new bytes
    assert scaling.new_bytes([cache, run], before) == 2000 + 24


def test_a_memory_refusal_is_told_apart_from_other_errors() -> None:
    line = "error: pass 'int4_awq' needs about 30.1 GiB, 20.0 GiB available: lower pipeline.max_memory_gib"
    assert scaling.is_preflight_refusal(2, line)
    assert not scaling.is_preflight_refusal(1, line)
    assert not scaling.is_preflight_refusal(2, "error: model.path=/x does not exist: set model.path")


def test_the_real_shapes() -> None:
    # published counts: SmolLM2-135M 134.5M, SmolLM2-360M 361.8M (same vocabulary)
    assert math.isclose(scaling.SHAPES["135m"].parameters(), 134_515_008)
    assert math.isclose(scaling.SHAPES["360m"].parameters(), 361_821_120)
    assert scaling.SHAPES["3b"].head_dim == 128 and not scaling.SHAPES["1.1b"].tied


def test_report_merges_the_builds_of_several_saved_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    host = {"cpu": "test", "logical_cores": 2, "physical_cores": 2, "usable_cores": 2, "memory_gib": 24.0}

    def saved(shape: str, seconds: float) -> Path:
        params = scaling.SHAPES[shape].parameters()
        export = {"name": "export", "seconds": seconds, "cpu_seconds": seconds, "peak_rss_bytes": 2**30}
        export |= {"cache_hit": False, "estimate_bytes": 2**31, "measured_by": "pass"}
        build = {
            "shape": shape, "like": "x", "params": params, "fp32_bytes": 4 * params, "recipe": "none",
            "status": "ok", "note": "", "passes": [export], "load_before": [0.1, 0.1, 0.1],
            "load_after": [0.1, 0.1, 0.1], "disk_added_bytes": 4 * params, "disk_ratio_fp32": 1.0,
            "total": {"seconds": seconds, "cpu_seconds": seconds, "peak_rss_bytes": 2**30},
        }  # fmt: skip
        path = tmp_path / f"{shape}.json"
        record = {"host": host, "load_at_start": [0.1] * 3, "load_at_end": [0.1] * 3, "builds": [build]}
        path.write_text(json.dumps({**record, "fit_from": None, "fits": [], "interrupted": False}))
        return path

    assert scaling.main(["--report", str(saved("360m", 10.0)), str(saved("1.1b", 30.0))]) == 0
    out = capsys.readouterr().out
    assert "360m" in out and "1.1b" in out and "no exponents" not in out  # two shapes: one fit
    with pytest.raises(SystemExit) as refused:
        scaling.main(["--report", str(tmp_path / "missing.json")])
    assert refused.value.code == 2 and "missing.json: no such file" in capsys.readouterr().err
