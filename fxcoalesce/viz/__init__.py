"""What ``inspect`` draws: the collective DAG, its picture, the predicted timeline, and the
renderers (Graphviz, matplotlib)."""
