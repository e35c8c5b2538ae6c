"""`make test` and `make run` check what they need from the operating system before anything else
(deploy/system-packages.sh): a machine that lacks a package is told the exact `sudo apt-get install` line (or, as root,
gets it installed), and never reaches pytest to fail there with an INTERNALERROR. Run on a PATH made for the test, so
the machine's own packages are not seen."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from helpers import REPO

SCRIPT = REPO / "deploy" / "system-packages.sh"
TEST_PACKAGES = "mosquitto mosquitto-clients iproute2 nftables iptables faketime chromium npm"
TOOLS = ("mosquitto", "mosquitto_sub", "ip", "nft", "iptables", "faketime", "chromium", "npm")
NOBODY = 65534


@pytest.fixture
def tmp_path() -> Iterator[Path]:
    """A temporary folder another user can read: pytest's own, and the session's TMPDIR (tests/conftest.py) inside
    them, sit in root's private one, so this one is made in /tmp itself and removed after the test."""
    with tempfile.TemporaryDirectory(prefix="es-system-", dir="/tmp") as folder:
        os.chmod(folder, 0o755)
        yield Path(folder)


def bare_path(tmp_path: Path, *tools: str) -> Path:
    """A fresh folder for PATH with only what the script itself runs (id, mktemp, tail, rm) and a fake of each of
    ``tools``."""
    folder = Path(tempfile.mkdtemp(dir=tmp_path))
    for name in ("id", "mktemp", "tail", "rm"):
        found = shutil.which(name)
        assert found is not None, name
        (folder / name).symlink_to(found)
    for name in tools:
        fake = folder / name
        fake.write_text("#!/bin/sh\nexit 0\n")
        fake.chmod(0o755)
    folder.chmod(0o755)
    return folder


def check(purpose: str, path: Path, *, as_nobody: bool, venv: bool = True) -> subprocess.CompletedProcess[str]:
    """The script run on ``path``, its Python a fake that can (``venv``) or cannot import venv and ensurepip."""
    python = path / ("python-with-venv" if venv else "python-without-venv")
    python.write_text(f"#!/bin/sh\nexit {0 if venv else 1}\n")
    python.chmod(0o755)
    env = {"PATH": str(path), "SBIN_DIRS": "", "PYTHON": str(python)}
    nobody = [str(shutil.which("setpriv")), f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]
    prefix = nobody if as_nobody else []
    return subprocess.run([*prefix, "/bin/sh", str(SCRIPT), purpose], env=env, capture_output=True, text=True,
                          timeout=60)


needs_root = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                                reason="runs the check as another user: needs root and setpriv")


@needs_root
def test_a_user_is_told_the_exact_apt_line_and_make_stops(tmp_path: Path) -> None:
    done = check("test", bare_path(tmp_path), as_nobody=True)
    assert done.returncode == 1, done
    said = f"make test needs Debian packages this machine lacks: sudo apt-get install -y {TEST_PACKAGES}\n"
    assert done.stderr == said
    assert done.stdout == ""
    # Only what is missing is named.
    done = check("test", bare_path(tmp_path, "mosquitto", "ip", "nft", "chromium"), as_nobody=True)
    assert done.returncode == 1 and done.stderr.endswith(
        "sudo apt-get install -y mosquitto-clients iptables faketime npm\n"), done
    # make run falls back to the embedded broker: Mosquitto is optional there, a Python that makes venvs is not.
    assert check("run", bare_path(tmp_path), as_nobody=True).returncode == 0
    done = check("run", bare_path(tmp_path), as_nobody=True, venv=False)
    assert done.returncode == 1 and done.stderr.endswith("sudo apt-get install -y mosquitto python3-venv\n"), done


@needs_root
def test_nothing_to_do_when_every_tool_is_there(tmp_path: Path) -> None:
    done = check("test", bare_path(tmp_path, *TOOLS), as_nobody=True)
    assert (done.returncode, done.stdout, done.stderr) == (0, "", "")


def test_root_without_apt_get_is_told_the_line_too(tmp_path: Path) -> None:
    done = check("test", bare_path(tmp_path), as_nobody=False)
    assert done.returncode == 1 and "sudo apt-get install -y mosquitto " in done.stderr, done


def test_make_checks_the_system_before_the_suite_and_ci_only_runs_make_test() -> None:
    planned = subprocess.run(["make", "-n", "-B", "test"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert planned.returncode == 0, planned.stderr
    lines = planned.stdout.splitlines()
    first_check = next(i for i, line in enumerate(lines) if "deploy/system-packages.sh test" in line)
    suite = next(i for i, line in enumerate(lines) if "-m pytest" in line)
    venv = next(i for i, line in enumerate(lines) if "-m venv" in line)
    assert first_check < venv < suite, lines
    ci = [line for line in (REPO / ".ci" / "run").read_text().splitlines() if line and not line.startswith("#")]
    assert ci[-1] == "make test" and not any("apt-get" in line for line in ci), ci
    listed = subprocess.run(["sh", str(SCRIPT), "test", "--list"], capture_output=True, text=True, timeout=60)
    assert listed.stdout.split() == [*TEST_PACKAGES.split(), "python3-venv"]
    readme = " ".join((REPO / "README.md").read_text().split())  # the list as the README words it
    assert ", ".join(TEST_PACKAGES.split()) in readme


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                    reason="hides mosquitto in a private mount namespace: needs root and unshare")
def test_the_suite_without_mosquitto_says_so_and_never_an_internal_error() -> None:
    hidden = Path(str(shutil.which("mosquitto", path=f"{os.environ.get('PATH', '')}:/usr/sbin:/usr/local/sbin")))
    # Only this command's own mount namespace sees /dev/null (not executable) over the broker.
    script = f"mount --bind /dev/null {hidden} && exec {sys.executable} -m pytest -q -n 2 -p no:cacheprovider " \
             "tests/test_codec.py"
    done = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    said = done.stdout + done.stderr
    assert done.returncode == 4, said  # pytest's usage error
    assert "the test suite needs mosquitto on PATH" in said and "INTERNALERROR" not in said, said
