"""Teachers: the teacher stage and each kind of teacher (EfficientNet fine-tune, CNN, ONNX encoder), their artefact."""
