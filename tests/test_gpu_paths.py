"""Decisions that only a GPU run reaches, made here on the CPU with what a GPU would hand them.

The GPU paths themselves run in tests/test_gpu.py on a GPU machine; these tests cover the
point where each path decides, so that a CPU-only CI catches the mistake.
"""
from notebook_code import definitions
from torch.autograd import DeviceType
from torch.autograd.profiler_util import EventList, FunctionEvent


def _profile(*rows):
    """An EventList as torch.profiler builds it: rows of (name, device, start_us, end_us, annotation)."""
    events = EventList([FunctionEvent(id=i, name=name, thread=0, start_us=start, end_us=end, device_type=device,
                                      is_user_annotation=annotation, stack=[], use_device='cuda')
                        for i, (name, device, start, end, annotation) in enumerate(rows)])
    events._build_tree()
    return events


def test_02s_profiler_reading_uses_the_cpu_row_of_each_phase():
    # With the CUDA activity, record_function('forward') has a CPU row and a CUDA row of the
    # same name; the CUDA row holds no front-end time (a dict keyed by name kept it: 0 ms).
    split = definitions('02-asynchronous-computation', 'front_end_and_kernel_times')['front_end_and_kernel_times']
    profile = _profile(('forward', DeviceType.CPU, 0, 500, True), ('forward', DeviceType.CUDA, 100, 360, True),
                       ('volta_sgemm', DeviceType.CUDA, 120, 300, False),
                       ('Memcpy HtoD', DeviceType.CUDA, 310, 330, False))
    host, kernels = split(profile.key_averages(), ('forward',))
    assert host == {'forward': 500}
    assert kernels == 180 + 20          # the kernel and the copy, not the phase's own CUDA row
