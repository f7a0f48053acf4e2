"""Section 04's helpers (comp_perf/s04_hardware.py) and the C programs on its page."""
import shutil
import subprocess

import pytest

import common


def _written_file(section, filename):
    """The body of the code cell of a section that starts with %%writefile filename."""
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


@pytest.mark.procs
def test_04s_pointer_chase_compiles_and_sees_memory_slower_than_l1(tmp_path):
    source = tmp_path / 'chase.c'
    source.write_text(_written_file('04', 'artifacts/chase.c'))
    program = common.compile_c(source)
    done = subprocess.run([str(program), str(8 * 1024), str(128 * 2 ** 20)], capture_output=True,
                          text=True, timeout=300, check=True)
    small, large = (float(row.split()[1]) for row in done.stdout.splitlines())
    assert large > 5 * small, (small, large)        # a 128 MiB block leaves every cache; 8 KiB fits L1


@pytest.mark.procs
def test_04s_false_sharing_program_counts_right(tmp_path):
    source = tmp_path / 'false_sharing.c'
    source.write_text(_written_file('04', 'artifacts/false_sharing.c'))
    program = common.compile_c(source, '-pthread')
    for distance in (8, 128):
        done = subprocess.run([str(program), '1000000', str(distance)], capture_output=True, text=True,
                              timeout=60)
        assert done.returncode == 0 and float(done.stdout) > 0   # exit 0: both counters reached N


@pytest.mark.procs
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


def test_cpu_facts_reports_what_the_page_prints():
    facts = common.cpu_facts()
    assert set(facts) == {'model', 'cores', 'threads', 'clock_ghz', 'clock_source', 'vector_bits', 'fma', 'caches'}
    assert facts['cores'] >= 1 and facts['threads'] >= facts['cores']
    assert facts['clock_source'] in (None, 'current, /proc/cpuinfo', 'maximum, cpufreq')
    assert all(level.startswith('L') and size > 0 for level, size in facts['caches'].items())


def test_the_plots_and_print_outs_run_and_say_what_they_measured(capsys, monkeypatch):
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    monkeypatch.setattr(plt, 'show', lambda: plt.close('all'))
    caches = {'L1': 2**15, 'L2': 2**20}
    sizes = [2 ** p for p in range(12, 24)]
    rates = [100, 100, 100, 100, 60, 60, 60, 60, 60, 20, 20, 20]
    common.plot_by_size(sizes, rates, caches, label='read', ylabel='GB/s', title='sweep')
    common.plot_by_size(sizes, rates, caches, label='chase', ylabel='ns', title='latency', log_y=True)
    common.report_cache_sweep(sizes, rates, common.cache_knees(sizes, rates), caches)
    common.plot_strides([1, 2, 4, 8, 16], [1e-10, 2e-10, 4e-10, 8e-10, 1.6e-9])
    points = {'a + b': (1 / 12, 5.0), 'matmul 256': (42.7, 200.0)}
    common.plot_roofline(points, compute_roof=220.0, bandwidth=50.0, peak=330.0)
    common.plot_ladder([('L1 cache reference', 1.5e-9, 1e-9), ('one {n}×{n} float32 matmul', None, 0.07)], n=2048)
    common.gpu_rate_table('NVIDIA H100 80GB HBM3', {'bf16': 700.0, 'pinned': 50.0},
                          common.gpu_datasheet('NVIDIA H100 80GB HBM3'))
    common.gpu_rate_table('Some GPU', {'fp32': 10.0}, None)
    common.describe_cpu(common.cpu_facts())
    common.plot_busy_cells([[[True, False], [False, False]], [[True, True], [True, False]]], 'busy cells')
    common.plot_utilisation([1, 2, 4], [0.01, 0.1, 0.4], array=4)
    out = capsys.readouterr().out
    assert 'knees found (first size that is clearly slower): 64 KiB, 2 MiB' in out
    assert 'L2: ' in out and '(does not): -67%' in out    # 60 GB/s inside L2, 20 outside
    assert 'ridge at 4.4 FLOP/byte' in out and '(memory-bound)' in out and '(compute-bound)' in out
    assert 'one 2048×2048 float32 matmul' in out and '70.0 ms' in out and 'textbook 1.5 ns' in out
    assert '989.5   71%' in out                            # 700 of the H100's 989.5 dense BF16 TFLOP/s
    assert 'not in common.GPU_DATASHEETS' in out
    assert 'physical cores' in out and 'data caches: ' in out and 'GPU: ' in out


def test_the_cache_labels_sit_above_every_data_point(monkeypatch):
    """The latency curve climbs to its top right at the last cache: its label must not sit on those points."""
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    figures = []
    monkeypatch.setattr(plt, 'show', lambda: figures.append(plt.gcf()))
    sizes = [2 ** p for p in range(12, 28)]
    latency = [1, 1, 1, 1, 5, 5, 5, 5, 5, 15, 15, 15, 15, 150, 160, 170]   # the top points next to L3
    caches = {'L1': 2**15, 'L2': 2**20, 'L3': 2**25}
    common.plot_by_size(sizes, latency, caches, label='chase', ylabel='ns', title='latency', log_y=True)
    common.plot_by_size(sizes, latency[::-1], caches, label='read', ylabel='GB/s', title='sweep')
    for figure in figures:
        figure.canvas.draw()
        ax = figure.axes[0]
        labels_bottom = min(text.get_window_extent().y0 for text in ax.texts)
        points_top = max(y for _, y in ax.transData.transform(ax.lines[0].get_xydata())) + 4   # marker radius
        assert points_top < labels_bottom
    plt.close('all')


def test_cache_sizes_print_in_the_largest_whole_unit(capsys):
    cpu = dict(model='test CPU', cores=2, threads=4, clock_ghz=None, clock_source=None, vector_bits=256, fma=True,
               caches={'L1': 48 * 2**10, 'L2': 2**20, 'L3': 32 * 2**20})
    common.describe_cpu(cpu)
    assert 'data caches: L1 48 KiB, L2 1 MiB, L3 32 MiB' in capsys.readouterr().out
