"""The package installs where the devices are: Python 3.10 code only (JetPack 6), a wheel that works outside the
source tree, a torch range rather than a pin, and the embedded broker and plotting as optional extras."""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sysconfig
import textwrap
import zipfile
from collections.abc import Iterator
from email.parser import Parser
from pathlib import Path

import pytest

from helpers import REPO, venv_with_wheel

SOURCES = sorted(p for root in ("shared", "services") for p in (REPO / root).rglob("*.py")
                 if "__pycache__" not in p.parts)

# Standard-library names that appeared after Python 3.10, by module: `module.name` or `from module import name`.
NEWER_THAN_310: dict[str, set[str]] = {
    "datetime": {"UTC"},
    "typing": {"Self", "Never", "LiteralString", "assert_never", "reveal_type", "Required", "NotRequired", "override",
               "TypeVarTuple", "Unpack"},
    "enum": {"StrEnum"},
    "asyncio": {"TaskGroup", "timeout"},
    "contextlib": {"chdir"},
    "hashlib": {"file_digest"},
    "itertools": {"batched"},
}
NEW_MODULES = {"tomllib"}
NEW_BUILTINS = {"ExceptionGroup", "BaseExceptionGroup"}
# Methods that only exist from 3.11 on, on objects the scan cannot type: BaseException.add_note and Path.walk (the
# scan takes any `.walk(` that is not os.walk for Path's).
NEW_METHODS = {"add_note"}


def newer_than_310(tree: ast.AST) -> Iterator[tuple[int, str]]:
    """(line, what) for each use of a standard-library name that Python 3.10 lacks."""
    modules: dict[str, str] = {}  # local name -> the module it is bound to
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in NEW_MODULES:
                    yield node.lineno, f"import {alias.name}"
                modules[alias.asname or alias.name.split(".")[0]] = alias.name
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module is not None:
            if node.module in NEW_MODULES:
                yield node.lineno, f"from {node.module} import ..."
            for alias in node.names:
                if alias.name in NEWER_THAN_310.get(node.module, ()):
                    yield node.lineno, f"from {node.module} import {alias.name}"
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            owner = modules.get(node.value.id) if isinstance(node.value, ast.Name) else None
            if owner is not None and node.attr in NEWER_THAN_310.get(owner, ()):
                yield node.lineno, f"{owner}.{node.attr}"
            elif node.attr in NEW_METHODS:
                yield node.lineno, f".{node.attr}()"
            elif node.attr == "walk" and owner is None:  # a module's walk (os.walk, ast.walk) is no Path.walk
                yield node.lineno, ".walk() (Path.walk is 3.12; os.walk works everywhere)"
        elif isinstance(node, ast.Name) and node.id in NEW_BUILTINS:
            yield node.lineno, node.id


def test_the_scan_finds_each_kind_of_newer_name() -> None:
    src = textwrap.dedent("""
        import tomllib
        import datetime as dt
        import os
        import ast
        from typing import Self
        from enum import StrEnum
        import asyncio
        x = dt.UTC
        asyncio.TaskGroup()
        err.add_note("x")
        path.walk()
        os.walk(".")
        ast.walk(tree)
        raise ExceptionGroup("x", [])
    """)
    found = [what for _, what in newer_than_310(ast.parse(src))]
    assert sorted(found) == sorted(["import tomllib", "from typing import Self", "from enum import StrEnum",
                                    "datetime.UTC", "asyncio.TaskGroup", ".add_note()",
                                    ".walk() (Path.walk is 3.12; os.walk works everywhere)", "ExceptionGroup"])


def test_every_module_is_python_310_syntax_and_library() -> None:
    problems = []
    for path in SOURCES:
        src = path.read_text()
        rel = path.relative_to(REPO)
        try:
            tree = ast.parse(src, filename=str(rel), feature_version=(3, 10))
        except SyntaxError as exc:
            problems.append(f"{rel}:{exc.lineno}: not Python 3.10 syntax: {exc.msg}")
            continue
        problems += [f"{rel}:{line}: {what} is newer than Python 3.10 (JetPack 6 runs 3.10)"
                     for line, what in newer_than_310(tree)]
    assert not problems, "\n".join(problems)


