"""Serving: inference with an exported ONNX model (Predictor), dynamic batching, the web app.

This package never imports the training engine: serving needs only onnxruntime, NumPy, Pillow and
``data_prep``'s image decoding (so a photo is preprocessed exactly as in training).
"""
