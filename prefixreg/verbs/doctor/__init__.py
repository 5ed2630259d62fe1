"""`doctor`: what a worker says about its prompt cache, and what to change."""
