"""Cells whose output depends on the machine are tagged, so that `./course test` passes on any tier.

nbval compares every untagged cell's stored output with a fresh run. A cell that prints
the device it ran on, the number of GPUs, a GPU's name or a tolerance chosen per device
prints something else on a GPU machine, and must carry `nbval-ignore-output` (or
`nbval-skip`). This test reads the stored outputs of both languages and fails when an
untagged cell names such a thing.
"""
import re

import pytest
from helpers import NAMES, ROOT, load

TAGS = {'nbval-ignore-output', 'nbval-skip'}
MACHINE_DEPENDENT = [
    (re.compile(r"device\(type='(?:cpu|cuda|mps)'"), 'a device object'),
    (re.compile(r'\bcuda:\d+\b'), 'a CUDA device'),
    (re.compile(r'\b(?:on|to) (?:the )?(?:cpu|cuda|mps)\b'), 'the device the code ran on'),
    (re.compile(r'\b(?:gloo|nccl) on\b', re.I), 'the backend and device a process chose'),
    (re.compile(r'\bGPUs?: \d+|\b\d+ GPU\(s\)|\bhas \d+ GPUs?\b|有 \d+ 块 GPU|GPU[ 数量]*[:：] ?\d+'), 'the GPU count'),
    (re.compile(r'\b(?:NVIDIA|GeForce|Quadro|Tesla|Radeon|Apple M\d)\b'), 'a GPU model'),
    (re.compile(r'\bno GPU\b|没有 GPU|无 GPU|GPU：无', re.I), 'what a machine without a GPU prints'),
    (re.compile(r'(?:tolerance|容差)[^\n]*\b(?:cpu|cuda|GPU)\b', re.I), 'a tolerance per device'),
]


FENCED_CODE = re.compile(r'```.*?```', re.S)


def shown_text(cell):
    """What a code cell's stored outputs show: streams, plain text, markdown and HTML.

    Source listings (common.show_source prints fenced code) are code, not results.
    """
    parts = []
    for output in cell.get('outputs', []):
        if 'text' in output:
            parts.append(output['text'])
        for kind in ('text/plain', 'text/markdown', 'text/html'):
            value = output.get('data', {}).get(kind)
            if value:
                value = ''.join(value) if isinstance(value, list) else value
                parts.append(FENCED_CODE.sub('', value) if kind == 'text/markdown' else value)
    return '\n'.join(parts)


def untagged_machine_outputs(nb):
    found = []
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != 'code' or TAGS & set(cell.metadata.get('tags', [])):
            continue
        text = shown_text(cell)
        for pattern, what in MACHINE_DEPENDENT:
            match = pattern.search(text)
            if match:
                found.append(f'cell {i} shows {what} ({match.group(0)!r}) but has no nbval-ignore-output tag')
    return found


@pytest.mark.parametrize('lang', ['en', 'zh'])
@pytest.mark.parametrize('name', NAMES)
def test_untagged_cells_show_nothing_that_depends_on_the_machine(lang, name):
    found = untagged_machine_outputs(load(ROOT / 'notebooks' / lang / name))
    assert not found, '\n'.join(found)


def test_the_tag_check_finds_a_planted_device_line():
    nb = load(ROOT / 'notebooks' / 'en' / '05-multi-gpu-from-scratch.ipynb')
    assert not untagged_machine_outputs(nb)
    untagged = next(cell for cell in nb.cells if cell.cell_type == 'code'
                    and not TAGS & set(cell.metadata.get('tags', [])))
    untagged.outputs = [{'output_type': 'stream', 'name': 'stdout', 'text': "2 replicas on: ['cpu', 'cpu'] "
                         "(this machine has 0 GPU(s))\n"}]
    assert len(untagged_machine_outputs(nb)) == 1
