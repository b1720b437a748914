"""Model definitions: the student CNN and the EfficientNet-Lite teacher, and reading their pretrained weights."""
