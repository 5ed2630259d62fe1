"""The house's shape in numbers, as issue 35's acceptance counts them, at the checked-out commit.

- CLI: the lines of logic in each command function (`<name>_command` and the commands of a
  `<name>_app` group under `prefixreg/cli/`): its logical lines, one per statement however
  the formatter wraps it, without its docstring and lazy `import`s (kept inside functions
  for start-up time, not logic); and which command module imports another;
- library (`prefixreg/` without `cli/` and `sim/`): modules, lines, modules over 400 lines,
  docstring share of the lines, `isinstance` calls per 1,000 lines (outside the parsers of
  untrusted input listed in `PARSERS`);
- a verb's closure: its module and every library module it imports, transitively (imports
  inside functions and under TYPE_CHECKING included: a reader follows them too; a package's
  `__init__` only when something is imported from it, not on the way to its modules).

Run: `python scripts/house_metrics.py [--json]`. Nothing is judged; the targets are printed.
"""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "prefixreg"
# Parsers of untrusted input (server replies, files, records): their isinstance checks are
# the point of them, and issue 35 counts outside them.
PARSERS = (
    "prefixreg/core/records.py",
    "prefixreg/core/frame.py",
    "prefixreg/core/jsonio.py",
    "prefixreg/server/evidence.py",
    "prefixreg/server/replies.py",
    "prefixreg/registry/meta.py",
    "prefixreg/gateway/apis.py",
    "prefixreg/gateway/head.py",
    "prefixreg/gateway/stream.py",
    "prefixreg/verbs/audit/read.py",
    "prefixreg/verbs/audit/aiperf.py",
    "prefixreg/verbs/pool/spec.py",
)
VERBS = {
    "warm": ("prefixreg.verbs.measure.warm", 15, 3500),
    "snapshot": ("prefixreg.verbs.snapshot.run", 15, 3500),
    "pool": ("prefixreg.verbs.pool.warm", 15, 3500),
    "keepalive": ("prefixreg.verbs.keepalive.run", 20, 5000),
}


def library_files() -> list[Path]:
    skip = (PKG / "cli", PKG / "sim")
    return sorted(p for p in PKG.rglob("*.py") if not any(p.is_relative_to(s) for s in skip))


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def docstring_lines(tree: ast.Module) -> int:
    total = 0
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            first = body[0] if body else None
            value = first.value if isinstance(first, ast.Expr) else None
            if first is not None and isinstance(value, ast.Constant) and type(value.value) is str:
                total += (first.end_lineno or first.lineno) - first.lineno + 1
    return total


def logic_lines(func: ast.FunctionDef) -> int:
    """Logical lines: one per statement (a compound statement's header is one, its body
    counted on), however the formatter wraps its arguments; lazy imports not counted."""
    body = list(func.body)
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the docstring

    def count(stmts: list[ast.stmt]) -> int:
        n = 0
        for st in stmts:
            if isinstance(st, (ast.Import, ast.ImportFrom)):
                continue
            n += 1
            for field in ("body", "orelse", "finalbody"):
                n += count(getattr(st, field, []))
            for handler in getattr(st, "handlers", []):
                n += 1 + count(handler.body)
        return n

    return count(body)


def cli_metrics() -> tuple[list[tuple[str, int]], list[str]]:
    commands: list[tuple[str, int]] = []
    cross: list[str] = []
    for path in sorted((PKG / "cli").glob("*.py")):
        source = path.read_text()
        tree = ast.parse(source)
        for node in ast.walk(tree):
            module = node.module if isinstance(node, ast.ImportFrom) else None
            other = module not in (None, "prefixreg.cli._common") and path.stem != "main"
            if other and str(module).startswith("prefixreg.cli."):
                cross.append(f"{path.name}:{getattr(node, 'lineno', 0)} imports {module}")
        registered: set[str] = set()
        for node in ast.walk(tree):  # functions a group registers: @app.command(...)
            if isinstance(node, ast.FunctionDef):
                for d in node.decorator_list:
                    target = d.func if isinstance(d, ast.Call) else d
                    if isinstance(target, ast.Attribute) and target.attr == "command":
                        registered.add(node.name)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Call):
                inner = node.func.func  # app.command("name")(func)
                if isinstance(inner, ast.Attribute) and inner.attr == "command" and node.args:
                    arg = node.args[0]
                    if isinstance(arg, ast.Name):
                        registered.add(arg.id)
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and (
                node.name.endswith("_command") or node.name in registered
            ):
                commands.append((f"{path.stem}.{node.name}", logic_lines(node)))
    return commands, cross


