"""Neural-network building blocks: Module, Parameter, layers and initialisers."""

from leaflens.engine.nn import init
from leaflens.engine.nn.layers import (
    AvgPool2d,
    BatchNorm1d,
    BatchNorm2d,
    Conv2d,
    Dropout,
    Flatten,
    GlobalAvgPool2d,
    Identity,
    LeakyReLU,
    Linear,
    MaxPool2d,
    ReLU,
    ReLU6,
    Sequential,
    Sigmoid,
    Softmax,
    Tanh,
    freeze_batchnorm,
    set_dropout_generator,
)
from leaflens.engine.nn.module import Module, Parameter

__all__ = ["AvgPool2d", "BatchNorm1d", "BatchNorm2d", "Conv2d", "Dropout", "Flatten", "GlobalAvgPool2d",
           "Identity", "LeakyReLU", "Linear", "MaxPool2d", "Module", "Parameter", "ReLU", "ReLU6", "Sequential",
           "Sigmoid", "Softmax", "Tanh", "freeze_batchnorm", "init", "set_dropout_generator"]
