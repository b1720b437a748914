"""The export stage: ONNX FP32/FP16/INT8, parity with the engine, the Triton repository."""
