#!/usr/bin/env python3
"""The wheel kit of the GPU checks: the Jupyter packages, pinned in tools/gpu_kit.txt, that
a GPU machine without network needs to execute the notebooks (tools/gpu_smoke.py).

    python3 tools/gpu_smoke.py --make-kit      (or: python3 tools/gpu_kit.py)

downloads them, here where pip reaches an index, into .whl/ (git-ignored), one wheel per
pin. Standard library only, like the runner.
"""
import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KIT_FILE = ROOT / 'tools' / 'gpu_kit.txt'
KIT_DIR = ROOT / '.whl'
KIT_PYTHON = '3.12'
# manylinux tags pip may take for the kit's binary wheels (it matches each tag exactly):
# glibc 2.17 to 2.28, which any machine with glibc 2.28 or newer runs
KIT_PLATFORMS = ([f'manylinux_2_{n}_x86_64' for n in range(28, 16, -1)]
                 + ['manylinux2014_x86_64', 'manylinux1_x86_64'])
# what the kit's packages need but the kit leaves out: on the GPU image already, or not needed
KIT_ASSUMED = ('attrs', 'packaging', 'psutil', 'pygments', 'python-dateutil', 'typing-extensions')
KIT_LEFT_OUT = ('debugpy',)   # ipykernel's debugger only; the smoke kernelspec switches it off
KIT_PINS_NOT_FOLLOWED = ('d2l',)   # its 2023 pins would replace the image's torch and numpy: --no-deps


def shown(path):
    """A path as the messages show it: relative to the checkout when inside it."""
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def read_kit(path=KIT_FILE):
    """{name: version} of the kit's `name==version` lines."""
    kit = {}
    for line in Path(path).read_text(encoding='utf-8').splitlines():
        line = line.split('#', 1)[0].strip()
        if line:
            name, version = line.split('==')
            kit[canonical(name)] = version.strip()
    return kit


def canonical(name):
    """A distribution's name as pip compares it (PEP 503): nest_asyncio2 == nest-asyncio2."""
    return re.sub(r'[-_.]+', '-', name.strip()).lower()


def kit_command(dest=KIT_DIR, kit=KIT_FILE, python=sys.executable):
    """The pip download line of the kit: cp312 wheels for x86-64 Linux, nothing resolved."""
    platforms = [arg for tag in KIT_PLATFORMS for arg in ('--platform', tag)]
    return [python, '-m', 'pip', 'download', '--no-deps', '--only-binary=:all:',
            '--python-version', KIT_PYTHON, '--implementation', 'cp',
            '--abi', 'cp' + KIT_PYTHON.replace('.', ''), *platforms,
            '--dest', str(dest), '--requirement', str(kit)]


def make_kit(dest=KIT_DIR, kit=KIT_FILE):
    """Download the kit into `dest`; keep exactly one wheel per pinned package. Returns an exit status."""
    cmd = kit_command(dest, kit)
    print(shlex.join(cmd), flush=True)
    dest.mkdir(parents=True, exist_ok=True)
    status = subprocess.run(cmd).returncode
    pins, found, extra = read_kit(kit), {}, []
    for wheel in sorted(dest.glob('*.whl')):
        name, version = wheel.name.split('-')[:2]
        name = canonical(name)
        if name in pins and version != pins[name]:
            wheel.unlink()   # an earlier kit's: two versions of one package stop the install
        elif name in pins:
            found[name] = wheel
        else:
            extra.append(wheel.name)
    missing = sorted(set(pins) - set(found))
    size = sum(w.stat().st_size for w in dest.glob('*.whl')) / 1e6
    print(f'[gpu_kit] {shown(dest)}: {len(found)} of {len(pins)} kit wheels, {size:.1f} MB in all')
    if extra:
        print(f'[gpu_kit] not in {shown(kit)} (they travel and are installed too): {extra}')
    if missing:
        print(f'[gpu_kit] missing: {missing}')
    return 1 if status or missing else 0


if __name__ == '__main__':
    sys.exit(make_kit())
