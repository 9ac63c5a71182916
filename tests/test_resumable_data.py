"""Data order is a function of (seed, epoch, rank); a resumed epoch continues where it stopped."""

import torch

from distill.data.resumable import ResumableSampler, resumable_loader


def test_epochs_are_seeded_permutations_independent_of_the_global_rng():
    s = ResumableSampler(10, batch_size=3, seed=7)
    torch.manual_seed(0)
    first = list(s)
    torch.manual_seed(123)  # the global RNG does not enter
    assert list(s) == first and len(first) == 9 == len(s)
    assert first == torch.randperm(10, generator=torch.Generator().manual_seed(7)).tolist()[:9]
    s.set_epoch(1)
    assert list(s) != first and sorted(set(list(s))) == sorted(list(s))


def test_resume_skips_the_batches_already_done_then_runs_whole_epochs():
    s = ResumableSampler(20, batch_size=4, seed=3)
    s.set_epoch(2)
    full = list(s)
    s.resume_from(2, 3)
    assert list(s) == full[12:]
    assert list(s) == full  # only the first pass after the resume skips


def test_ranks_get_disjoint_shards_of_one_permutation():
    shards = []
    for rank in range(2):
        s = ResumableSampler(10, batch_size=2, seed=1)
        s.rank, s.world_size = rank, 2
        shards.append(list(s))
    assert len(shards[0]) == len(shards[1]) == 4 and not set(shards[0]) & set(shards[1])
    order = torch.randperm(10, generator=torch.Generator().manual_seed(1)).tolist()
    assert shards[0] == order[0::2][:4] and shards[1] == order[1::2][:4]


def test_loader_does_not_touch_the_global_rng():
    loader = resumable_loader(list(range(12)), batch_size=4, seed=0)
    torch.manual_seed(5)
    before = torch.get_rng_state()
    batches = [b.tolist() for b in loader]
    assert torch.equal(torch.get_rng_state(), before) and len(batches) == 3
