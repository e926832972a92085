"""Populations of estimator workers: in-process (local) or Ray actors."""

from popmeta.population.local import LocalPopulation

__all__ = ["LocalPopulation"]
