"""TensorRT execution of ``target=tensorrt`` engine folders (``model.plan`` + ``engine.json``).

A plan runs only on the TensorRT version and the GPU it was built for (TensorRT-LLM #222, #835;
``deserialize_cuda_engine`` just returns None elsewhere), and TensorRT has no API to read either
back from a plan. So the build records both in ``engine.json`` and :func:`check_build_match`
compares them with this machine before deserializing, with one line saying what differs.

The KV cache follows the concat layout the build pass requires: ``past_key_values.*`` in,
``present.*`` out, kept on the GPU between steps as torch CUDA tensors (torch is already a
dependency and its CUDA build manages device memory and streams); an fp8 cache
(``kv_cache.dtype=fp8``) is FP8 network I/O, held as ``torch.float8_e4m3fn``. Each step picks the
optimization profile its shape falls in (``decode`` for a few new tokens, else ``prefill``),
sets input shapes, binds addresses (``set_tensor_address``) and runs ``execute_async_v3`` on
torch's current stream; logits come back to the host as float32.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from pipeline.core.errors import ConfigError, EngineError
from pipeline.core.files import read_regular
from pipeline.core.gpu import GpuInfo


def check_build_match(recorded: dict[str, Any], trt_version: str, gpu: GpuInfo, where: Path) -> None:
    """Refuse a plan built for another TensorRT version or GPU (``recorded``: engine.json's
    ``tensorrt`` section)."""
    built_version = str(recorded.get("version", "?"))
    if built_version != trt_version:
        raise EngineError(
            f"{where} was built with TensorRT {built_version}, this machine has {trt_version}: "
            "rebuild the engine here (target=tensorrt) or install the TensorRT it was built with"
        )
    built_gpu = recorded.get("gpu", {})
    built_cc = str(built_gpu.get("compute_capability", "?"))
    if built_cc != gpu.compute_capability:
        raise EngineError(
            f"{where} was built for compute capability {built_cc} ({built_gpu.get('name', '?')}), this GPU "
            f"is {gpu.name} ({gpu.compute_capability}): rebuild the engine on this GPU"
        )
    if recorded.get("hardware_compatibility", "none") == "none" and built_gpu.get("name") != gpu.name:
        raise EngineError(
            f"{where} was built on {built_gpu.get('name')} without hardware compatibility, this GPU is "
            f"{gpu.name}: rebuild here, or build with target.hardware_compatibility=same_compute_capability"
        )


def pick_profile(profiles: dict[str, Any], new_tokens: int) -> int:
    """Index of the profile for a step of ``new_tokens`` tokens (profiles in build order)."""
    names = list(profiles)
    if "decode" in profiles:
        decode_max = profiles["decode"]["input_ids"][2][1]
        return names.index("decode" if new_tokens <= decode_max else "prefill")
    return 0


class TrtModel:
    """A TensorRT plan stepped with a KV cache (same interface as ``OrtModel``)."""

    def __init__(self, plan_file: Path, io: Any, spec: dict[str, Any]) -> None:
        from pipeline.core.gpu import require_tensorrt, tensorrt_module

        try:
            version, gpu = require_tensorrt()
        except ConfigError as exc:
            raise EngineError(f"{plan_file.parent} is a TensorRT engine: {exc}") from None
        if io.kv_layout != "concat" or io.window:
            raise EngineError(
                f"{plan_file.parent} records kv_layout '{io.kv_layout}' (window {io.window}); TensorRT "
                "engines here keep a concat cache: rebuild with kv_cache=concat"
            )
        recorded = spec.get("tensorrt")
        if not isinstance(recorded, dict):
            raise EngineError(f"{plan_file.parent}/engine.json has no 'tensorrt' section: rebuild the engine")
        check_build_match(recorded, version, gpu, plan_file.parent)
        import torch

        trt = tensorrt_module()
        self._torch = torch
        self.io = io
        self.profiles = recorded.get("profiles", {})
        self.logger = trt.Logger(trt.Logger.WARNING)
        self.runtime = trt.Runtime(self.logger)
        plan = read_regular(plan_file, within=plan_file.parent, what="a TensorRT plan")
        self.engine = self.runtime.deserialize_cuda_engine(plan)
        if self.engine is None:
            raise EngineError(f"TensorRT could not deserialize {plan_file}: its log above says why")
        self.context = self.engine.create_execution_context()
        self.device = torch.device("cuda")
        self._dtypes = {
            self.engine.get_tensor_name(i): _torch_dtype(
                torch, trt, self.engine.get_tensor_dtype(self.engine.get_tensor_name(i))
            )
            for i in range(self.engine.num_io_tensors)
        }
        self._past_names = io.past_names()
        self._present_names = io.present_names()
        self._profile = -1
        # an empty tensor (the cache before the first step) still gets a valid device address
        self._placeholder = torch.empty(256, dtype=torch.uint8, device=self.device)

    def empty_cache(self, batch: int) -> list[Any]:
        shape = (batch, self.io.num_kv_heads, 0, self.io.head_dim)
        empty = self._torch.empty
        return [empty(shape, dtype=self._dtypes[name], device=self.device) for name in self._past_names]

    def step(
        self,
        input_ids: np.ndarray,
        attention_mask: np.ndarray,
        position_ids: np.ndarray,
        cache: list[Any],
    ) -> tuple[np.ndarray, list[Any]]:
        """Run one forward; return logits [batch, seq, vocab] (host, float32) and the new cache."""
        torch = self._torch
        stream = torch.cuda.current_stream()
        profile = pick_profile(self.profiles, input_ids.shape[1])
        if profile != self._profile:
            self.context.set_optimization_profile_async(profile, stream.cuda_stream)
            self._profile = profile
        inputs = {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            **({"position_ids": position_ids} if self.io.has_position_ids else {}),
        }
        bound: dict[str, Any] = {}
        for name, array in inputs.items():
            tensor = torch.from_numpy(np.ascontiguousarray(array, dtype=np.int64)).to(self.device)
            bound[name] = tensor.to(self._dtypes[name])
        for name, value in zip(self._past_names, cache, strict=True):
            bound[name] = value.contiguous()
        for name, tensor in bound.items():
            if not self.context.set_input_shape(name, tuple(tensor.shape)):
                raise EngineError(
                    f"input {name} of shape {tuple(tensor.shape)} is outside the engine's optimization "
                    "profiles: rebuild with larger target.max_input_length / max_length / max_batch"
                )
        for name in ("logits", *self._present_names):
            shape = tuple(self.context.get_tensor_shape(name))
            bound[name] = torch.empty(shape, dtype=self._dtypes[name], device=self.device)
        for name, tensor in bound.items():
            address = tensor.data_ptr() if tensor.numel() else self._placeholder.data_ptr()
            self.context.set_tensor_address(name, address)
        if not self.context.execute_async_v3(stream.cuda_stream):
            raise EngineError("TensorRT failed to run the engine: its log above says why")
        logits = bound["logits"].float().cpu().numpy()  # synchronizes the stream
        return logits, [bound[name] for name in self._present_names]

    def cache_arrays(self, cache: list[Any]) -> list[np.ndarray]:
        """The cache as host numpy arrays (continuous batching rearranges rows there); an fp8
        cache as its raw codes (uint8), as the ONNX Runtime runtime keeps it."""
        torch = self._torch
        arrays = []
        for value in cache:
            if value.dtype == torch.bfloat16:
                value = value.float()
            elif value.dtype == torch.float8_e4m3fn:
                value = value.view(torch.uint8)
            arrays.append(value.cpu().numpy())
        return arrays

    def cache_from_arrays(self, arrays: Any) -> list[Any]:
        torch = self._torch
        dtypes = [self._dtypes[name] for name in self._past_names]
        tensors = []
        for array, dtype in zip(arrays, dtypes, strict=True):
            tensor = torch.from_numpy(np.ascontiguousarray(array)).to(self.device)
            # fp8 arrives as raw codes: reinterpret, never convert the numbers
            tensors.append(tensor.view(dtype) if dtype == torch.float8_e4m3fn else tensor.to(dtype))
        return tensors

    def truncate_cache(self, cache: list[Any], length: int) -> list[Any]:
        """The cache of the first ``length`` positions (speculative decoding's rollback)."""
        return [value[:, :, :length].contiguous() for value in cache]


def _torch_dtype(torch: Any, trt: Any, dtype: Any) -> Any:
    table = {
        trt.DataType.FLOAT: torch.float32,
        trt.DataType.HALF: torch.float16,
        trt.DataType.BF16: torch.bfloat16,
        trt.DataType.INT32: torch.int32,
        trt.DataType.INT64: torch.int64,
        trt.DataType.INT8: torch.int8,
        trt.DataType.FP8: torch.float8_e4m3fn,  # an fp8 KV cache (kv_cache.dtype=fp8)
        trt.DataType.BOOL: torch.bool,
    }
    if dtype not in table:
        raise EngineError(f"a TensorRT engine input/output of type {dtype} is not supported by this runtime")
    return table[dtype]
