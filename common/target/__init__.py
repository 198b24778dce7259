"""The target side: chat data to tokens, layer choice, capturing hidden states, the target's frozen head."""
