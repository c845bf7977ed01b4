"""Pearson's chi-square test of the statistical pack (INTERPRETING.md, section 4): the runner computes the statistic of
an engine's draws with it, and the generator (conformance/make/draws.py) sizes each case's test with it."""

import numpy as np

from .format import TOLERANCES

TEST = TOLERANCES["draws"]


def pooled_bins(P, n, groups):
    """Bins for counts of n draws per group of outcomes (lists of flat indices into P, each a distribution): an
    outcome expected at least min_expected times is a bin of its own; a group's others share one bin, or join its
    least expected bin when even together they fall short. -> (bins like P, -1 where P == 0; the number of bins)"""
    flat, bins, count = P.ravel(), np.full(P.size, -1, np.int64), 0
    for group in groups:
        live = np.asarray(group)[flat[list(group)] > 0]
        expected = n * flat[live] / flat[live].sum()
        big = expected >= TEST["min_expected"]
        own = count + np.arange(big.sum())
        bins[live[big]] = own
        if not big.all():
            pooled = n * flat[live[~big]].sum() / flat[live].sum() >= TEST["min_expected"] or not big.any()
            bins[live[~big]] = count + big.sum() if pooled else own[np.argmin(expected[big])]
        count = int(bins.max()) + 1
    return bins.reshape(P.shape), count


def bin_totals(values, bins):
    live = bins >= 0
    return np.bincount(bins[live], weights=values[live], minlength=int(bins.max()) + 1)


def chi_square(counts, P, bins, n):
    """Pearson's statistic of counts (P's shape) against n draws per group of P -> (statistic, draws of outcomes
    P gives no chance)."""
    expected = bin_totals(n * P.astype(np.float64), bins)
    observed = bin_totals(counts.astype(np.float64), bins)
    return float(((observed - expected) ** 2 / expected).sum()), int(counts[bins < 0].sum())


def critical_value(probabilities, ns, rng, simulations, chunk=50_000):
    """The statistic that correct engines exceed with tolerances.json's false-alarm rate, from `simulations` of them:
    per group, n draws (ns) from its bins' probabilities (each summing to 1, or to what the group's bins hold)."""
    statistics = np.zeros(simulations)
    for p, n in zip(probabilities, ns):
        for start in range(0, simulations, chunk):
            counts = rng.multinomial(n, p / p.sum(), size=min(chunk, simulations - start))
            statistics[start:start + len(counts)] += ((counts - n * p) ** 2 / (n * p)).sum(axis=1)
    return float(np.quantile(statistics, 1 - TEST["alpha"], method="higher"))


def group_bins(P, bins, groups):
    """Per group: its bins' probabilities (the outcomes P gives no chance left out)."""
    flat_p, flat_bins = P.ravel(), bins.ravel()
    return [bin_totals(flat_p[list(group)], flat_bins[list(group)])[np.unique(flat_bins[list(group)][
        flat_bins[list(group)] >= 0])] for group in groups]
