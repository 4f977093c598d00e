"""Real peer engines (P) for the conformance suite, driven from D in-process."""
