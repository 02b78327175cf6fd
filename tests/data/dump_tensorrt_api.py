"""Regenerate ``tests/data/tensorrt_<major>_<minor>_api.json``: the members of the real TensorRT
Python bindings that our TensorRT code calls, with each member's kind and signatures.

TensorRT cannot run on a machine without an NVIDIA GPU, and its libraries come from NVIDIA's own
package index. The bindings wheel (``tensorrt-cu13-bindings``, a few MB) installs from PyPI;
its compiled module links against three libraries (libnvinfer, libnvonnxparser,
libnvinfer_plugin) but calls nothing in them at import. So this script:

1. installs the bindings wheel into a throwaway venv (no other package);
2. compiles three stub libraries with the right sonames that define the eleven symbols the
   module imports (every function returns 0: nothing here may call them);
3. imports the bindings against the stubs and reads, for every member of the classes below,
   its kind (``method``, ``static``, ``property`` with ``writable``, ``value`` for enum
   members, ``class``) and, for methods, every overload's parameters as pybind11 writes them in
   the docstring (``name(self: T, a: A, b: B = 0) -> R``);
4. writes the JSON (``--check``: compares instead, exit 1 on a difference).

``tests/passes/test_tensorrt_build.py`` checks every TensorRT call in our code against the JSON:
member names, method versus property, writable properties, and argument counts. It needs a C
compiler and PyPI, so CI runs it only when asked (``TENSORRT_API_CHECK=1 .ci/run``).

    python tests/data/dump_tensorrt_api.py [--version 11.4.0.106] [--check]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
VERSION = "11.4.0.106"
WHEEL = "tensorrt-cu13-bindings"
# The symbols tensorrt_bindings/tensorrt.so imports from each library (``nm -D --undefined-only``).
STUBS = {
    "libnvinfer": [
        "createInferBuilder_INTERNAL",
        "createInferRefitter_INTERNAL",
        "createInferRuntime_INTERNAL",
        "getBuilderPluginRegistry",
        "getPluginRegistry",
    ],
    "libnvonnxparser": [
        "createNvOnnxParser_INTERNAL",
        "createNvOnnxParserRefitter_INTERNAL",
        "getNvOnnxParserVersion",
    ],
    "libnvinfer_plugin": ["initLibNvInferPlugins"],
}
# The classes pipeline/runtime/tensorrt.py, passes/tensorrt_build.py and pipeline/core/lint.py use.
CLASSES = (
    "Builder", "DataType", "HardwareCompatibilityLevel", "IBuilderConfig", "ICudaEngine",
    "IExecutionContext", "IHostMemory", "INetworkDefinition", "IOptimizationProfile", "ITimingCache",
    "Logger", "MemoryPoolType", "OnnxParser", "ParserError", "Runtime",
)  # fmt: skip

# Runs inside the throwaway venv, against the stubs: prints the JSON's "classes".
INTROSPECT = r'''
import inspect, json, sys
import tensorrt_bindings as trt

OPEN, CLOSE = "([{<", ")]}>"

def split_params(text):
    """Top-level comma-separated pieces of a pybind11 parameter list."""
    pieces, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch in OPEN:
            depth += 1
        elif ch in CLOSE and not (ch == ">" and text[i - 1] == "-"):
            depth -= 1
        elif ch == "," and depth == 0:
            pieces.append(text[start:i].strip())
            start = i + 1
    if text[start:].strip():
        pieces.append(text[start:].strip())
    return pieces

def overloads(name, doc):
    """Every signature of ``name`` in a pybind11 docstring: params after self, and how many
    of them have no default."""
    found = []
    for line in (doc or "").splitlines():
        line = line.strip()
        if line[:1].isdigit() and ". " in line:
            line = line.split(". ", 1)[1]
        if not line.startswith(name + "("):
            continue
        depth, end = 0, None
        for i, ch in enumerate(line[len(name):], len(name)):
            if ch in OPEN:
                depth += 1
            elif ch in CLOSE and not (ch == ">" and line[i - 1] == "-"):
                depth -= 1
                if depth == 0:
                    end = i
                    break
        params = split_params(line[len(name) + 1 : end])
        if params == ["*args", "**kwargs"]:
            continue  # the header of an overload set
        names = [p.split(":")[0].split("=")[0].strip() for p in params]
        if names and names[0] == "self":
            params, names = params[1:], names[1:]
        found.append({
            "params": names,
            "required": sum(1 for p in params if "=" not in p and not p.startswith("*")),
            "signature": line,
        })
    return found

def member(cls, name):
    attr = inspect.getattr_static(cls, name)
    if isinstance(attr, property):
        return {"kind": "property", "writable": attr.fset is not None}
    if isinstance(attr, staticmethod):
        func = attr.__func__
        return {"kind": "static", "overloads": overloads(name, func.__doc__)}
    if isinstance(attr, type):
        return {"kind": "class"}
    if hasattr(type(attr), "__members__"):
        return {"kind": "value"}
    if callable(attr):
        return {"kind": "method", "overloads": overloads(name, getattr(cls, name).__doc__)}
    return {"kind": type(attr).__name__}

classes = {}
for class_name in sys.argv[1:]:
    cls = getattr(trt, class_name)
    members = {n: member(cls, n) for n in sorted(dir(cls)) if not n.startswith("_")}
    constructor = member(cls, "__init__")
    if constructor["overloads"]:  # pybind11 gives a class without one "No constructor defined!"
        members["__init__"] = constructor
    classes[class_name] = members
print(json.dumps({"version": trt.__version__, "classes": classes}))
'''


def stub_libraries(folder: Path) -> None:
    """Three shared libraries with TensorRT's sonames whose functions all return 0."""
    for library, symbols in STUBS.items():
        source = folder / f"{library}.c"
        source.write_text("".join(f"long {symbol}(void) {{ return 0; }}\n" for symbol in symbols))
        target = folder / f"{library}.so.11"
        subprocess.run(
            ["cc", "-shared", "-fPIC", f"-Wl,-soname,{target.name}", "-o", str(target), str(source)],
            check=True,
        )


