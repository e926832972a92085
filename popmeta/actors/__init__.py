"""Estimator workers (and, with the Ray engine, the actors that host them)."""

from popmeta.actors.worker import EstimatorWorker, worker_key

__all__ = ["EstimatorWorker", "worker_key"]
