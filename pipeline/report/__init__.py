"""Evaluation figures and reports: metrics, plots, report.md."""