def dump(version: str) -> dict:
    """The API snapshot of the bindings wheel ``version``, read in a throwaway venv."""
    with tempfile.TemporaryDirectory(prefix="trt-api-") as tmp:
        folder = Path(tmp)
        subprocess.run([sys.executable, "-m", "venv", str(folder / "venv")], check=True)
        python = folder / "venv" / "bin" / "python"
        subprocess.run(
            [str(python), "-m", "pip", "install", "-q", "--no-deps", f"{WHEEL}=={version}"], check=True
        )
        stub_libraries(folder)
        env = {**os.environ, "LD_LIBRARY_PATH": str(folder)}
        result = subprocess.run(
            [str(python), "-c", INTROSPECT, *CLASSES], check=True, capture_output=True, text=True, env=env
        )
    data = json.loads(result.stdout)
    return {
        "source": f"{WHEEL} {data['version']} (PyPI wheel): the classes our TensorRT code uses, read "
        "by pybind11 introspection with stub libraries (no GPU) by tests/data/dump_tensorrt_api.py",
        **data,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python tests/data/dump_tensorrt_api.py", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--version", default=VERSION, help=f"bindings wheel version (default {VERSION})")
    parser.add_argument("--check", action="store_true", help="compare with the committed file; do not write")
    args = parser.parse_args(argv)
    major, minor = args.version.split(".")[:2]
    path = HERE / f"tensorrt_{major}_{minor}_api.json"
    snapshot = dump(args.version)
    text = json.dumps(snapshot, indent=1, sort_keys=True) + "\n"
    if args.check:
        if not path.is_file() or path.read_text() != text:
            print(f"{path} differs from the bindings {args.version}: rerun without --check", file=sys.stderr)
            return 1
        print(f"{path}: matches {WHEEL} {args.version}")
        return 0
    staging = path.with_name(f".{path.name}.tmp")
    staging.write_text(text)
    os.replace(staging, path)
    print(f"wrote {path} ({sum(len(m) for m in snapshot['classes'].values())} members)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
