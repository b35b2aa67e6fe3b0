"""No Python op classes for the chlo dialect (see __init__)."""