def python310() -> str | None:
    """A Python 3.10 interpreter on this machine, or None."""
    found = shutil.which("python3.10")
    if found and subprocess.run([found, "--version"], capture_output=True).returncode == 0:  # not a pyenv shim
        return found
    for candidate in sorted((Path.home() / ".pyenv" / "versions").glob("3.10*/bin/python")):
        return str(candidate)
    return None


COMPILE = """
import py_compile, sys
from pathlib import Path
out = Path(sys.argv[1])
failed = 0
for i, src in enumerate(sys.argv[2:]):
    try:
        py_compile.compile(src, cfile=str(out / f"{i}.pyc"), doraise=True)
    except py_compile.PyCompileError as exc:
        failed += 1
        print(exc.msg)
sys.exit(1 if failed else 0)
"""


def test_every_module_compiles_with_python_310(tmp_path: Path) -> None:
    interpreter = python310()
    if interpreter is None:
        pytest.skip("no Python 3.10 interpreter here (python3.10 on PATH or ~/.pyenv/versions/3.10*)")
    result = subprocess.run([interpreter, "-c", COMPILE, str(tmp_path), *map(str, SOURCES)], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


# --- the wheel, installed outside the source tree ----------------------------------------------------------------

# What the `broker` and `plot` extras bring; left out of the fresh environment to show the core works without them.
EXTRA_MODULES = ("amqtt", "matplotlib", "mpl_toolkits", "pylab")


def _visible_dependencies(into: Path) -> Path:
    """A folder of links to everything in this test's site-packages except the extras' modules and any edgeswarm
    (the wheel must provide it), so the fresh environment finds the dependencies without a download."""
    into.mkdir()
    site = Path(sysconfig.get_paths()["purelib"])
    for entry in site.iterdir():
        name = entry.name.lower()
        if (name.startswith(EXTRA_MODULES) or "edgeswarm" in name or name.endswith(".pth")
                or name in ("pip", "__pycache__")):
            continue
        (into / entry.name).symlink_to(entry)
    return into


def _copy_source(dest: Path) -> Path:
    # A copy, so that the build's own folders (build/, *.egg-info) never mix stale files into the wheel.
    skip = shutil.ignore_patterns(".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", "out", ".*cache",
                                  ".hypothesis", "tests", "docs", "deploy", "examples")
    shutil.copytree(REPO, dest, ignore=skip)
    return dest


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the wheel, the fresh venv it is installed in), with the dependencies visible through a .pth file."""
    pytest.importorskip("setuptools", reason="building the wheel without a download needs setuptools here")
    tmp = tmp_path_factory.mktemp("install")
    src = _copy_source(tmp / "src")
    python, target_site = venv_with_wheel(src, tmp, "edgeswarm-*.whl")
    wheel = next((tmp / "dist").glob("edgeswarm-*.whl"))
    (target_site / "deps.pth").write_text(f"{_visible_dependencies(tmp / 'deps')}\n")
    return wheel, python.parent.parent


def _run(env_dir: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return subprocess.run(list(args), cwd=cwd, env={**env, "PATH": f"{env_dir / 'bin'}:{env['PATH']}"},
                          capture_output=True, text=True, timeout=120)


@pytest.mark.slow
def test_the_wheel_installs_and_runs_outside_the_source_tree(installed: tuple[Path, Path], tmp_path: Path) -> None:
    _, env_dir = installed
    version = _run(env_dir, tmp_path, str(env_dir / "bin" / "edgeswarm"), "--version")
    assert version.returncode == 0 and version.stdout.startswith("edgeswarm "), version.stderr
    probe = textwrap.dedent("""
        import importlib.resources, importlib.util, json
        import edgeswarm, edgeswarm.services.node_agent, edgeswarm.cli.main
        clusters = sorted(p.name for p in (importlib.resources.files("edgeswarm.devices") / "clusters").iterdir())
        print(json.dumps({"file": edgeswarm.__file__, "clusters": clusters,
                          "extras": [m for m in ("amqtt", "matplotlib") if importlib.util.find_spec(m)]}))
    """)
    out = _run(env_dir, tmp_path, str(env_dir / "bin" / "python"), "-c", probe)
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout)
    assert Path(seen["file"]).resolve().is_relative_to(env_dir.resolve()), seen["file"]
    assert "asteroid-env-d-100mbps.yaml" in seen["clusters"]
    assert seen["extras"] == []  # what follows runs without the optional parts
    topics = _run(env_dir, tmp_path, "edgeswarm", "topics", "--json")
    assert topics.returncode == 0 and "edgeswarm/cluster/view" in topics.stdout, topics.stderr


IMPORT_ALL = """
import importlib, json, pkgutil
import edgeswarm
from edgeswarm.errors import MissingExtraError
needs_extra, failed = [], {}
for info in pkgutil.walk_packages(edgeswarm.__path__, "edgeswarm."):
    if info.name.endswith("__main__"):  # importing it runs the command line
        continue
    try:
        importlib.import_module(info.name)
    except MissingExtraError:
        needs_extra.append(info.name)
    except Exception as exc:
        failed[info.name] = repr(exc)
