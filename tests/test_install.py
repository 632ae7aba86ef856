"""The two installs (issue 35): the user's and the tests'.

- ``bin/autotune`` runs ``bin/setup-env``: autotune and its runtime dependencies, nothing from the test extra.
- ``bin/test`` and ``.ci/run`` run ``bin/setup-env --test``: the test extra and arctic-training (``--no-deps``)
  added to the same ``.venv``.
- Each install runs once, and again when ``pyproject.toml`` or ``constraints-cpu.txt`` changes.

The scripts run in a scratch copy of ``bin/`` against a stub ``python3`` whose venv's ``python`` records its
arguments instead of installing anything: no network, a second or so. And the runtime code (autotune, trials,
search_spaces) imports nothing that only the test extra brings, unless the import is guarded (``pareto.html``
without plotly is skipped, not a crash).
"""

import ast
import os
import shutil
import subprocess
import time
from importlib import metadata
from pathlib import Path

import pytest
import tomllib
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
RUNTIME_PACKAGES = ("autotune", "trials", "search_spaces")
NO_DEPS_TEST_PACKAGES = ("arctic-training",)  # bin/setup-env --test installs it beside the extra, --no-deps

# The base interpreter: `python3 -m venv DIR` makes a venv whose python, autotune and ruff log their arguments.
# Asked for its site-packages (`python -c ...sysconfig...`), a venv's python names DIR/site-packages.
STUB_PYTHON3 = """#!/bin/sh
[ "$1" = -m ] && [ "$2" = venv ] || { echo "stub python3: unexpected $*" >&2; exit 3; }
echo "venv $3" >> "$STUB_LOG"
mkdir -p "$3/bin" "$3/site-packages"
for tool in python autotune ruff; do
  printf '#!/bin/sh\\necho "%s $*" >> "$STUB_LOG"\\n' "$tool" > "$3/bin/$tool"
  chmod +x "$3/bin/$tool"
done
printf '[ "$1" = -c ] && echo "%s/site-packages"\\nexit 0\\n' "$3" >> "$3/bin/python"
"""


class Checkout:
    """A scratch copy of the scripts, pyproject.toml and constraints-cpu.txt, run with only the stub on PATH."""

    def __init__(self, where: Path):
        self.root = where / "repo"
        self.log = where / "calls.log"
        for name in (
            "bin/setup-env",
            "bin/autotune",
            "bin/test",
            "pyproject.toml",
            "constraints-cpu.txt",
            "constraints-oldest.txt",
        ):
            (self.root / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, self.root / name)
        self.tools = where / "tools"
        self.tools.mkdir()
        (self.tools / "python3").write_text(STUB_PYTHON3)
        (self.tools / "python3").chmod(0o755)
        for tool in ("bash", "dirname", "touch", "mkdir", "chmod", "rm"):
            (self.tools / tool).symlink_to(shutil.which(tool))
        self.log.touch()

    def run(self, script: str, *args: str, ok: bool = True) -> list[str]:
        """Run one script; the calls it made to the stubs, one a line."""
        before = len(self.log.read_text().splitlines())
        done = subprocess.run(
            [shutil.which("bash"), str(self.root / script), *args],
            capture_output=True,
            text=True,
            env={"PATH": str(self.tools), "HOME": str(self.root.parent), "STUB_LOG": str(self.log)},
            timeout=60,
        )
        assert (done.returncode == 0) == ok, f"{script} {args}: exit {done.returncode}\n{done.stderr}"
        self.stderr = done.stderr
        return self.log.read_text().splitlines()[before:]

    def installs(self, calls: list[str]) -> list[str]:
        """The pip installs among the calls (the pip self-upgrade left out), repo path shortened to REPO."""
        return [
            call.replace(str(self.root), "REPO")
            for call in calls
            if call.startswith("python -m pip install") and "--upgrade pip" not in call
        ]

    def change(self, name: str):
        """Change a file the installs watch, after them: everything in the venvs ten seconds old, the file five."""
        now = time.time()
        for path in [*(self.root / ".venv").rglob("*"), *(self.root / ".venv-oldest").rglob("*")]:
            os.utime(path, (now - 10, now - 10))
        os.utime(self.root / name, (now - 5, now - 5))


