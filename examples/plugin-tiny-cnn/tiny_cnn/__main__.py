"""`python -m tiny_cnn PATH`: write an untrained checkpoint for the tiny-cnn plugin (tiny_cnn.network)."""

from tiny_cnn.network import main

main()
