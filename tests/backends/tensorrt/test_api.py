"""The TensorRT backend only uses names that exist in the real TensorRT 11.4 Python bindings.

TensorRT itself cannot be installed here, but its bindings wheel (``tensorrt-cu13-bindings==11.4.0.106``,
1.3 MB, no dependencies) can: its ``tensorrt.so`` imports against three tiny stub libraries
(``stubs/*.c``, compiled with gcc here) that define only the C entry points it links to. The bindings are
imported in a subprocess with ``LD_LIBRARY_PATH`` pointing at the stubs, and every ``trt.`` attribute chain found
in the backend's source by ``ast`` (no hand-kept list) is resolved there.

Install the wheel with: ``pip install --no-deps tensorrt-cu13-bindings==11.4.0.106`` (wheels for CPython 3.10-3.13,
manylinux_2_28 x86_64; it has no required dependencies, ``--no-deps`` keeps it that way).
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
BACKEND_DIR = REPO / "autotune" / "backends" / "tensorrt"
STUBS = Path(__file__).resolve().parent / "stubs"
BINDINGS_DIST = "tensorrt_cu13_bindings"
BINDINGS_VERSION = "11.4.0.106"
INSTALL_LINE = f"pip install --no-deps tensorrt-cu13-bindings=={BINDINGS_VERSION}"

TRT_ALIAS = "trt"
"""The name the backend imports TensorRT as (``trt = import_tensorrt()`` / ``self.trt``)."""

TRT_OBJECTS = {
    "builder": "Builder",
    "network": "INetworkDefinition",
    "parser": "OnnxParser",
    "builder_config": "IBuilderConfig",
    "profile": "IOptimizationProfile",
    "timing_cache": "ITimingCache",
    "runtime": "Runtime",
    "engine": "ICudaEngine",
    "context": "IExecutionContext",
    "inspector": "EngineInspector",
}
"""The backend's naming convention for TensorRT objects: ``engine.x`` is checked as ``trt.ICudaEngine.x``."""

KNOWN_10X_ONLY = {
    "CUBLAS",
    "CUBLAS_LT",
    "CUDNN",
    "EXPLICIT_BATCH",
    "PROFILE_SHARING_0806",
    "MULTIDEVICE_RUNTIME_10_16",
}
"""Names that may be looked up by string (behind a version guard) although TensorRT 11.4 lacks them."""


@dataclass(frozen=True)
class Use:
    """One attribute chain resolved from the ``tensorrt`` module, e.g. ``("BuilderFlag", "FP16")``."""

    chain: tuple[str, ...]
    where: str
    guarded: bool = False  # looked up by string (hasattr/getattr/__members__.get): may be absent in 11.4

    @property
    def dotted(self) -> str:
        return "trt." + ".".join(self.chain)


def _names(node: ast.AST) -> list[str] | None:
    """``a.b.c`` as ``["a", "b", "c"]``; None when the chain does not start at a plain name."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(node.id)
    return parts[::-1]


def _rooted(parts: list[str]) -> tuple[str, ...] | None:
    """The part of a dotted name below TensorRT: after ``trt`` (also ``self.trt``), or a conventional object."""
    if TRT_ALIAS in parts[:-1]:
        return tuple(parts[parts.index(TRT_ALIAS) + 1 :])
    for index, part in enumerate(parts[:-1]):
        if part.lstrip("_") in TRT_OBJECTS:
            return (TRT_OBJECTS[part.lstrip("_")], parts[index + 1])
    return None


def _receiver(parts: list[str] | None) -> tuple[str, ...] | None:
    """The TensorRT chain of an object whose attribute is looked up by string: ``trt``, ``trt.X``, ``engine``."""
    if not parts:
        return None
    if TRT_ALIAS in parts:
        return tuple(parts[parts.index(TRT_ALIAS) + 1 :])
    last = parts[-1].lstrip("_")
    return (TRT_OBJECTS[last],) if last in TRT_OBJECTS else None


def trt_uses(source: str, filename: str = "<source>") -> list[Use]:
    """Every TensorRT name a source uses: maximal ``trt.`` attribute chains, object members, string lookups."""
    tree = ast.parse(source)
    inner = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    uses = []
    for node in ast.walk(tree):
        where = f"{filename}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Attribute) and id(node) not in inner:
            parts = _names(node)
            chain = _rooted(parts) if parts else None
            if chain:
                uses.append(Use(chain, where))
        if isinstance(node, ast.Call) and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant):
            # hasattr(trt.X, "name") / getattr(obj, "name", None): a guarded lookup of "name" on the receiver.
            func = node.func
            if isinstance(func, ast.Name) and func.id in ("hasattr", "getattr"):
                base = _receiver(_names(node.args[0]))
                if base is not None and isinstance(node.args[1].value, str):
                    uses.append(Use((*base, node.args[1].value), where, guarded=True))
        if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            # trt.X.__members__.get("NAME"): a guarded lookup of member NAME of enum X.
            func = node.func
            if isinstance(func, ast.Attribute) and func.attr == "get":
                receiver = _names(func.value)
                if receiver and receiver[-1] == "__members__" and TRT_ALIAS in receiver:
                    chain = _rooted(receiver)
                    if chain and isinstance(node.args[0].value, str):
                        uses.append(Use((*chain[:-1], node.args[0].value), where, guarded=True))
    return uses


def backend_sources() -> dict[str, str]:
    """The TensorRT backend's modules: every module of its package, found by globbing, not listed."""
    files = sorted(BACKEND_DIR.glob("*.py"))
    return {str(path.relative_to(REPO)): path.read_text() for path in files if path.is_file()}


