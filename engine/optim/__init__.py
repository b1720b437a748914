"""Optimisers, learning-rate schedules, gradient clipping and the weight average."""

from leaflens.engine.optim.adam import Adam, AdamW
from leaflens.engine.optim.clip import clip_grad_norm_
from leaflens.engine.optim.ema import ModelEMA
from leaflens.engine.optim.optimizer import Optimizer
from leaflens.engine.optim.schedulers import Scheduler, StepLR, WarmupCosine
from leaflens.engine.optim.sgd import SGD

__all__ = ["SGD", "Adam", "AdamW", "ModelEMA", "Optimizer", "Scheduler", "StepLR", "WarmupCosine", "clip_grad_norm_"]
