"""What a model is, read without torch: its files and shape (config.py, gguf_file.py), its
tokenizer and chat template (tokenizer.py), and an on-disk cache of what is slow to derive
from them (cache.py)."""
