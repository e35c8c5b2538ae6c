"""`edgeswarm infer`'s options: the ones every serving kind reads are the command line's own, each kind's own come
through its ``infer_arguments`` hook, only when the command is ``infer`` (``--help`` and the other verbs import no
kind), and a kind refuses what does not fit its jobs with one actionable line."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from edgeswarm.cli.kind_commands import add_kind_arguments
from edgeswarm.cli.main import build_parser
from edgeswarm.cli.serve import add_serve_parsers
from edgeswarm.errors import ConfigError
from edgeswarm.plugins import load_target
from edgeswarm.workloads import workload
from helpers import FAST_ENV

SHARED = ("--hub", "--npz", "--count", "--window", "--timeout", "--show", "--out", "--json")
OWN = {"serve-pipeline": ("--rows",), "serve-hmp": ("--text", "--tokens", "--max-new-tokens")}


def _infer_parser(*, kind_options: bool) -> argparse.ArgumentParser:
    sub = argparse.ArgumentParser(prog="edgeswarm").add_subparsers(dest="command")
    add_serve_parsers(sub, kind_options=kind_options)
    return sub.choices["infer"]


def _options(parser: argparse.ArgumentParser) -> set[str]:
    return {o for action in parser._actions for o in action.option_strings}


def test_the_infer_parser_gets_a_kinds_own_options_through_its_hook() -> None:
    bare = _options(_infer_parser(kind_options=False))
    assert set(SHARED) <= bare and not bare & {o for own in OWN.values() for o in own}, bare
    assert workload("serve-hmp").infer_arguments == "edgeswarm.hmp.cli:add_infer_arguments"
    hook = load_target(workload("serve-hmp").infer_arguments, "serve-hmp's infer options")
    parser = _infer_parser(kind_options=False)
    hook(parser)
    args = parser.parse_args(["job", "--max-new-tokens", "5", "--tokens", "1,2", "--tokens", "3"])
    assert args.max_new_tokens == 5 and args.tokens == ["1,2", "3"] and args.count is None
    with pytest.raises(SystemExit):  # --rows is serve-pipeline's: not on a parser only serve-hmp's hook added to
        parser.parse_args(["job", "--rows", "2"])


def test_edgeswarm_infer_offers_every_installed_kinds_options_and_each_kinds_defaults() -> None:
    argv = ["infer", "job", "--rows", "3"]
    args = build_parser(argv).parse_args(argv)
    assert (args.rows, args.max_new_tokens, args.text, args.tokens, args.count, args.npz) == (3, None, None, None,
                                                                                            None, None)
    shown = subprocess.run([sys.executable, "-m", "edgeswarm", "infer", "--help"], capture_output=True, text=True,
                           env={**os.environ, **FAST_ENV, "COLUMNS": "200"}, timeout=120, check=True).stdout
    for option in (*SHARED, *OWN["serve-pipeline"], *OWN["serve-hmp"]):
        assert f"{option} " in shown, (option, shown)


def test_only_the_infer_command_imports_the_kinds_for_their_options() -> None:
    probe = ("import sys; from edgeswarm.cli.main import build_parser; build_parser(sys.argv[1:]); "
             "print(sorted(m for m in sys.modules if m.split('.')[1:2] in (['hmp'], ['pipeline_serve'])))")
    for argv, imported in ((["status"], False), (["serve", "x.yaml"], False), (["infer", "job"], True)):
        out = subprocess.run([sys.executable, "-c", probe, *argv], capture_output=True, text=True, check=True,
                             timeout=120).stdout
        assert ("edgeswarm.hmp.cli" in out and "edgeswarm.pipeline_serve.cli" in out) == imported, (argv, out)


def test_a_kinds_option_another_kind_already_has_is_a_warning_not_a_crash() -> None:
    parser = _infer_parser(kind_options=False)
    parser.add_argument("--rows", type=int, default=1)  # as a plug-in's kind might have declared it first
    add_kind_arguments(parser, "infer_arguments")
    assert "--max-new-tokens" in _options(parser)  # the other kinds' options are still added


def _args(*argv: str) -> argparse.Namespace:
    full = ["infer", "job", *argv]
    return build_parser(full).parse_args(full)


@pytest.mark.parametrize(("argv", "says"), [
    (("--text", "hi", "--count", "2"), "--text and --count are two sources of inputs"),
    (("--tokens", "1,2", "--npz", "x.npz"), "--tokens and --npz are two sources of inputs"),
    (("--max-new-tokens", "-1"), "--max-new-tokens must be at least 0"),
])
def test_serve_hmp_refuses_two_input_sources_and_a_negative_token_count(argv: tuple[str, ...], says: str) -> None:
    infer = load_target(workload("serve-hmp").infer_cli, "serve-hmp's infer")
    state = SimpleNamespace(kind="serve-hmp", job_id="job", spec="")
    with pytest.raises(ConfigError, match=says):  # before it reads the job's spec or touches the bus
        infer(_args(*argv), None, state, None)


@pytest.mark.parametrize(("argv", "says"), [
    (("--text", "hi"), "it takes tensors"),
    (("--rows", "0"), "--rows must be at least 1"),
])
def test_serve_pipeline_refuses_text_and_no_rows(argv: tuple[str, ...], says: str) -> None:
    infer = load_target(workload("serve-pipeline").infer_cli, "serve-pipeline's infer")
    state = SimpleNamespace(kind="serve-pipeline", job_id="job", spec="")
    with pytest.raises(ConfigError, match=says):
        infer(_args(*argv), None, state, None)
    with pytest.raises(SystemExit):  # argparse still refuses --text with --tokens (serve-hmp's own group)
        _args("--text", "a", "--tokens", "1")
