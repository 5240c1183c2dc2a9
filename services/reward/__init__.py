"""Reward service: final-answer extraction and math equivalence grading, hang-proof."""
