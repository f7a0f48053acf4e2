"""Section 12's mixture of experts (comp_perf/s12_experts.py): the layer's capacity and balancing loss, and
the expert-parallel layer equal to the one-process layer at 2 and 3 processes, in outputs and gradients,
failing each planted mistake.
"""
from pathlib import Path

import pytest
import torch
from helpers import planted_file

from comp_perf import s12_experts

REFERENCE = Path(s12_experts.__file__).read_text(encoding='utf-8')


def test_the_capacity_drops_the_choices_past_it_in_token_order():
    layer = s12_experts.MixtureOfExperts(4, 8, experts=2, top_k=1, capacity_factor=0.5)
    with torch.no_grad():
        layer.router.copy_(torch.tensor([[10.0, -10.0]] * 4))   # every token's first choice: expert 0
    x = torch.ones(8, 4)
    assert s12_experts.tokens_per_expert(layer, x) == [layer.capacity(8), 0] == [2, 0]
    _, (token, _, _) = layer.route(x)
    assert token.tolist() == [0, 1]


def test_the_balancing_loss_is_one_when_uniform_and_grows_when_one_expert_takes_all():
    uniform = torch.full((8, 4), 0.25)
    assert s12_experts.balance_loss(uniform, 4).item() == pytest.approx(1.0)
    skewed = torch.tensor([[0.97, 0.01, 0.01, 0.01]] * 8)
    assert s12_experts.balance_loss(skewed, 4).item() == pytest.approx(4 * 0.97)


@pytest.mark.procs
def test_the_expert_parallel_layer_equals_the_one_process_layer(capsys):
    assert s12_experts.check_expert_parallel((2, 3))
    assert capsys.readouterr().out.count('pass:') == 2


PLANTED = {
    # the outputs go home with the splits they came with: sizes differ between ranks
    'combine_with_the_dispatch_splits': ('    back = all_to_all(outputs, receive, send)',
                                         '    back = all_to_all(outputs, send, receive)'),
    # the outputs come home outside autograd: the experts' gradients from other ranks' tokens are lost
    'combine_outside_autograd': ('    back = all_to_all(outputs, receive, send)',
                                 '    back = all_to_all(outputs.detach(), receive, send)'),
    # a rank's experts counted from 0, not from its first expert
    'local_expert_numbers': ('    for e in range(rank * per_rank, (rank + 1) * per_rank):',
                             '    for e in range(per_rank):'),
}


@pytest.mark.procs
@pytest.mark.parametrize('name', PLANTED)
def test_each_planted_mistake_fails(name, tmp_path, capsys):
    path = planted_file(REFERENCE, tmp_path, name, PLANTED[name])
    assert not s12_experts.check_expert_parallel((3,), source=str(path))
    assert 'FAIL' in capsys.readouterr().out
