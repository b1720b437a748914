"""leaflens: leaf disease and crop pest recognition, from photo folders to a served model.

One import package over the repository's top-level folders (see pyproject.toml's package-dir):
``leaflens.engine`` (tensors, autograd, layers, optimisers), ``leaflens.kernels`` (CUDA kernels and
their NumPy twins), ``leaflens.data_prep`` (decoding, ingest, manifests), ``leaflens.pipeline`` (the
staged jobs and the ``leaflens`` command) and ``leaflens.apps`` (Predictor, batching, web app).
Importing any of them changes no process-wide setting; the command line makes those explicitly
(:func:`leaflens.pipeline.cli.runtime.configure_process`).
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("leaflens")
except PackageNotFoundError:  # a source tree on sys.path without an install
    __version__ = "0+unknown"
