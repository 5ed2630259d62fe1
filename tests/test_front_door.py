"""The front door: everything the README and the examples use comes from `prefixreg` itself."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import prefixreg
from prefixreg.core import errors

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))


def _readme_python() -> str:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    return "\n".join(re.findall(r"```python\n(.*?)```", text, flags=re.S))


def _sources() -> list[tuple[str, str]]:
    return [("README.md", _readme_python())] + [(p.name, p.read_text()) for p in EXAMPLES]


@pytest.mark.parametrize(("where", "source"), _sources(), ids=lambda v: str(v)[:20])
def test_readme_and_examples_import_only_the_front_door(where: str, source: str) -> None:
    tree = ast.parse(source)
    used: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                assert not alias.name.startswith("prefixreg."), (where, alias.name)
        elif isinstance(node, ast.ImportFrom) and node.module:
            assert not node.module.startswith("prefixreg."), (where, node.module)
            if node.module == "prefixreg":
                used.update(a.name for a in node.names)
        elif (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == "prefixreg"
        ):
            used.add(node.attr)
    assert used, f"{where} uses nothing from prefixreg"
    missing = sorted(used - set(prefixreg.__all__))
    assert not missing, (where, missing)


def test_every_public_name_resolves_and_every_error_is_exported() -> None:
    for name in prefixreg.__all__:
        assert getattr(prefixreg, name) is not None, name
    tree = {
        name
        for name, value in vars(errors).items()
        if isinstance(value, type) and issubclass(value, errors.PrefixregError)
    }
    assert tree <= set(prefixreg.__all__), sorted(tree - set(prefixreg.__all__))
    assert issubclass(prefixreg.NameConflictError, prefixreg.UsageError)
    assert issubclass(prefixreg.ReplyTooLargeError, prefixreg.WorkerError)
    with pytest.raises(AttributeError):
        _ = prefixreg.no_such_name


def test_the_readme_python_section_runs_against_the_simulator(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Copied into a script, as a new user would, against the simulator: it runs as written."""
    import subprocess
    import sys

    from prefixreg.sim import SimConfig, SimServer

    (tmp_path / "system-prompt.txt").write_text("You are a careful coding agent.\n" * 200)
    tools = [{"type": "function", "function": {"name": "run_tests", "parameters": {}}}]
    (tmp_path / "tools.json").write_text(__import__("json").dumps(tools))
    with SimServer(SimConfig(speed=1000)) as sim:
        script = _readme_python().replace("http://127.0.0.1:8731", sim.url)
        env = {**__import__("os").environ, "PREFIXREG_HOME": str(tmp_path / "reg")}
        env["PYTHONPATH"] = str(ROOT)
        res = subprocess.run(
            [sys.executable, "-c", script],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert lines[0].startswith("RESUMED") and "1 resumed" in lines[1], lines
    assert lines[-2:] == ["[]", "resumed"], lines  # no drift; the judge on the loop's counts
