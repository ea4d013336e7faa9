"""The package's shape: dependencies point one way, no module grows past its concept, CLI and API agree."""

from __future__ import annotations

import ast
import functools
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

LAYERS: list[tuple[str, ...]] = [
    # bottom: the config, the plan, the measurement, the model and the run's records; each folder is one concept
    (
        "autotune",
        "autotune.config",
        "autotune.plan",
        "autotune.extras",
        "autotune.capabilities",
        "autotune.measure",
        "autotune.model",
        "autotune.run",
    ),
    ("autotune.data", "autotune.metrics"),
    ("autotune.quant", "autotune.search"),
    ("autotune.backends",),
    # the self-check runs FP32 through the harness' evaluator: the one measurement module above the harness
    ("autotune.harness", "autotune.measure.selfcheck"),
    ("envs",),
    ("autotune.api", "autotune.monitor", "autotune.report", "autotune.confirm", "autotune.headline"),
    ("autotune.tune",),
    ("autotune.cli", "autotune.__main__", "autotune.testing", "autotune.examples", "autotune.docgen"),
]
"""Each module's layer, bottom first: a module may import its own layer's modules and the layers below it."""


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    files = [*ROOT.joinpath("autotune").rglob("*.py"), *ROOT.joinpath("envs").rglob("*.py")]
    return {_module_name(path): path for path in files}


def _imports(path: Path, known: set[str]) -> set[str]:
    """Every project module a file imports, at module level or inside functions (a lazy import is a dependency)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
        found.update(name for name in names if name in known)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    return {name: _imports(path, known) - {name} for name, path in modules.items()}


def _layer(module: str) -> int:
    best = (-1, -1)  # (prefix length, layer): the longest matching prefix decides
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best[0]:
                best = (len(prefix), index)
    if best[1] < 0:
        raise AssertionError(f"{module} has no layer in LAYERS: add it where it belongs")
    return best[1]


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of imports as the list of modules around it, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: finished
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for child in sorted(graph.get(node, ())):
            if state.get(child) == 1:
                return path[path.index(child) :] + [child]
            if child not in state and (cycle := visit(child)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_cycle_finder_finds_a_planted_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_no_import_cycle():
    cycle = find_cycle(_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


FACADE_EXPORTS = {"autotune": {"autotune.api"}}
"""The package's own ``__init__`` may re-export the API, lazily (PEP 562 ``__getattr__``): see the test below."""


def test_dependencies_point_down_the_layers():
    upward = [
        f"{module} (layer {_layer(module)}) imports {target} (layer {_layer(target)})"
        for module, targets in sorted(_graph().items())
        for target in sorted(targets - FACADE_EXPORTS.get(module, set()))
        if _layer(target) > _layer(module) and not module.startswith(target + ".")
    ]
    assert not upward, "\n".join(upward)


def test_importing_the_package_loads_config_and_plan_only_until_the_api_is_asked_for():
    script = (
        "import json, sys, autotune\n"
        "before = sorted(m for m in sys.modules if m.startswith('autotune.'))\n"
        "heavy = [m for m in ('onnx', 'onnxruntime', 'torch', 'numpy') if m in sys.modules]\n"
        "print(json.dumps({'before': before, 'heavy': heavy, 'load': autotune.load.__module__}))"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, cwd=ROOT)
    found = json.loads(out.stdout)
    assert not [m for m in found["before"] if m.startswith(("autotune.api", "autotune.backends", "autotune.harness"))]
    assert found["heavy"] == [] and found["load"] == "autotune.api"


def test_the_search_never_imports_the_env_and_the_env_only_the_search():
    graph = _graph()
    for module, targets in graph.items():
        if module.startswith("autotune.search"):  # the agent is handed the env's constructor by the run
            assert not any(t.startswith("envs") for t in targets), module
    for target in graph["envs.engine_build"]:
        assert _layer(target) <= _layer("autotune.search"), target


