"""Foreign formats in and out: Hugging Face model folders (hf.py), DeepSpeed configs (deepspeed.py)."""
