"""``torchtext.data`` stand-in: only ``utils.get_tokenizer``."""
