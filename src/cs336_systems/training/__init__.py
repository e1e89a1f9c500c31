"""Training drivers that compose the suite's pieces (D26: the 8B step)."""
