"""Section 04's helpers (comp_perf/s04_hardware.py) and the C programs on its page."""
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import common

ROOT = Path(__file__).resolve().parent.parent


def _written_file(section, filename):
    """The body of the code cell of a section that starts with %%writefile filename."""
    sys.path.insert(0, str(ROOT / 'tools'))
    import nbpair
    src = next(f for f in nbpair.sources() if f.name.startswith(section))
    bodies = [c['en'].split('\n', 1)[1] for c in nbpair.parse(src)
              if c['type'] == 'code' and c['en'].startswith(f'%%writefile {filename}\n')]
    assert len(bodies) == 1, f'{section} writes {filename} once'
    return bodies[0]


def test_cache_knees_finds_the_steps_and_ignores_one_noisy_point():
    sizes = [2 ** p for p in range(12, 24)]
    rates = [100, 100, 100, 100, 60, 60, 60, 60, 60, 20, 20, 20]
    assert common.cache_knees(sizes, rates) == [2 ** 16, 2 ** 21]
    noisy = list(rates)
    noisy[6] = 20                                   # one slow point inside a plateau is not a knee
    assert common.cache_knees(sizes, noisy) == [2 ** 16, 2 ** 21]
    with pytest.raises(ValueError, match='as many rates as sizes'):
        common.cache_knees(sizes, rates[:-1])


def test_04s_pointer_chase_compiles_and_sees_memory_slower_than_l1(tmp_path):
    source = tmp_path / 'chase.c'
    source.write_text(_written_file('04', 'artifacts/chase.c'))
    program = common.compile_c(source)
    done = subprocess.run([str(program), str(8 * 1024), str(128 * 2 ** 20)], capture_output=True,
                          text=True, timeout=300, check=True)
    small, large = (float(row.split()[1]) for row in done.stdout.splitlines())
    assert large > 5 * small, (small, large)        # a 128 MiB block leaves every cache; 8 KiB fits L1


def test_04s_false_sharing_program_counts_right(tmp_path):
    source = tmp_path / 'false_sharing.c'
    source.write_text(_written_file('04', 'artifacts/false_sharing.c'))
    program = common.compile_c(source, '-pthread')
    for distance in (8, 128):
        done = subprocess.run([str(program), '1000000', str(distance)], capture_output=True, text=True,
                              timeout=60)
        assert done.returncode == 0 and float(done.stdout) > 0   # exit 0: both counters reached N


def test_compile_c_reports_the_compilers_message(tmp_path):
    bad = tmp_path / 'bad.c'
    bad.write_text('int main(void) { return undefined_name; }\n')
    with pytest.raises(RuntimeError, match='undefined_name'):
        common.compile_c(bad)
    with pytest.raises(FileNotFoundError):
        common.compile_c(tmp_path / 'missing.c')


def test_compile_c_without_a_compiler_says_what_to_install(tmp_path, monkeypatch):
    good = tmp_path / 'ok.c'
    good.write_text('int main(void) { return 0; }\n')
    monkeypatch.setattr(shutil, 'which', lambda name: None)
    with pytest.raises(RuntimeError, match='apt-get install g\\+\\+'):
        common.compile_c(good)


@pytest.mark.parametrize('name, bf16, memory', [
    ('NVIDIA H200', 989.5, 4800), ('NVIDIA H100 80GB HBM3', 989.5, 3350), ('NVIDIA H100 PCIe', 756, 2000),
    ('NVIDIA A100-SXM4-80GB', 312, 2039), ('NVIDIA A100-SXM4-40GB', 312, 1555),
    ('NVIDIA A100 80GB PCIe', 312, 1935), ('NVIDIA L4', 121, 300), ('Tesla V100-SXM2-16GB', None, 900),
    ('Tesla T4', None, 320), ('NVIDIA H100 NVL', 835.5, 3900), ('NVIDIA H200 NVL', 835.5, 4800),
    ('NVIDIA GH200 480GB', 989.5, 4000)])
def test_gpu_datasheet_rows_match_the_device_names_torch_reports(name, bf16, memory):
    sheet = common.gpu_datasheet(name)
    assert (sheet['bf16'], sheet['memory_gbs']) == (bf16, memory)


def test_gpu_datasheet_does_not_guess():
    assert common.gpu_datasheet('NVIDIA L40S') is None            # not the L4
    assert common.gpu_datasheet('NVIDIA GeForce RTX 4090') is None
