"""The notebooks' teaching helpers: toys small enough to see (a KV manager behind one character
per slot), the sizes and baselines the papers' arguments use, the committed results, and the
figures, drawn from the engine's public state. They live beside the notebooks, not in the
engine's package: nothing in `minipaged` imports them, and they need matplotlib, which the
engine does not. A notebook imports them as `teaching.<module>` (its folder is on the path).
"""