# ---- the real bindings, imported against the stubs ---------------------------------------------------------

_RESOLVER = """
import json, sys
import tensorrt_bindings as trt
request = json.load(sys.stdin)
missing = []
for chain in request["chains"]:
    obj = trt
    for name in chain:
        try:
            obj = getattr(obj, name)
        except AttributeError:
            missing.append(chain)
            break
members = {}
for enum in request["enums"]:
    cls = getattr(trt, enum, None)
    members[enum] = None if cls is None else {k: int(v) for k, v in cls.__members__.items()}
print(json.dumps({"version": trt.__version__, "missing": missing, "members": members}))
"""


def _bindings_dir() -> Path:
    try:
        version = importlib.metadata.version(BINDINGS_DIST)
    except importlib.metadata.PackageNotFoundError:
        pytest.skip(f"the TensorRT 11.4 Python bindings are not installed; for this check run: {INSTALL_LINE}")
    if version != BINDINGS_VERSION:
        pytest.skip(f"{BINDINGS_DIST} {version} is installed; this check is written for {BINDINGS_VERSION}")
    spec = importlib.util.find_spec("tensorrt_bindings")
    if spec is None or spec.origin is None:
        pytest.skip(f"{BINDINGS_DIST} is installed but tensorrt_bindings is not importable")
    return Path(spec.origin).parent


@pytest.fixture(scope="module")
def stub_libs(tmp_path_factory) -> Path:
    """The three stub libraries, compiled from stubs/*.c into a temporary folder."""
    _bindings_dir()
    gcc = shutil.which("gcc") or shutil.which("cc")
    if gcc is None:
        pytest.skip("no C compiler (gcc) to build the TensorRT stub libraries")
    out = tmp_path_factory.mktemp("trt_stubs")
    for lib in ("nvinfer", "nvonnxparser", "nvinfer_plugin"):
        target = out / f"lib{lib}.so.11"
        subprocess.run(
            [gcc, "-shared", "-fPIC", "-O0", "-o", str(target), f"-Wl,-soname,{target.name}", str(STUBS / f"{lib}.c")],
            check=True,
            capture_output=True,
        )
    return out


