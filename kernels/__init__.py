"""Hand-written CUDA kernels (``*.cu``) and the functions that launch them.

Every kernel family has a module here with ``<op>_cuda`` (checks its arguments and launches the ``.cu``
kernel on CuPy arrays). Each kernel's maths has one NumPy definition, the engine's CPU function its
module names (for example :func:`leaflens.engine.ops.conv.im2col`); tests/kernels/test_kernel_launch.py
holds every kernel to that function, on a host build of the ``.cu`` source and on a GPU. Importing
this package never imports CuPy; ``leaflens.kernels._cuda`` does that lazily, only when a ``*_cuda``
function runs or a GPU probe is asked for.
"""
