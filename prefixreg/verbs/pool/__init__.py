"""`pool`: place heads on several workers and prove them resident."""
