"""Optimisers, learning-rate schedules and gradient clipping."""

from engine.optim.adam import Adam, AdamW
from engine.optim.clip import clip_grad_norm_
from engine.optim.optimizer import Optimizer
from engine.optim.schedulers import Scheduler, StepLR, WarmupCosine
from engine.optim.sgd import SGD

__all__ = ["SGD", "Adam", "AdamW", "Optimizer", "Scheduler", "StepLR", "WarmupCosine", "clip_grad_norm_"]
