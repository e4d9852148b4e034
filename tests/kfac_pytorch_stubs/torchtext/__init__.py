"""Stand-in for the parts of ``torchtext`` kfac-pytorch's language-model example uses (README.md)."""
