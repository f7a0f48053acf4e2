"""Section 09, one training step made fast: the augmented image dataset its DataLoader
workers run (a worker process must be able to import it), and the timing of a step.
"""
import math
import time

import torch
from torch.nn import functional as F


class AugmentedImages(torch.utils.data.Dataset):
    """Images with a random affine distortion applied per sample, as an input pipeline does.

    Each __getitem__ rotates, scales and shifts one image with affine_grid and
    grid_sample, `passes` times over (the cost a real decode and augmentation
    would have), from a generator seeded by (seed, index): a sample is the same
    in the main process and in any worker.
    """

    def __init__(self, images, labels, passes=4, seed=0):
        if images.dim() != 4 or len(images) != len(labels):
            raise ValueError(f'need N×C×H×W images and N labels, got {tuple(images.shape)} and {len(labels)}.')
        if passes < 1:
            raise ValueError(f'passes must be at least 1, got {passes}.')
        self.images, self.labels, self.passes, self.seed = images, labels, passes, seed

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        x = self.images[i:i + 1]
        for _ in range(self.passes):
            angle = (torch.rand(1, generator=g).item() - 0.5) * math.radians(20)
            scale = 0.9 + 0.2 * torch.rand(1, generator=g).item()
            shift = (torch.rand(2, generator=g) - 0.5) * 0.1
            theta = torch.tensor([[scale * math.cos(angle), -scale * math.sin(angle), shift[0]],
                                  [scale * math.sin(angle), scale * math.cos(angle), shift[1]]]).unsqueeze(0)
            grid = F.affine_grid(theta, x.shape, align_corners=False)
            x = F.grid_sample(x, grid, align_corners=False, padding_mode='zeros')
        return x[0], self.labels[i]


def timed_steps(step, batches, steps, warmup=2):
    """Run step(X, y) on `steps` batches after `warmup`; return (median step s, median wait-for-data s).

    The wait is the time next(batches) takes: with DataLoader workers it is what
    the step waits for data the workers have not prepared yet.
    """
    totals, waits = [], []
    for i in range(warmup + steps):
        start = time.perf_counter()
        X, y = next(batches)
        got = time.perf_counter()
        step(X, y)
        end = time.perf_counter()
        if i >= warmup:
            totals.append(end - start)
            waits.append(got - start)
    totals.sort()
    waits.sort()
    return totals[len(totals) // 2], waits[len(waits) // 2]
