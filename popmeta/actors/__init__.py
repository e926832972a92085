"""Estimator workers (and, with the Ray engine, the actors that host them)."""

from popmeta.actors.records import ActorInfo, WorkerState
from popmeta.actors.worker import EstimatorWorker, worker_key

__all__ = ["ActorInfo", "EstimatorWorker", "WorkerState", "worker_key"]
