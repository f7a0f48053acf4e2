"""The code a section defines on its page, for tests and tools: functions read from the notebook's source.

A section's teaching code lives in its notebook, where the student reads it, not in
common.py. Tests exercise exactly that code: `definitions('05-multi-gpu-from-scratch',
'split_batch')` finds the top-level `def` (or `class`, or `NAME = ...`) statements of those
names in the section's code cells and executes only them, in the order named, in a namespace
that has torch and common.
"""
import ast
import math
from pathlib import Path

import nbpair
import numpy as np
import torch

import common

ROOT = Path(__file__).resolve().parent.parent


def section_of(src):
    """'00' … '09' for a section's source file, 'guide' for the instructor's guide."""
    return src.stem[:2] if src.stem[:2].isdigit() else 'guide'


def definitions(section, *names):
    """A namespace holding the named top-level functions, classes or constants of a section's code cells.

    The section's own top-level imports run first, so that the functions find the names
    the page imported for them.
    """
    source = next((ROOT / 'notebooks' / 'src').glob(f'{section}*.txt'))
    wanted, found, imports = set(names), {}, []
    for cell in nbpair.parse(source):
        if cell['type'] != 'code' or cell['en'].lstrip().startswith('%'):
            continue
        for node in ast.parse(cell['en']).body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name in wanted:
                found[node.name] = node
            elif (isinstance(node, ast.Assign) and len(node.targets) == 1
                  and isinstance(node.targets[0], ast.Name) and node.targets[0].id in wanted):
                found[node.targets[0].id] = node   # a constant the page defines, such as a GpuReference
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                imports.append(node)
    missing = wanted - set(found)
    if missing:
        raise LookupError(f'{source.name} defines no {sorted(missing)} in its code cells')
    namespace = {'torch': torch, 'np': np, 'math': math, 'common': common}
    module = ast.Module(body=imports + [found[name] for name in names], type_ignores=[])
    exec(compile(module, f'<{source.name}>', 'exec'), namespace)
    return namespace
