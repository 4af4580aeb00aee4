"""Training draft heads on the target's own features: the prompt corpus (``prompt_corpus``), the
target's generations (``self_distill``), and the EAGLE trainer (``eagle_trainer``)."""
