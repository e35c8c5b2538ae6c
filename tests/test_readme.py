"""The README and its reference page stay true: the commands, topic tree, device classes and settings match the code."""

from __future__ import annotations

import ast

from edgeswarm.devices.catalogue import CATALOGUE
from edgeswarm.settings import Settings
from edgeswarm.topics import TOPIC_TREE
from helpers import REPO

README = (REPO / "README.md").read_text()
# The reference tables (topic tree, device classes, settings) live in docs/reference.md, linked from the README.
REFERENCE = (REPO / "docs" / "reference.md").read_text()


def test_the_two_commands_come_first() -> None:
    first_block = README.split("```")[1]
    assert "make run" in first_block and "make test" in first_block
    makefile = (REPO / "Makefile").read_text()
    assert "\nrun:" in makefile and "\ntest:" in makefile
    assert "make test" in (REPO / ".ci" / "run").read_text()


def test_every_topic_is_documented() -> None:
    for spec in TOPIC_TREE:
        assert f"`{spec.pattern}`" in REFERENCE, f"docs/reference.md does not document {spec.pattern}"


def test_the_device_class_table_matches_the_catalogue() -> None:
    for c in CATALOGUE.values():
        row = (f"| `{c.name}` | {c.description} | {c.compute_slowdown:g} | {c.memory_bytes / 2**30:g} GiB | "
               f"{c.memory_budget_bytes / 2**30:.3g} GiB | {c.link.bandwidth_bps * 8 / 1e6:g} Mbps, "
               f"{c.link.latency_s * 1e3:g} ms |")
        assert row in REFERENCE, f"docs/reference.md's row for {c.name} is out of date; expected:\n{row}"


def test_every_setting_is_documented() -> None:
    for name in Settings.model_fields:
        assert f"EDGESWARM_{name.upper()}" in REFERENCE, f"docs/reference.md does not document EDGESWARM_{name.upper()}"


def test_the_wire_format_document_names_every_schema_and_field() -> None:
    import edgeswarm.messages  # noqa: F401 - registers the schemas
    from edgeswarm.wire import registered

    doc = (REPO / "docs" / "wire-format.md").read_text()
    for cls in registered():
        assert f"`{cls.SCHEMA}`" in doc, f"docs/wire-format.md does not describe {cls.SCHEMA}"
        for field in cls.model_fields:
            assert f"`{field}`" in doc, f"docs/wire-format.md does not name {cls.SCHEMA}'s field {field}"


def test_the_workload_guides_registry_entry_is_the_toys_whole_file_and_complete() -> None:
    guide = (REPO / "docs" / "adding-a-workload.md").read_text()
    section = guide.split("## 5. The registry entry", 1)[1]
    block = section.split("```python\n", 1)[1].split("```", 1)[0]
    toy = (REPO / "tests" / "plugins" / "edgeswarm-toy" / "edgeswarm_toy" / "workload.py").read_text()
    # tests/test_plugins.py installs that file and runs its jobs on a cluster: the guide's block runs as pasted.
    assert toy.split('"""', 2)[2].lstrip("\n") == block, "the guide's ToyWorkload is not the toy's workload.py"
    # Read, not imported (importing would register the toy's schemas in this process): nothing abstract is left.
    from edgeswarm.workloads.base import Workload

    cls = next(n for n in ast.parse(block).body if isinstance(n, ast.ClassDef) and n.name == "ToyWorkload")
    methods = {n.name for n in cls.body if isinstance(n, ast.FunctionDef)}
    assert Workload.__abstractmethods__ <= methods and "model_name" in methods, methods


def test_every_kinds_spec_is_documented_as_its_model_says() -> None:
    from edgeswarm.workloads.reference import with_spec_references

    assert with_spec_references(REFERENCE) == REFERENCE, (
        "docs/reference.md's job-spec tables differ from the spec models: regenerate them as "
        "edgeswarm.workloads.reference.with_spec_references says")
    for kind in ("train-hpp", "serve-pipeline", "serve-hmp", "train-splitfed"):
        assert f"### `{kind}`" in REFERENCE
    assert "| `training.sample_pruning` | true or false | true |" in REFERENCE


def test_the_netns_page_names_every_package_up_netns_needs() -> None:
    from edgeswarm.netns.host import TOOLS

    page = (REPO / "docs" / "netns.md").read_text()
    apt = " ".join(line for line in page.splitlines() if line.startswith("apt-get install -y"))
    assert set(TOOLS.values()) | {"faketime"} <= set(apt.split()), apt