XDIST = "-n auto --maxprocesses=4 --dist loadfile --no-loadscope-reorder"  # bin/test's pytest-xdist options
RUNTIME_INSTALL = "python -m pip install --quiet -c REPO/constraints-cpu.txt -e REPO"
TEST_INSTALLS = [
    "python -m pip install --quiet -c REPO/constraints-cpu.txt -e REPO[test]",
    "python -m pip install --quiet -c REPO/constraints-cpu.txt --no-deps arctic-training==0.8.0",
]


@pytest.fixture
def checkout(tmp_path) -> Checkout:
    return Checkout(tmp_path)


def test_first_run_of_bin_autotune_installs_the_runtime_dependencies_only(checkout):
    calls = checkout.run("bin/autotune", "models")
    assert calls[0] == f"venv {checkout.root / '.venv'}"
    assert checkout.installs(calls) == [RUNTIME_INSTALL]
    assert not [call for call in calls if "[test]" in call or "arctic" in call], calls
    assert calls[-1] == "autotune models"
    assert "about 5 GB to download" in checkout.stderr  # the first run says what its long quiet install is


def test_bin_test_adds_the_test_extra_to_the_users_venv(checkout):
    checkout.run("bin/autotune", "models")
    calls = checkout.run("bin/test", "-m", "not slow")
    assert not [call for call in calls if call.startswith("venv ")], "bin/test made a second venv"
    assert checkout.installs(calls) == TEST_INSTALLS
    assert calls[-1] == f"python -m pytest -q {XDIST} -m not slow"


def test_nothing_changed_installs_nothing(checkout):
    checkout.run("bin/autotune", "models")
    assert checkout.installs(checkout.run("bin/autotune", "models")) == []
    checkout.run("bin/test")
    for script in ("bin/test", "bin/autotune"):
        calls = checkout.run(script)
        assert [call for call in calls if call.startswith(("venv ", "python -m pip"))] == [], (script, calls)


@pytest.mark.parametrize("changed", ["pyproject.toml", "constraints-cpu.txt"])
def test_a_changed_pyproject_or_constraint_installs_again_each_install_its_own(checkout, changed):
    checkout.run("bin/test")
    checkout.change(changed)
    assert checkout.installs(checkout.run("bin/autotune")) == [RUNTIME_INSTALL]
    assert checkout.installs(checkout.run("bin/test")) == TEST_INSTALLS
    assert checkout.installs(checkout.run("bin/autotune")) == []


def test_a_clean_clone_set_up_for_the_tests_has_the_runtime_install_too(checkout):
    """.ci/run's path: `bin/setup-env --test` first, then bin/autotune has nothing left to install."""
    calls = checkout.run("bin/setup-env", "--test")
    assert calls[0].startswith("venv ")
    assert checkout.installs(calls) == TEST_INSTALLS
    assert checkout.installs(checkout.run("bin/autotune", "models")) == []


def test_the_oldest_torchs_install_is_a_second_venv_of_the_oldest_torch_beside_the_first(checkout):
    """bin/test --oldest: .venv's tests' install, then .venv-oldest with only constraints-oldest.txt's torch and an
    editable autotune, every other package read from .venv's site-packages; the torch-release tests run there."""
    calls = checkout.run("bin/test", "--oldest", "-x")
    assert calls[0] == f"venv {checkout.root}/.venv" and f"venv {checkout.root}/.venv-oldest" in calls
    assert checkout.installs(calls) == [
        *TEST_INSTALLS,
        "python -m pip install --quiet -c REPO/constraints-oldest.txt torch",
        "python -m pip install --quiet -c REPO/constraints-oldest.txt --no-deps -e REPO",
    ]
    oldest_site = checkout.root / ".venv-oldest" / "site-packages"
    assert (oldest_site / "autotune-test-dependencies.pth").read_text() == f"{checkout.root}/.venv/site-packages\n"
    assert calls[-1] == f"python -m pytest -q {XDIST} -m torch_release and not any_release and not slow -x"
    assert checkout.installs(checkout.run("bin/setup-env", "--test", "--oldest")) == []  # once
    checkout.change("constraints-oldest.txt")
    assert checkout.installs(checkout.run("bin/setup-env", "--test", "--oldest"))[0].endswith(
        "constraints-oldest.txt torch"
    )


