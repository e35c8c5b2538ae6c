"""The package list: every folder with an ``__init__.py`` under shared/edgeswarm and services/ (pyproject.toml maps
them to the one ``edgeswarm`` import name), found here so that a new package or service needs no entry."""

from pathlib import Path

from setuptools import setup

HERE = Path(__file__).parent


def packages(root: Path, name: str) -> list[str]:
    """``name`` and every package below ``root``, dotted."""
    return [".".join([name, *p.relative_to(root).parts]) for p in sorted([root, *root.rglob("*")])
            if p.is_dir() and (p / "__init__.py").is_file() and "__pycache__" not in p.parts]


setup(packages=packages(HERE / "shared" / "edgeswarm", "edgeswarm") + packages(HERE / "services", "edgeswarm.services"))
