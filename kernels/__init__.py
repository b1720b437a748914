"""Hand-written CUDA kernels (``*.cu``) with a NumPy reference twin for each.

Every kernel family has a module here: ``<op>_reference`` (NumPy, the maths the engine's CPU path
uses and the contract the kernel is tested against) and ``<op>_cuda`` (launches the ``.cu`` kernel on
CuPy arrays). Importing this package never imports CuPy; ``leaflens.kernels._cuda`` does that lazily, only when
a ``*_cuda`` function runs or a GPU probe is asked for.
"""
