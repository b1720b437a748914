"""The staged jobs of leaflens (preprocess, teacher, distill, evaluate, export) and the `leaflens` CLI."""
