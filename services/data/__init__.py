"""Dataset preparation: DAPO-Math-17k, ReTool-SFT and AIME files into training/validation parquet."""
