"""Section 12's ring attention (comp_perf/s12_ring.py): the check passes the reference at 2 and 3 processes
and fails each planted mistake at the part it breaks; a deadlocked ring ends within its stated time with
its likely cause, a second wait() on a finished transfer is refused (over gloo it would hang), a gap still
raising reads "not built yet"; the zig-zag split balances the causal work that the contiguous one does not.
The checks run under common.launch: the procs tier (all but the missing file's).
"""
import re
import time
from pathlib import Path

import pytest
from helpers import planted_file

from comp_perf import s12_ring

procs = pytest.mark.procs

REFERENCE = Path(s12_ring.__file__).read_text(encoding='utf-8')


def verdicts(out):
    return dict((letter, verdict) for verdict, letter in re.findall(r'^(pass|FAIL) \((\w)\)', out, re.M))


@procs
def test_the_reference_passes_every_part(capsys):
    assert s12_ring.check_ring_attention()
    out = capsys.readouterr().out
    assert verdicts(out) == dict.fromkeys('abcdef', 'pass') and 'Ring attention: pass' in out


PLANTED = {
    # the merge adds exponentials of the logsumexps without the larger one taken out: overflows at large scores
    'merge_without_the_max': ([('new = torch.logaddexp(lse, block_lse)',
                                'new = torch.log(torch.exp(lse) + torch.exp(block_lse))')], {'d'}),
    # the causal mask compares positions inside the block, not the global ones: wrong for a block from another rank
    'local_positions': ([("hidden = hidden | (k_pos[None, :] > q_pos[:, None])",
                          "hidden = hidden | (torch.arange(k.shape[-2])[None, :] > "
                          "torch.arange(q.shape[-2])[:, None])")],
                        {'b', 'c', 'd', 'e'}),
    # the last block that arrives is never computed
    'last_block_missing': ([('        rows, cols = visible_part(q_pos, pos_b, causal)\n        if rows.any():',
                             '        rows, cols = visible_part(q_pos, pos_b, causal)\n'
                             '        if rows.any() and step < world_size - 1:')], {'a', 'b', 'c', 'd', 'e'}),
    # each block is computed only after its transfer was waited for: correct, but nothing overlaps
    'no_overlap': ([('            incoming, works = send_and_receive(block, rank, world_size)\n',
                     '            incoming, works = send_and_receive(block, rank, world_size)\n'
                     '            [work.wait() for work in works]\n'),
                    ('            for work in works:\n                work.wait()\n', '')], {'f'}),
}


@procs
@pytest.mark.parametrize('name', PLANTED)
def test_each_planted_mistake_fails_its_parts(name, tmp_path, capsys):
    changes, failing = PLANTED[name]
    assert not s12_ring.check_ring_attention(planted_file(REFERENCE, tmp_path, name, *changes))
    out = capsys.readouterr().out
    assert {letter for letter, v in verdicts(out).items() if v == 'FAIL'} == failing, out
    assert 'Ring attention: fail' in out


@procs
def test_a_second_wait_is_refused_with_a_message_not_a_hang(tmp_path, capsys):
    path = planted_file(REFERENCE, tmp_path, 'double_wait',
                        ('            block = incoming\n', '            block = incoming\n'
                         '            works[0].wait()\n'))
    start = time.monotonic()
    assert not s12_ring.check_ring_attention(path, hang_seconds=3)
    out = capsys.readouterr().out
    assert 'second time' in out and time.monotonic() - start < 30, out


@procs
def test_a_deadlocked_ring_ends_within_its_time_and_names_the_cause(tmp_path, capsys):
    # every rank receives before it sends: nobody ever sends
    path = planted_file(REFERENCE, tmp_path, 'receive_first', (
        "    return buffers, dist.batch_isend_irecv(ops)",
        "    for b in buffers:\n        dist.recv(b, (rank - 1) % world_size)\n"
        "    for t in block:\n        dist.send(t, (rank + 1) % world_size)\n    return buffers, []"))
    start = time.monotonic()
    assert not s12_ring.check_ring_attention(path, hang_seconds=3)
    out = capsys.readouterr().out
    assert 'deadlock' in out and 'receives' in out and time.monotonic() - start < 40, out


@procs
def test_a_gap_still_raising_reads_not_built_yet(tmp_path, capsys):
    path = planted_file(REFERENCE, tmp_path, 'gap', ('    new = torch.logaddexp(lse, block_lse)\n',
                                                     "    raise NotImplementedError('gap 2: merge')\n"))
    assert not s12_ring.check_ring_attention(path)
    assert 'not built yet: gap 2' in capsys.readouterr().out


def test_a_missing_file_is_named(capsys):
    assert not s12_ring.check_ring_attention('artifacts/no_such_ring.py')
    assert 'no_such_ring.py' in capsys.readouterr().out
