"""How much a reader follows one level below each training script's main(), read from the source (nothing runs):
main, the script's own functions it reaches (train, worker), every function or method of the repository they call
by name (a class called: its __init__, __enter__ and __exit__), and fit and train_one_epoch, whatever calls them.
Each counts whole, decorators and docstring included; files are those the counted functions are in.

    python bench/lines_below_main.py            # prints one JSON object: per script, its lines, files, functions

Issue 38's goal: at most 250 lines in 8 files for train_single_gpu.py and train_multi_gpu_using_launch.py, 350 in
10 for train_multi_gpu_using_spawn.py. (../shared/tools/lines_to_step.py counts what runs before the first step.)
"""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = ("train_single_gpu.py", "train_multi_gpu_using_launch.py", "train_multi_gpu_using_spawn.py")
ALWAYS = (("multi_train_utils.train_eval_utils", "fit"), ("multi_train_utils.train_eval_utils", "train_one_epoch"))
CLASS_CALL = ("__init__", "__enter__", "__exit__")
Function = ast.FunctionDef | ast.AsyncFunctionDef


def module_tree(module: str, root: Path) -> tuple[Path, ast.Module] | None:
    path = root.joinpath(*module.split(".")).with_suffix(".py")
    return (path, ast.parse(path.read_text())) if path.is_file() else None


def definitions(module: str, name: str, attribute: str | None, root: Path) -> list[tuple[Path, Function]]:
    """The functions that a call of `name` (or `name.attribute`) imported from `module` runs first."""
    found = module_tree(module, root)
    if found is None:
        return []
    path, tree = found
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name and attribute is None:
            return [(path, node)]
        if isinstance(node, ast.ClassDef) and node.name == name:
            wanted = (attribute,) if attribute else CLASS_CALL
            return [(path, item) for item in node.body
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name in wanted]
    return []


def span(node: Function) -> int:
    first = node.decorator_list[0].lineno if node.decorator_list else node.lineno
    return node.end_lineno - first + 1


def below_main(script: Path, root: Path = REPO) -> dict[str, object]:
    tree = ast.parse(script.read_text())
    imported = {alias.asname or alias.name: node.module for node in tree.body if isinstance(node, ast.ImportFrom)
                for alias in node.names if node.module}
    own = {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}
    counted: dict[tuple[str, int], tuple[str, int]] = {}  # (file, line) -> (name, lines)

    def count(path: Path, node: Function) -> None:
        counted[(str(path.relative_to(root)), node.lineno)] = (node.name, span(node))

    todo, seen = ["main"], set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        count(script, own[name])
        for node in ast.walk(own[name]):
            if isinstance(node, ast.Name) and node.id in own:  # called, or handed on (mp.spawn's worker)
                todo.append(node.id)
            if not isinstance(node, ast.Call):
                continue
            call = node.func
            if isinstance(call, ast.Name) and call.id in imported:
                found = definitions(imported[call.id], call.id, None, root)
            elif isinstance(call, ast.Attribute) and isinstance(call.value, ast.Name) and call.value.id in imported:
                found = definitions(imported[call.value.id], call.value.id, call.attr, root)
            else:
                found = []
            for path, function in found:
                count(path, function)
    for module, name in ALWAYS:
        for path, function in definitions(module, name, None, root):
            count(path, function)
    return {"lines": sum(lines for _, lines in counted.values()), "files": len({file for file, _ in counted}),
            "functions": sorted(f"{file}:{line} {name} ({lines})" for (file, line), (name, lines) in counted.items())}


def main() -> None:
    json.dump({script: below_main(REPO / script) for script in SCRIPTS}, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