print(json.dumps({"needs_extra": sorted(needs_extra), "failed": failed}))
"""


@pytest.mark.slow
def test_every_module_imports_without_the_extras_but_the_plotting_and_flower_ones(installed: tuple[Path, Path],
                                                                      tmp_path: Path) -> None:
    _, env_dir = installed
    out = _run(env_dir, tmp_path, str(env_dir / "bin" / "python"), "-c", IMPORT_ALL)
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout)
    assert seen["failed"] == {}
    assert sorted(seen["needs_extra"]) == ["edgeswarm.hpp.curves", "edgeswarm.planning.hpp.render",
                                           "edgeswarm.splitfed.peer_flower"]


@pytest.mark.slow
@pytest.mark.parametrize(("args", "extra"), [
    (("plan", "--model", "mlp", "--profiles", "none.json", "--png", "plan.png"), "plot"),
    (("up", "--local", "--broker", "amqtt", "--port", "0"), "broker"),
])
def test_a_command_that_needs_a_missing_extra_says_which_to_install(installed: tuple[Path, Path], tmp_path: Path,
                                                                    args: tuple[str, ...], extra: str) -> None:
    _, env_dir = installed
    result = _run(env_dir, tmp_path, "edgeswarm", *args)
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr
    assert f"pip install 'edgeswarm[{extra}]'" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_the_wheel_metadata_asks_for_310_a_torch_range_and_extras(installed: tuple[Path, Path]) -> None:
    wheel, _ = installed
    with zipfile.ZipFile(wheel) as zf:
        name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        meta = Parser().parsestr(zf.read(name).decode())
    assert meta["Requires-Python"] == ">=3.10"
    requires = meta.get_all("Requires-Dist")
    torch = [r for r in requires if r.startswith("torch")]
    assert len(torch) == 1 and "==" not in torch[0] and ">=" in torch[0], torch
    for optional, extra in (("amqtt", "broker"), ("matplotlib", "plot")):
        lines = [r for r in requires if r.startswith(optional)]
        assert lines and all(f'extra == "{extra}"' in r for r in lines), lines
    assert {"broker", "plot", "all", "test"} <= set(meta.get_all("Provides-Extra"))


def test_up_without_mosquitto_or_the_broker_extra_says_how_to_get_either(monkeypatch: pytest.MonkeyPatch) -> None:
    import edgeswarm.local.broker as local_broker
    from edgeswarm.errors import MissingExtraError

    monkeypatch.setattr(local_broker, "mosquitto_binary", lambda: None)
    monkeypatch.setattr(local_broker, "has_extra", lambda extra: False)
    with pytest.raises(MissingExtraError, match=r"apt-get install mosquitto.*pip install 'edgeswarm\[broker\]'"):
        local_broker.resolve_kind("auto")
