"""`policy.lookahead.LookAhead`: a cycle's successor is queued before its read, on a guess, where
P(kept) x G > (1 - P) x (D - G), from what a pair's cycles showed."""

from dflash_mlx.policy.lookahead import LookAhead, forget_lookaheads, lookahead_for


def _seen(policy, width, kept, n, gap, seconds):
    for _ in range(n):
        policy.observe(width, kept)
        policy.timed_cycle(width, seconds)
    policy.timed_gap(gap)


def test_nothing_is_guessed_before_a_width_is_seen_and_timed():
    policy = LookAhead()
    assert not policy.pays(4)
    for _ in range(3):
        policy.observe(4, True)
    assert not policy.pays(4)  # no times yet
    policy.timed_cycle(4, 0.003)  # the first runs cold: not taken
    policy.timed_gap(0.002)
    assert policy.device == {} and not policy.pays(4)
    policy.timed_cycle(4, 0.003)
    assert policy.pays(4) and not policy.pays(8)  # another width: nothing seen


def test_the_guess_pays_where_the_gap_it_hides_outweighs_the_device_time_it_may_lose():
    # a GPU-like cycle: the host's gap (2 ms) is a good part of it (4 ms)
    gpu = LookAhead()
    _seen(gpu, 4, True, 6, gap=0.002, seconds=0.004)
    _seen(gpu, 4, False, 2, gap=0.002, seconds=0.004)
    p = gpu.kept_rate(4)
    assert 0.5 < p < 0.9 and gpu.pays(4)  # p * 2 > (1 - p) * 2
    # a CPU-like cycle: the same acceptance, a gap of 2 ms in 40
    cpu = LookAhead()
    _seen(cpu, 4, True, 6, gap=0.002, seconds=0.040)
    _seen(cpu, 4, False, 2, gap=0.002, seconds=0.040)
    assert not cpu.pays(4)
    # ... where only near certainty pays: P > 38 / 40
    _seen(cpu, 4, True, 100, gap=0.002, seconds=0.040)
    assert cpu.kept_rate(4) > 0.95 and cpu.pays(4)


def test_old_outcomes_fade():
    policy = LookAhead()
    _seen(policy, 1, True, 20, gap=0.003, seconds=0.010)
    assert policy.pays(1)
    _seen(policy, 1, False, 10, gap=0.003, seconds=0.010)  # copies came into sight: no more guesses
    assert not policy.pays(1)


class _Model:
    pass


def test_one_policy_a_pair_drafted_or_not():
    forget_lookaheads()
    model, draft = _Model(), _Model()
    assert lookahead_for(model, draft) is lookahead_for(model, draft)
    assert lookahead_for(model, None) is lookahead_for(model, None)
    assert lookahead_for(model, None) is not lookahead_for(model, draft)
    assert lookahead_for(_Model(), draft) is not lookahead_for(model, draft)
    forget_lookaheads()