def imports_of(path: Path, names: dict[str, Path]) -> set[str]:
    tree = ast.parse(path.read_text())
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            subs = {f"{base}.{a.name}" for a in node.names} & names.keys()
            found.update(subs)  # `from pkg import module` reads the module, not pkg
            if len(subs) < len(node.names):
                found.add(base)
    out: set[str] = set()
    for name in found:
        while name and name not in names:
            name = name.rpartition(".")[0]
        if name:
            out.add(name)
    out.discard(me)
    return out


def closure(start: str, names: dict[str, Path]) -> set[str]:
    seen, todo = {start}, [start]
    while todo:
        for dep in imports_of(names[todo.pop()], names):
            if dep not in seen:
                seen.add(dep)
                todo.append(dep)
    return seen


def main() -> int:
    as_json = "--json" in sys.argv[1:]
    files = library_files()
    names = {module_name(p): p for p in files}
    total = doc = inst = inst_lines = 0
    big: list[tuple[str, int]] = []
    for p in files:
        source = p.read_text()
        n = len(source.splitlines())
        total += n
        tree = ast.parse(source)
        doc += docstring_lines(tree)
        if n > 400:
            big.append((str(p.relative_to(ROOT)), n))
        if str(p.relative_to(ROOT)) not in PARSERS:
            inst_lines += n
            inst += sum(
                1
                for node in ast.walk(tree)
                if isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id == "isinstance"
            )
    commands, cross = cli_metrics()
    verbs = {}
    for verb, (mod, max_mods, max_lines) in VERBS.items():
        mods = closure(mod, names) if mod in names else set()
        lines = sum(len(names[m].read_text().splitlines()) for m in mods)
        verbs[verb] = {"modules": len(mods), "lines": lines, "targets": [max_mods, max_lines]}
    report = {
        "library": {
            "modules": len(files),
            "lines": total,
            "over_400": big,
            "docstring_share": round(doc / total, 3),
            "isinstance_per_1000": round(1000 * inst / max(1, inst_lines), 1),
        },
        "cli": {
            "commands": len(commands),
            "over_15": [[n, k] for n, k in commands if k > 15],
            "max": max((k for _, k in commands), default=0),
            "cross_imports": cross,
        },
        "verbs": verbs,
    }
    if as_json:
        print(json.dumps(report, indent=2))
        return 0
    lib, cli = report["library"], report["cli"]
    print(f"library: {lib['modules']} modules (target <= 80), {lib['lines']} lines, "
          f"docstrings {lib['docstring_share']:.1%} (>= 15%), "
          f"isinstance {lib['isinstance_per_1000']}/1000 lines (<= 10)")  # fmt: skip
    for name, n in big:
        print(f"  over 400 lines: {name} ({n})")
    print(f"cli: {cli['commands']} commands, most logic {cli['max']} lines (<= 15)")
    for name, n in commands:
        if n > 15:
            print(f"  {name}: {n} lines of logic")
    for line in cross:
        print(f"  cross import: {line}")
    for verb, v in verbs.items():
        mods, lines = v["modules"], v["lines"]
        print(f"{verb}: {mods} modules, {lines} lines (<= {v['targets'][0]}, {v['targets'][1]})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