@pytest.mark.parametrize("path", sorted(_modules().values()), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_module_over_600_lines(path):
    lines = len(path.read_text().splitlines())
    assert lines <= 600, f"{path.relative_to(ROOT)} has {lines} lines: cut it by concept"


def test_the_cli_offers_the_strategies_and_precisions_the_api_takes():
    from autotune.cli import build_parser
    from autotune.plan import PRECISIONS
    from autotune.search.registry import STRATEGIES

    parser = build_parser()
    commands = next(a for a in parser._actions if a.dest == "command").choices
    strategy = next(a for a in commands["baseline"]._actions if a.dest == "strategy")
    assert tuple(strategy.choices) == tuple(STRATEGIES)
    assert {"ppo", "planner", "random", "greedy", "optuna", *PRECISIONS} == set(STRATEGIES)
    plan_help = next(a for a in commands["evaluate"]._actions if a.dest == "plan").help
    assert all(precision in plan_help for precision in PRECISIONS)


MOST_LINES = 60
"""The longest a function may be, from its ``def`` line to its last line (docstring and nested code included)."""

MOST_PARAMETERS = 8
"""The most parameters a function may take, ``self`` and ``cls`` not counted (``*args`` and ``**kwargs`` are)."""


OVER_THE_RULE: dict[str, str] = {}
"""``path:qualified name`` -> why that function may break the rule for now. The list only shrinks: an entry whose
function keeps the rule (or is gone) fails the test until it is removed."""


def _rule_breakers(source: str) -> dict[str, str]:
    """The functions of a module's source over :data:`MOST_LINES` lines or :data:`MOST_PARAMETERS` parameters.

    Returns:
        Qualified name (``Class.method``; a nested function as ``outer.inner``) -> what is over the rule.
    """
    found: dict[str, str] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if not isinstance(child, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                visit(child, prefix)  # a def inside an if or a with keeps its parent's name
                continue
            name = prefix + child.name
            if not isinstance(child, ast.ClassDef):
                args = child.args
                named = [a for a in (*args.posonlyargs, *args.args, *args.kwonlyargs) if a.arg not in ("self", "cls")]
                parameters = len(named) + (args.vararg is not None) + (args.kwarg is not None)
                lines = child.end_lineno - child.lineno + 1
                over = [f"{lines} lines"] if lines > MOST_LINES else []
                over += [f"{parameters} parameters"] if parameters > MOST_PARAMETERS else []
                if over:
                    found[name] = ", ".join(over)
            visit(child, name + ".")

    visit(ast.parse(source), "")
    return found


@functools.cache
def _package_rule_breakers() -> dict[str, str]:
    """``path:qualified name`` -> what is over the rule, for every function of the package and the env."""
    return {
        f"{path.relative_to(ROOT).as_posix()}:{name}": over
        for path in sorted(_modules().values())
        for name, over in _rule_breakers(path.read_text()).items()
    }


def test_every_function_within_60_lines_and_8_parameters():
    new = {key: over for key, over in _package_rule_breakers().items() if key not in OVER_THE_RULE}
    listed = "\n".join(f"  {key}: {over}" for key, over in sorted(new.items()))
    assert not new, f"split these by concept into named helpers (or group parameters in a dataclass):\n{listed}"


def test_the_functions_over_the_rule_only_get_fewer():
    kept = sorted(set(OVER_THE_RULE) - set(_package_rule_breakers()))
    assert not kept, "these keep the rule now (or are gone): remove them from OVER_THE_RULE: " + ", ".join(kept)


def test_the_rule_check_finds_long_and_wide_functions_by_qualified_name():
    body = "\n".join(f"        x{i} = {i}" for i in range(60))
    source = (
        f"class Box:\n    def long(self):\n{body}\n\n    def fits(self, a, b, c, d, e, f, g, h):\n        pass\n\n\n"
        "def wide(a, b, c, d, e, f, g, *rest, **named):\n    def inner(cls, a, b, c, d, e, f, g, h, i):\n        pass\n"
    )
    assert _rule_breakers(source) == {
        "Box.long": "61 lines",
        "wide": "9 parameters",
        "wide.inner": "9 parameters",
    }
    shorter = source.replace("        x58 = 58\n", "")
    assert "Box.long" not in _rule_breakers(shorter)


CONFIG_ENTRY_POINTS = ("autotune/tune.py", "autotune/api.py", "autotune/cli.py", "autotune/config/")
"""Where the whole ``TuneConfig`` is read: the config's own package and the entry points that hand its parts on."""

MOST_CONFIG_TAKERS = 5
"""Functions (and dataclass fields) outside :data:`CONFIG_ENTRY_POINTS` that may take the whole ``TuneConfig``."""

TAKES_THE_WHOLE_CONFIG: dict[str, str] = {
    "autotune/harness/evaluator.py:Evaluator.__init__": "starts the trial process or the pool the config ships to",
    "autotune/harness/executor.py:make_pool": "ships the config to each worker of the pool (child process, Ray actor)",
    "autotune/harness/process.py:ChildRunner.__init__": "ships the config to the trial process (a process boundary)",
    "autotune/harness/runner.py:TrialRunner.__init__": "prepares the run in the trial process from the shipped config",
}
"""``path:qualified name`` -> why it takes the whole config. The list only shrinks: an entry that no longer takes it
(or is gone) fails the test until it is removed."""


def _config_takers(source: str) -> set[str]:
    """Qualified names of a module's functions with a parameter typed ``TuneConfig`` and its dataclass fields typed so.

    A field is named ``Class.field``; a function ``Class.method`` (a nested function as ``outer.inner``).
    """
    found: set[str] = set()

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                for statement in child.body:
                    if isinstance(statement, ast.AnnAssign) and "TuneConfig" in ast.unparse(statement.annotation):
                        found.add(f"{prefix}{child.name}.{ast.unparse(statement.target)}")
            elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                args = child.args
                typed = [a.annotation for a in (*args.posonlyargs, *args.args, *args.kwonlyargs) if a.annotation]
                if any("TuneConfig" in ast.unparse(annotation) for annotation in typed):
                    found.add(prefix + child.name)
            else:
                visit(child, prefix)
                continue
            visit(child, prefix + child.name + ".")

    visit(ast.parse(source), "")
    return found


def _package_config_takers() -> set[str]:
    takers = set()
    for path in sorted(ROOT.joinpath("autotune").rglob("*.py")):
        relative = path.relative_to(ROOT).as_posix()
        if not relative.startswith(CONFIG_ENTRY_POINTS):
            takers |= {f"{relative}:{name}" for name in _config_takers(path.read_text())}
    return takers


def test_at_most_five_functions_past_the_entry_points_take_the_whole_config():
    takers = _package_config_takers()
    new = sorted(takers - set(TAKES_THE_WHOLE_CONFIG))
    assert not new, "pass these the sections they read (config.execution, config.reward, ...): " + ", ".join(new)
    assert len(TAKES_THE_WHOLE_CONFIG) <= MOST_CONFIG_TAKERS


def test_the_functions_taking_the_whole_config_only_get_fewer():
    gone = sorted(set(TAKES_THE_WHOLE_CONFIG) - _package_config_takers())
    assert not gone, (
        "these take the config no more (or are gone): remove them from TAKES_THE_WHOLE_CONFIG: " + ", ".join(gone)
    )


def test_the_config_check_finds_parameters_and_fields_by_qualified_name():
    source = (
        "class Run:\n    config: TuneConfig\n    other: int\n\n    def __init__(self, config: TuneConfig | None):\n"
        "        pass\n\n    def reads(self, reward: RewardConfig):\n        pass\n\n\n"
        "def outer(x: int):\n    def inner(*, config: 'TuneConfig'):\n        pass\n"
    )
    assert _config_takers(source) == {"Run.config", "Run.__init__", "outer.inner"}
