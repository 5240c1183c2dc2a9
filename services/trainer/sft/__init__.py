"""Multi-turn supervised fine-tuning on tool-use traces (``retool sft run``), on the trainer's FSDP stack."""
