"""The layout proofs: the theorem registry (theorems), how they are proven (engine,
integer_reduction) and their outcome (certificate)."""