@pytest.fixture(scope="module")
def resolve(stub_libs):
    """``resolve(chains, enums)`` -> ``{"version", "missing", "members"}`` from the real 11.4 bindings."""

    def run(chains: list[tuple[str, ...]], enums: tuple[str, ...] = ()) -> dict:
        env = dict(os.environ)
        env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [str(stub_libs), env.get("LD_LIBRARY_PATH")]))
        done = subprocess.run(
            [sys.executable, "-c", _RESOLVER],
            input=json.dumps({"chains": [list(c) for c in chains], "enums": list(enums)}),
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, f"importing the bindings against the stubs failed:\n{done.stderr}"
        return json.loads(done.stdout)

    return run


def _missing(resolve, uses: list[Use]) -> list[Use]:
    chains = sorted({use.chain for use in uses})
    missing = {tuple(chain) for chain in resolve(chains)["missing"]}
    return [use for use in uses if use.chain in missing]


def test_stubs_cover_every_undefined_entry_point_of_the_bindings():
    so = _bindings_dir() / "tensorrt.so"
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("nm (binutils) is not installed")
    undefined = subprocess.run([nm, "-D", "--undefined-only", str(so)], capture_output=True, text=True, check=True)
    wanted = {
        line.split()[-1]
        for line in undefined.stdout.splitlines()
        if line.split()[-1].startswith(("create", "get", "init")) and "@" not in line
    }
    defined = set()
    for source in STUBS.glob("*.c"):
        tree = source.read_text()
        defined |= {name for name in wanted if f" {name}(" in tree or f"*{name}(" in tree}
    assert wanted and wanted <= defined, f"stubs lack {sorted(wanted - defined)}"


def test_every_trt_name_the_backend_uses_exists_in_tensorrt_11_4(resolve):
    uses = [use for path, source in backend_sources().items() for use in trt_uses(source, path)]
    direct = [use for use in uses if not use.guarded]
    assert len({use.chain for use in direct}) >= 25, "the walker found too few TensorRT names; is it broken?"
    missing = _missing(resolve, direct)
    assert not missing, "names absent from TensorRT 11.4:\n" + "\n".join(f"{u.where}: {u.dotted}" for u in missing)


def test_names_looked_up_by_string_exist_or_are_known_10x_names(resolve):
    uses = [use for path, source in backend_sources().items() for use in trt_uses(source, path) if use.guarded]
    assert any(use.chain[-1] == "STRONGLY_TYPED" for use in uses), "the 10.x network flag must be looked up by name"
    unexplained = [use for use in _missing(resolve, uses) if use.chain[-1] not in KNOWN_10X_ONLY]
    assert not unexplained, "guarded names in no version:\n" + "\n".join(f"{u.where}: {u.dotted}" for u in unexplained)


def test_a_planted_removed_name_is_reported(resolve):
    planted = (
        "import tensorrt as trt\n"
        "def build(builder_config, engine):\n"
        "    builder_config.set_flag(trt.BuilderFlag.FP16)\n"
        "    builder_config.int8_calibrator = None\n"
        "    size = engine.device_memory_size\n"
        "    ok = trt.BuilderFlag.TF32\n"
        "    source = trt.TacticSource.__members__.get('CUBLASS')\n"
    )
    uses = trt_uses(planted, "planted.py")
    reported = {use.dotted for use in _missing(resolve, uses)}
    assert "trt.BuilderFlag.FP16" in reported
    assert "trt.IBuilderConfig.int8_calibrator" in reported
    assert "trt.ICudaEngine.device_memory_size" in reported
    assert "trt.TacticSource.CUBLASS" in reported  # a misspelt guarded name is caught too
    assert "trt.BuilderFlag.TF32" not in reported and "trt.IBuilderConfig.set_flag" not in reported


def test_walker_finds_chains_through_aliases():
    source = (
        "def f(self, artifact):\n"
        "    trt = self.trt\n"
        "    a = self.trt.TacticSource.__members__\n"
        "    b = trt.ILogger.Severity.ERROR\n"
        "    artifact.context.execute_async_v3(0)\n"
        "    hasattr(trt.IBuilderConfig, 'max_num_tactics')\n"
        "    trt.NetworkDefinitionCreationFlag.__members__.get('STRONGLY_TYPED')\n"
    )
    found = {(use.chain, use.guarded) for use in trt_uses(source)}
    assert (("TacticSource", "__members__"), False) in found
    assert (("ILogger", "Severity", "ERROR"), False) in found
    assert (("IExecutionContext", "execute_async_v3"), False) in found
    assert (("IBuilderConfig", "max_num_tactics"), True) in found
    assert (("NetworkDefinitionCreationFlag", "STRONGLY_TYPED"), True) in found


def test_golden_fakes_match_the_real_11_4_enums(resolve):
    from tests.backends.tensorrt.fakes import ENUMS_11

    real = resolve([], tuple(ENUMS_11))
    assert real["version"] == BINDINGS_VERSION
    for enum, members in ENUMS_11.items():
        assert real["members"][enum] == members, enum
    precision_flags = resolve([("BuilderFlag", name) for name in ("FP16", "INT8", "BF16", "FP8")])["missing"]
    assert len(precision_flags) == 4  # TensorRT 11 has no precision flags: strong typing only
