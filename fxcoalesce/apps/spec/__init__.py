"""The speculative-decoding application: the SmolLM2-135M target (GGUF), its EAGLE-3 draft
head (training, loading), tree speculative decoding and its demo."""
