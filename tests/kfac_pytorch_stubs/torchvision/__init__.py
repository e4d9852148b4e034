"""Stand-in for the parts of ``torchvision`` kfac-pytorch's CIFAR-10 example uses (README.md)."""

from torchvision import datasets, transforms

__all__ = ["datasets", "transforms"]