def test_setup_env_refuses_an_unknown_argument_before_touching_anything(checkout):
    assert checkout.run("bin/setup-env", "--tests", ok=False) == []
    assert not (checkout.root / ".venv").exists()


def test_ci_installs_the_test_extra_before_the_wheel_check_and_the_suite():
    """.ci/run's phases (``phase NAME COMMAND...``), in order: the test extra, the wheel, README's test command, the
    torch-release tests on the oldest torch."""
    phases = [line.split()[2:] for line in (ROOT / ".ci" / "run").read_text().splitlines() if line.startswith("phase ")]
    commands = [" ".join(words[:2]) for words in phases]
    assert "bin/setup-env --test" in commands, "CI must install the test extra itself (a clean clone has no .venv)"
    order = [commands.index(step) for step in ("bin/setup-env --test", ".ci/wheel-check", "bin/test --durations=25")]
    assert order == sorted(order)
    assert commands.index("bin/test --durations=25") < commands.index("bin/test --oldest"), "CI runs the oldest too"
    for script in ("bin/setup-env", "bin/autotune", "bin/test", ".ci/run"):
        assert os.access(ROOT / script, os.X_OK), f"{script} is not executable"
        done = subprocess.run(["bash", "-n", str(ROOT / script)], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr


def _runtime_distributions() -> set[str]:
    """autotune's runtime dependencies and theirs, as installed here (extras followed, markers evaluated)."""
    found: set[str] = set()
    todo = [
        Requirement(spec) for spec in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    ]
    while todo:
        requirement = todo.pop()
        name = canonicalize_name(requirement.name)
        if name in found:
            continue
        try:
            requires = metadata.requires(requirement.name) or []
        except metadata.PackageNotFoundError:
            continue  # not installed here (another platform's dependency)
        found.add(name)
        extras = {""} | set(requirement.extras)
        for spec in requires:
            child = Requirement(spec)
            if child.marker is None or any(
                child.marker.evaluate({**default_environment(), "extra": extra}) for extra in extras
            ):
                todo.append(child)
    return found


def _test_only_modules() -> dict[str, str]:
    """Top-level module -> the distribution that brings it, for each distribution only the tests' install has."""
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["test"]
    runtime = _runtime_distributions()
    test_only = {canonicalize_name(Requirement(spec).name) for spec in (*extra, *NO_DEPS_TEST_PACKAGES)} - runtime
    modules: dict[str, str] = {}
    for module, distributions in metadata.packages_distributions().items():
        names = {canonicalize_name(d) for d in distributions}
        if names & test_only and not names & runtime:
            modules[module] = sorted(names & test_only)[0]
    return modules


def _guarded(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    """Inside a try whose handlers catch ImportError (or ModuleNotFoundError, or everything)."""
    while node in parents:
        child, node = node, parents[node]
        if isinstance(node, ast.Try) and child in node.body:
            for handler in node.handlers:
                caught = handler.type
                names = caught.elts if isinstance(caught, ast.Tuple) else [caught]
                if caught is None or any(
                    isinstance(n, ast.Name) and n.id in ("ImportError", "ModuleNotFoundError", "Exception")
                    for n in names
                ):
                    return True
    return False


def test_runtime_code_imports_nothing_only_the_test_extra_brings():
    test_only = _test_only_modules()
    # what the scan looks for, so that a change in packaging cannot make it look for nothing
    for module in ("pytest", "wandb", "datasets", "arctic_training", "plotly", "tensorboard"):
        assert module in test_only, f"{module} is not seen as test-only: {sorted(test_only)}"
    unguarded = []
    for package in RUNTIME_PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            tree = ast.parse(path.read_text(), filename=str(path))
            parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    modules = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    modules = [node.module]
                else:
                    continue
                for module in modules:
                    top = module.split(".")[0]
                    if top in test_only and not _guarded(node, parents):
                        where = f"{path.relative_to(ROOT)}:{node.lineno}"
                        unguarded.append(f"{where} imports {module} ({test_only[top]}: test extra only)")
    assert not unguarded, "\n".join(unguarded)
